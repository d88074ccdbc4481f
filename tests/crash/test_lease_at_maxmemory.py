"""The scheduler's lease and heartbeat when Redis is full: ``maxmemory`` under ``noeviction``.

Redis then refuses every command that may need memory (SET, HSET, ZADD: "OOM command not
allowed") and still runs those that cannot (GET, PEXPIRE, DEL). ``lease.lua`` looks before
it writes, so the active scheduler keeps renewing its lease and a standby stays a standby;
only a free lease cannot be taken: the schedulers then sweep SQL without it (the SQL
compare-and-set keeps that safe) and say so once, naming out-of-memory. The heartbeat (HSET)
fails, is said once per scheduler, and comes back by itself once memory is freed.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.index.lease import SweeperLease
from orders.scheduler.sweeper import LOGGER_NAME, Sweeper
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.every_server

OUT_OF_MEMORY = "out of memory"
FILLER = "filler-"


@pytest.fixture
def full_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    """A redis-server of the test's own, under noeviction (the test sets its maxmemory)."""
    folder = Path(tempfile.mkdtemp(prefix="oom", dir="/tmp"))
    server = RedisServer(folder, "--maxmemory-policy", "noeviction", binary=redis_binary)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def used_memory(admin: redis.Redis) -> int:
    return int(admin.info("memory")["used_memory"])


def fill(admin: redis.Redis) -> int:
    """Set maxmemory a little above what is used and write keys (outside the service's
    prefix) until Redis refuses one with OOM; the number written. Then maxmemory goes 1 MB
    below what is used, so that the few bytes a DEL or ZREM frees do not make room."""
    admin.config_set("maxmemory", used_memory(admin) + 2_000_000)
    value = b"x" * 10_000
    for written in range(10_000):
        try:
            admin.set(f"{FILLER}{written}", value)
        except redis.exceptions.OutOfMemoryError:
            admin.config_set("maxmemory", used_memory(admin) - 1_000_000)
            return written
    raise AssertionError("Redis never refused a write")


def sweeper_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    """(owner, event) of every line but the routine ones."""
    routine = {"sweep", "summary", "reconcile"}
    lines = sweeper_lines(caplog)
    return [(ln["owner"], ln["event"]) for ln in lines if ln["event"] not in routine]


def details(caplog: pytest.LogCaptureFixture, event: str) -> list[str]:
    return [str(ln["detail"]) for ln in sweeper_lines(caplog) if ln["event"] == event]


@pytest.mark.timeout(60)
def test_at_maxmemory_the_active_scheduler_keeps_its_lease_and_a_standby_stays_standby(
    full_redis: RedisServer, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    settings = Settings(redis_url=full_redis.url)
    client = build_redis(settings)
    admin = redis.Redis(unix_socket_path=str(full_redis.socket), socket_timeout=5)
    service = OrderService(engine, client, settings, clock=clock)
    lease = SweeperLease(client, key_prefix=settings.key_prefix)
    active = Sweeper(service, owner="active", reconcile_at_start=False)
    standby = Sweeper(service, owner="standby", reconcile_at_start=False)
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    try:
        active.tick()
        standby.tick()
        due = service.create_unpaid_order("u1", ttl_s=1)
        assert fill(admin) > 0
        caplog.clear()

        # Full: three rounds of both. The holder renews, the standby stays out, the due
        # order is closed by the active one; each heartbeat failure is said once.
        clock.advance(s=2)
        for _ in range(3):
            assert 0 < active.tick() <= active.cadence_s
            assert 0 < standby.tick() <= standby.cadence_s
            assert lease.owner() == "active"
            assert 0 < client.pttl(lease.key) <= active.lease_ttl_ms
        assert (active.holds_lease, standby.holds_lease) == (True, False)
        assert (active.last_sweep_ms, standby.last_sweep_ms) == (clock(), None)
        assert service.get_order(due.id).status.value == "closed"
        assert events(caplog) == [("active", "heartbeat_failed"), ("standby", "heartbeat_failed")]
        assert all(OUT_OF_MEMORY in d for d in details(caplog, "heartbeat_failed"))

        # Still full, the lease let go: nobody can take it, so the standby sweeps SQL
        # without it and says so once, naming out-of-memory.
        active.close()
        assert lease.owner() is None
        caplog.clear()
        for _ in range(3):
            assert 0 < standby.tick() <= standby.cadence_s
        assert lease.owner() is None
        assert standby.last_sweep_ms == clock()
        assert events(caplog) == [("standby", "store_unavailable")]
        assert OUT_OF_MEMORY in details(caplog, "store_unavailable")[0]

        # Memory freed: the standby takes the lease at its next tick, and all is normal.
        admin.delete(*admin.keys(f"{FILLER}*"))
        caplog.clear()
        standby.tick()
        assert lease.owner() == "standby"
        assert events(caplog) == [
            ("standby", "store_back"),
            ("standby", "lease_acquired"),
            ("standby", "heartbeat_back"),
        ]
        assert [b.owner for b in standby.status.heartbeats.read(clock())] == ["standby"]
        service.create_unpaid_order("u2", ttl_s=60)
    finally:
        active.close()
        standby.close()
        client.close()
        admin.close()
