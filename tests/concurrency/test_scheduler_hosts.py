"""Three scheduler processes on three "hosts" (clocks 2 s behind, true, 2 s ahead) sharing one
Redis and one PostgreSQL, while the test creates orders and SIGKILLs the active one twice.

What tests/e2e/test_processes.py (one scheduler process) and
tests/concurrency/test_parallel_sweepers.py (three sweeps without a lease) do not cover:
the lease between processes whose clocks differ, and the takeover after a SIGKILL.
Asserted: at no instant do two processes sweep as lease holders (the held ticks of different
processes never overlap); after each kill, no standby takes the lease before the dead
holder's lease has run out, and the first standby tick after that takes it (so the takeover
comes within the lease's remaining time plus one standby cadence); every order is closed,
exactly once (one ``closed`` event each), never before its expiry in the closer's clock;
the index equals SQL after reconcile. Printed: each takeover's time.

It runs on one Redis server and again on a Redis Cluster (``cluster_too``): the children get
the test's Redis as ``ORDERS_REDIS_URL`` and ``ORDERS_REDIS_CLUSTER``.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine

from orders.config import Settings
from orders.index.lease import SweeperLease
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.processes import ChildProcess, started
from tests.support.reports import figures
from tests.support.stores import closed_event_counts, sql_rows
from tests.support.workers.hosts import MODULE as HOSTS

OFFSETS_MS = [-2000, 0, 2000]
LEASE_TTL_S = 1.5
INTERVAL_S = 0.25
#: Leeway between the test's reading of the lease's remaining time and the schedulers'
#: clocks (one machine: a few ms at most).
READ_LEEWAY_S = 0.05


class Checkout:
    """Creates orders at the true clock in a thread until stopped."""

    def __init__(self, service: OrderService) -> None:
        self.service = service
        self.ids: list[str] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        try:
            while not self.stop_event.wait(0.01):
                ttl_s = 0.2 + (n * 37 % 100) / 100
                order = self.service.create_unpaid_order(f"buyer-{n % 30}", ttl_s=ttl_s)
                self.ids.append(order.id)
                n += 1
        except BaseException as exc:
            self.error = exc

    def __enter__(self) -> Checkout:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop_event.set()
        self.thread.join(30)
        if self.error is not None:
            raise self.error


def wait_for(what: str, condition: Any, timeout_s: float = 30) -> Any:
    """Poll ``condition()`` until it returns something truthy (the test fails past the
    timeout: it guards a hang, the figures come from the ticks)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.005)
    return value


def read_ticks(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.cluster_too
@pytest.mark.timeout(240)
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_one_active_scheduler_across_skewed_hosts_and_takeover_after_sigkill(
    engine: Engine,
    database_url: str,
    redis_options: dict[str, Any],
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    specs = [
        (
            "scheduler",
            {
                "name": f"host{n}",
                "offset_ms": offset,
                "interval_s": INTERVAL_S,
                "lease_ttl_s": LEASE_TTL_S,
                "ticks_path": str(tmp_path / f"host{n}.ticks"),
            },
        )
        for n, offset in enumerate(OFFSETS_MS)
    ]
    settings = Settings(database_url=database_url, unpaid_limit=1000, **redis_options)
    service = OrderService(engine, redis_client, settings)
    lease = SweeperLease(redis_client, key_prefix=settings.key_prefix)
    kills: list[dict[str, Any]] = []
    with started(
        specs,
        database_url=database_url,
        redis_options=redis_options,
        log_dir=tmp_path,
        module=HOSTS,
    ) as workers:
        by_pid = {w.pid: w for w in workers}

        def holder() -> ChildProcess | None:
            owner = lease.owner()
            return None if owner is None else by_pid[int(owner.split(":")[-2])]

        for worker in workers:
            worker.go()
        with Checkout(service) as checkout:
            active = wait_for("a first lease holder", holder)
            for _ in range(2):
                time.sleep(1.0)  # the holder sweeps a while
                os.kill(active.pid, signal.SIGKILL)
                killed_at = time.time()
                active.proc.wait(10)
                # Read once the process is reaped: a renewal it sent just before the kill
                # may still wait in the server's socket buffer, and on a loaded machine the
                # server can run it after a TTL read that raced it (the lease then lasts a
                # full TTL longer than that read said).
                remaining_ms = int(redis_client.pttl(lease.key))
                read_at = time.time()  # the server read the TTL between the two instants
                kills.append(
                    {
                        "name": active.name,
                        "at_s": killed_at,
                        "read_at_s": read_at,
                        "lease_left_ms": remaining_ms,
                    }
                )
                dead = active
                active = wait_for(
                    "a takeover", lambda d=dead: (h := holder()) not in (None, d) and h
                )
                kills[-1]["successor"] = active.name
        wait_for(
            "every order closed",
            lambda: all(row.status != "unpaid" for row in sql_rows(engine).values()),
        )
        active.stop()
        active.result(timeout_s=30)

    ticks = {w.name: read_ticks(tmp_path / f"{w.name}.ticks") for w in workers}

    # --- one holder at a time, takeover at the first tick after the lease ran out ---
    held = sorted(
        (t["start_s"], t["end_s"], name) for name, ts in ticks.items() for t in ts if t["held"]
    )
    for (_, end_a, name_a), (start_b, _, name_b) in itertools.pairwise(held):
        if name_a != name_b:
            assert end_a <= start_b, f"{name_a} and {name_b} swept as holders at once"
    takeovers = []
    for kill in kills:
        # The lease ran out between these two (how long reading its TTL took; a loaded
        # machine may take a while).
        expired_at = kill["at_s"] + kill["lease_left_ms"] / 1000
        surely_expired_at = kill["read_at_s"] + kill["lease_left_ms"] / 1000
        first = min(
            t["start_s"]
            for t in ticks[kill["successor"]]
            if t["held"] and t["start_s"] > kill["at_s"]
        )
        assert first >= expired_at - READ_LEEWAY_S, "the lease was taken before it ran out"
        for name, ts in ticks.items():
            missed = [
                t
                for t in ts
                if not t["held"] and surely_expired_at + READ_LEEWAY_S < t["start_s"] < first
            ]
            assert not missed, f"{name} ticked after the lease ran out and did not take it"
        takeovers.append(round(first - kill["at_s"], 3))

    # --- every order closed exactly once, never early in its closer's clock ---
    rows = sql_rows(engine)
    assert set(rows) == set(checkout.ids)
    assert {row.status for row in rows.values()} == {"closed"}
    assert all(row.closed_at_ms >= row.expires_at_ms for row in rows.values())
    assert set(closed_event_counts(engine).items()) == {(oid, 1) for oid in rows}

    # --- the index equals SQL (empty: nothing is open) after reconcile ---
    checker = OrderService(
        engine,
        redis_client,
        settings,
        clock=ManualClock(max(r.updated_at_ms for r in rows.values())),
    )
    checker.reconcile()
    assert all(checker.index.members(row.user_id) == {} for row in rows.values())

    lags = [row.closed_at_ms - row.expires_at_ms for row in rows.values()]
    print(
        f"\n[scheduler hosts, clocks {OFFSETS_MS} ms, lease {LEASE_TTL_S} s, interval "
        f"{INTERVAL_S} s] {len(rows)} orders closed once each; held ticks per host "
        f"{ {n: sum(t['held'] for t in ts) for n, ts in ticks.items()} }; kills "
        f"{[(k['name'], k['lease_left_ms'], k['successor']) for k in kills]}; takeover after "
        f"the kill {takeovers} s; closed_at - expires_at as stored (the closer's clock "
        f"against the true one), ms: {figures(lags)}"
    )
