"""Redis down, hung, flushed or misconfigured: what each use case does."""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, func, select

from orders import StoreUnavailable, UnpaidOrderLimitReached
from orders.bootstrap import build_redis, build_service
from orders.config import Settings
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.redis_server import RedisServer, own_server

pytestmark = pytest.mark.every_server


@pytest.fixture
def own_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    """A redis-server of this test's own, which the test may stop, freeze or reconfigure."""
    with own_server(redis_binary) as server:
        yield server


def service_on(
    server: RedisServer, engine: Engine, clock: ManualClock, **overrides: object
) -> OrderService:
    settings = Settings(redis_url=server.url, **overrides)  # type: ignore[arg-type]
    return OrderService(engine, build_redis(settings), settings, clock=clock)


def row_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(orders_table)) or 0)


def test_a_hung_redis_refuses_creation_within_about_a_second_and_writes_nothing(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = service_on(own_redis, engine, clock)
    service.create_unpaid_order("u1")  # connected and warm
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)  # accepts nothing, answers nothing

    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        service.create_unpaid_order("u1")
    waited_s = time.monotonic() - started

    assert info.value.store == "redis"
    # The default socket timeout is 0.5 s with one retry: about a second. The bound here is
    # loose on purpose (a shared, noisy machine); it proves the call does not hang.
    assert waited_s < 5, waited_s
    assert row_count(engine) == 1
    service.index.client.close()


def test_payments_and_cancels_commit_while_redis_is_hung(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = service_on(own_redis, engine, clock)
    paid, cancelled = (service.create_unpaid_order("u1") for _ in range(2))
    assert own_redis.proc is not None
    own_redis.proc.send_signal(signal.SIGSTOP)

    started = time.monotonic()
    assert service.mark_paid(paid.id).status == "paid"
    assert service.cancel_order(cancelled.id).status == "cancelled"
    waited_s = time.monotonic() - started

    assert waited_s < 10, waited_s  # two Redis timeouts, each about a second at most
    own_redis.proc.send_signal(signal.SIGCONT)
    # A timed-out ZREM may still run once the server wakes; whatever stayed, a reconcile
    # removes, and nothing ever undoes the SQL commits.
    service.reconcile()
    assert service.index.members("u1") == {}
    assert service.get_order(paid.id).status == "paid"
    assert service.get_order(cancelled.id).status == "cancelled"
    service.index.client.close()


def test_degraded_mode_admits_through_the_sql_guard_alone_and_still_holds_the_limit(
    engine: Engine, database_url: str, clock: ManualClock
) -> None:
    settings = Settings(
        database_url=database_url,
        redis_url="unix:///tmp/orders-no-such-redis.sock",
        create_without_redis=True,
        unpaid_limit=2,
    )
    client = build_redis(settings)
    try:
        service = OrderService(engine, client, settings, clock=clock)
        service.create_unpaid_order("u1")
        service.create_unpaid_order("u1")
        with pytest.raises(UnpaidOrderLimitReached) as info:
            service.create_unpaid_order("u1")
    finally:
        client.close()
    assert info.value.open_count == 2
    assert row_count(engine) == 2


def test_without_degraded_mode_creation_is_refused_when_redis_is_down(
    engine: Engine, database_url: str, clock: ManualClock
) -> None:
    settings = Settings(redis_url="unix:///tmp/orders-no-such-redis.sock")
    client = build_redis(settings)
    try:
        service = OrderService(engine, client, settings, clock=clock)
        with pytest.raises(StoreUnavailable):
            service.create_unpaid_order("u1")
    finally:
        client.close()
    assert row_count(engine) == 0


def test_script_flush_is_invisible_to_callers(
    service: OrderService, redis_client: redis.Redis
) -> None:
    service.create_unpaid_order("u1")
    redis_client.script_flush()

    order = service.create_unpaid_order("u1")

    assert order.id in service.index.members("u1")


def test_a_restarted_redis_is_invisible_to_callers_after_reconcile(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = service_on(own_redis, engine, clock, unpaid_limit=2)
    first = service.create_unpaid_order("u1")
    own_redis.stop()
    own_redis.start()  # no persistence: empty, and the scripts are gone too

    service.reconcile()
    second = service.create_unpaid_order("u1")
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1")

    assert set(service.index.members("u1")) == {first.id, second.id}
    service.index.client.close()


def test_startup_warns_when_redis_would_evict_keys_or_has_no_persistence(
    own_redis: RedisServer,
    database_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with redis.Redis.from_url(own_redis.url) as admin:
        admin.config_set("maxmemory-policy", "allkeys-lru")
    caplog.set_level(logging.WARNING, logger="orders.bootstrap")

    service = build_service(Settings(database_url=database_url, redis_url=own_redis.url))
    service.engine.dispose()
    service.index.client.close()

    warnings = [r.getMessage() for r in caplog.records if r.name == "orders.bootstrap"]
    assert any("allkeys-lru" in w for w in warnings)
    assert any("no persistence" in w for w in warnings)


def test_no_warning_for_a_persistent_noeviction_server(
    service: OrderService, own_redis: RedisServer
) -> None:
    with redis.Redis.from_url(own_redis.url) as admin:
        admin.config_set("appendonly", "yes")
        settings = Settings(redis_url=own_redis.url)
        client = build_redis(settings)
        try:
            assert OrderService(service.engine, client, settings).index.server_warnings() == []
        finally:
            client.close()
            # Off again: a server with its AOF on took the whole 10 s grace of SIGTERM to
            # stop, in every copy of this test.
            admin.config_set("appendonly", "no")


def test_passwords_never_reach_logs_or_errors(
    engine: Engine, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = Settings(
        database_url=database_url, redis_url="redis://user:hunter2secret@127.0.0.1:1/0"
    )
    service = build_service(settings)
    try:
        with pytest.raises(StoreUnavailable) as info:
            service.create_unpaid_order("u1")
    finally:
        service.engine.dispose()
        service.index.client.close()
    text = "\n".join(r.getMessage() for r in caplog.records) + str(info.value) + repr(settings)
    assert "127.0.0.1" in text or "redis" in text
    assert "hunter2secret" not in text


def test_a_create_on_a_redis_at_maxmemory_is_store_unavailable_and_writes_nothing(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = service_on(own_redis, engine, clock)
    # An expired member: the old script dropped it first, and that first write let its ZADD
    # pass a full server.
    service.create_unpaid_order("u1", ttl_s=1)
    clock.advance(s=2)
    members_before = service.index.members("u1")
    with redis.Redis.from_url(own_redis.url) as admin:
        admin.config_set("maxmemory-policy", "noeviction")
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory", used // 2)  # full: every write that may grow is refused

        with pytest.raises(StoreUnavailable) as info:
            service.create_unpaid_order("u1", order_id="full-1")

        assert info.value.store == "redis"
        assert "out of memory" in str(info.value)
        assert row_count(engine) == 1
        assert service.index.members("u1") == members_before
        admin.config_set("maxmemory", 0)
    assert service.create_unpaid_order("u1", order_id="full-1").id == "full-1"
    assert row_count(engine) == 2
    service.index.client.close()
