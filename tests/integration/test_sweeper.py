"""The scheduler: the Redis lease, Sweeper.tick, and real ``run_scheduler`` processes.

The lease and tick tests run on the test's stores with the manual clock (the lease itself
lives on Redis's own clock, PX). The process tests start real scheduler processes on the
same stores; those use the real clock, so the orders they close are created by a service
on the real clock too, and the tests poll (with a deadline) for the final state of SQL and
of the lease. Every process a test starts is killed by the test.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis
from sqlalchemy import Engine, func, insert, select

from orders.bootstrap import build_engine, build_redis
from orders.config import Settings
from orders.domain import SweepResult
from orders.errors import InvalidInput, StoreUnavailable
from orders.events.consumer import ConsumeResult, EventConsumer, OrderEvent
from orders.index.lease import SweeperLease
from orders.scheduler.jobs import JOB_ID, RECONCILE_CHECK_S, build_scheduler
from orders.scheduler.sweeper import LOGGER_NAME, Sweeper
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from orders.sql.transactions import Transactions
from orders.validation import check_user_id
from tests.support.clocks import ManualClock, Monotonic
from tests.support.processes import child_env, stop_process
from tests.support.stores import closed_event_counts, create_orders, sql_rows

MISSING_SOCKET_URL = "unix:///tmp/orders-test-no-such-redis.sock"
T = TypeVar("T")


# --- helpers ---------------------------------------------------------------------------------


def count_closed_events(engine: Engine) -> int:
    query = select(func.count()).where(events_table.c.kind == "closed")
    with engine.connect() as conn:
        return int(conn.scalar(query) or 0)


def sweeper_records(caplog: pytest.LogCaptureFixture, level: int) -> list[dict[str, Any]]:
    return [
        json.loads(r.getMessage())
        for r in caplog.records
        if r.name == "orders.sweeper" and r.levelno >= level
    ]


def wait_until(
    predicate: Callable[[], T], what: str, *, timeout_s: float = 15, check: Callable[[], None]
) -> T:
    """Poll ``predicate`` every 20 ms until it returns something truthy; ``check`` runs each
    round too (it fails fast when a process died)."""
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def noop() -> None:
    pass


def pid_of(owner: str | None) -> int | None:
    """The pid in a ``host:pid:random`` owner token."""
    return None if owner is None else int(owner.rsplit(":", 2)[1])


def lease_of(service: OrderService) -> SweeperLease:
    """The sweeper lease under the service's key prefix, as its sweepers take it."""
    return SweeperLease(service.index.client, key_prefix=service.index.key_prefix)


def real_clock_service(engine: Engine, redis_client: redis.Redis) -> OrderService:
    """A service on the test's stores and the real clock, like the scheduler processes."""
    return OrderService(engine, redis_client, Settings())


def record_sweeps(service: OrderService, monkeypatch: pytest.MonkeyPatch) -> list[SweepResult]:
    """Every SweepResult the service returns from now on, in order."""
    results: list[SweepResult] = []
    original = service.sweep_expired

    def recorded(**kwargs: Any) -> SweepResult:
        result = original(**kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(service, "sweep_expired", recorded)
    return results


def events_of(caplog: pytest.LogCaptureFixture, level: int) -> list[tuple[str, str]]:
    return [(r["event"], r["owner"]) for r in sweeper_records(caplog, level)]


# --- the lease -------------------------------------------------------------------------------


def test_lease_is_taken_by_one_owner_renewed_and_released_only_by_it(
    service: OrderService, redis_client: redis.Redis
) -> None:
    lease = lease_of(service)
    key = lease.key
    assert lease.owner() is None

    assert lease.acquire("A", 1000) is True
    assert lease.acquire("B", 60_000) is False
    assert lease.owner() == "A"
    assert 0 < redis_client.pttl(key) <= 1000  # B's attempt left A's lease as it was

    # Renewal by its owner: the PTTL goes back up.
    deadline = time.monotonic() + 5
    while redis_client.pttl(key) > 900:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert lease.acquire("A", 1000) is True
    assert redis_client.pttl(key) > 900
    assert lease.acquire("A", 60_000) is True
    assert redis_client.pttl(key) > 59_000

    assert lease.release("B") is False
    assert lease.owner() == "A"
    assert lease.release("A") is True
    assert lease.owner() is None
    assert lease.release("A") is False

    assert lease.acquire("B", 1000) is True
    assert lease.owner() == "B"


def test_lease_that_lapses_can_be_taken_by_another_owner(service: OrderService) -> None:
    lease = lease_of(service)
    assert lease.acquire("A", 50)

    deadline = time.monotonic() + 5
    while not lease.acquire("B", 1000):
        assert time.monotonic() < deadline, "A's 50 ms lease never lapsed"
        time.sleep(0.01)

    assert lease.owner() == "B"
    assert lease.acquire("A", 1000) is False


def test_lease_key_is_under_the_prefix_and_can_never_be_a_users_key(
    service: OrderService, make_service: Callable[..., OrderService]
) -> None:
    assert Sweeper(service).lease.key == "UnpaidOrder-[sweeper-lease]"
    assert Sweeper(make_service(key_prefix="Shop7-")).lease.key == "Shop7-[sweeper-lease]"
    with pytest.raises(InvalidInput):
        check_user_id("[sweeper-lease]", 128)
    with pytest.raises(InvalidInput):
        service.create_unpaid_order("[sweeper-lease]")


@pytest.mark.parametrize(("owner", "ttl_ms"), [("", 1000), ("A", 0), ("A", -5), ("A", True)])
def test_lease_refuses_an_empty_owner_or_a_ttl_below_one_ms(
    service: OrderService, owner: str, ttl_ms: int
) -> None:
    with pytest.raises(InvalidInput):
        lease_of(service).acquire(owner, ttl_ms)
    assert lease_of(service).owner() is None


# --- Sweeper.tick ------------------------------------------------------------------------------


def test_default_owner_names_host_and_pid(service: OrderService) -> None:
    sweeper = Sweeper(service)
    assert pid_of(sweeper.owner) == os.getpid()
    assert Sweeper(service).owner != sweeper.owner


def test_active_sweeper_closes_due_orders_and_a_standby_closes_nothing(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    active = Sweeper(service, owner="host-a:1:aaaa")
    standby = Sweeper(service, owner="host-b:2:bbbb")
    active.tick()
    orders = create_orders(service, [1, 2, 3], users=["u1", "u2"])
    clock.advance(s=5)

    assert standby.tick() == 1.0
    assert closed_event_counts(engine) == Counter()
    assert lease_of(service).owner() == "host-a:1:aaaa"
    assert (active.holds_lease, standby.holds_lease) == (True, False)

    active.tick()

    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})
    assert {row.status for row in sql_rows(engine).values()} == {"closed"}


def test_tick_returns_the_time_until_the_earliest_expiry_when_sooner_than_the_interval(
    service: OrderService, clock: ManualClock
) -> None:
    sweeper = Sweeper(service)  # interval 1 s
    assert sweeper.tick() == 1.0  # nothing open

    soon = service.create_unpaid_order("u1", ttl_s=0.3)
    service.create_unpaid_order("u2", ttl_s=5)
    assert sweeper.tick() == pytest.approx(0.3)
    clock.advance(ms=250)
    assert sweeper.tick() == pytest.approx(0.05)

    clock.set(soon.expires_at_ms)
    assert sweeper.tick() == 1.0  # closed it; the next expiry is 4.7 s away
    assert service.get_order(soon.id).status.value == "closed"

    sweeper.close()
    fast = Sweeper(service, interval_s=0.2)
    assert fast.tick() == pytest.approx(0.2)  # the next expiry is further off than that
    assert fast.holds_lease


def test_tick_after_a_sweep_that_left_due_orders_asks_to_run_again_at_once(
    service: OrderService, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_orders(service, [1, 1, 1])
    clock.advance(s=2)
    sweeper = Sweeper(service, batch_size=1)
    original = service.sweep_expired

    def one_batch(**kwargs: Any) -> Any:
        return original(**kwargs, max_batches=1)

    monkeypatch.setattr(service, "sweep_expired", one_batch)

    assert 0 < sweeper.tick() <= 0.001
    assert service.count_due() == 2


def test_sweep_that_closed_orders_logs_one_json_line_with_its_counts_at_debug(
    service: OrderService, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    sweeper = Sweeper(service, batch_size=2, owner="host:123:cafe")
    sweeper.tick()
    create_orders(service, [1, 1, 1], users=["u1", "u2"])
    clock.advance(s=1.5)
    caplog.set_level(logging.DEBUG, logger="orders.sweeper")
    caplog.clear()

    sweeper.tick()

    assert sweeper_records(caplog, logging.INFO) == []  # the summary comes later
    records = sweeper_records(caplog, logging.DEBUG)
    assert len(records) == 1
    line = records[0]
    assert isinstance(line.pop("duration_ms"), int)
    assert line == {
        "event": "sweep",
        "closed": 3,
        "batches": 2,
        "users": 2,
        "cutoff_ms": clock(),
        "max_lag_ms": 500,
        "redis_errors": 0,
        "reminded": 0,
        "owner": "host:123:cafe",
    }


def test_sweep_that_closed_nothing_logs_nothing_at_info(
    service: OrderService, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    sweeper = Sweeper(service)
    sweeper.tick()
    assert [r["event"] for r in sweeper_records(caplog, logging.INFO)] == ["lease_acquired"]
    caplog.clear()
    service.create_unpaid_order("u1", ttl_s=10)

    for _ in range(3):
        sweeper.tick()
        clock.advance(s=1)

    assert sweeper_records(caplog, logging.INFO) == []


def test_tick_with_redis_down_still_closes_due_orders_in_sql_and_warns_once(
    service: OrderService, engine: Engine, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    orders = create_orders(service, [1, 2], users=["u1", "u2"])
    clock.advance(s=5)
    settings = Settings(redis_url=MISSING_SOCKET_URL)
    no_redis = OrderService(engine, build_redis(settings), settings, clock=clock)
    sweeper = Sweeper(no_redis)
    caplog.set_level(logging.INFO, logger="orders.sweeper")

    first = sweeper.tick()
    later = create_orders(service, [1])
    clock.advance(s=5)
    sweeper.tick()
    sweeper.tick()

    assert 0 < first <= 1.0
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in [*orders, *later]})
    warnings = sweeper_records(caplog, logging.WARNING)
    assert [(w["event"], w["store"]) for w in warnings] == [("store_unavailable", "redis")]


def test_tick_with_sql_down_sweeps_nothing_warns_once_and_recovers(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=1)
    clock.advance(s=2)
    dead = build_engine(Settings(database_url=f"sqlite:///{tmp_path}/missing/dir/orders.db"))
    sweeper = Sweeper(service)
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    monkeypatch = pytest.MonkeyPatch()
    try:
        # Every SQL call goes there (PostgreSQL's autocommit statements too).
        monkeypatch.setattr(service.records, "tx", Transactions(dead))
        assert sweeper.tick() == sweeper.cadence_s
        assert sweeper.tick() == sweeper.cadence_s
    finally:
        monkeypatch.undo()
        dead.dispose()
    sweeper.tick()

    events = [
        {key: r[key] for key in ("event", "store") if key in r}
        for r in sweeper_records(caplog, logging.INFO)
    ]
    assert events == [
        {"event": "lease_acquired"},
        {"event": "store_unavailable", "store": "sql"},
        {"event": "store_back", "store": "sql"},
    ]
    assert closed_event_counts(engine) == Counter({order.id: 1})


def test_request_stop_during_a_sweep_stops_after_the_batch_in_hand(
    service: OrderService, engine: Engine, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    orders = create_orders(service, [1, 2, 3, 4, 5, 6], users=["u1", "u2"])
    clock.advance(s=10)
    sweeper = Sweeper(service, batch_size=2)
    original = service.sweep_expired
    asked = 0

    def sweep_stopped_after_one_batch(**kwargs: Any) -> Any:
        inner = kwargs.pop("should_stop")

        def should_stop() -> bool:
            nonlocal asked
            asked += 1
            if asked == 2:  # asked before the second batch: the first is done
                sweeper.request_stop()
            return bool(inner())

        return original(**kwargs, should_stop=should_stop)

    monkeypatch.setattr(service, "sweep_expired", sweep_stopped_after_one_batch)

    sweeper.tick()

    first_two = {o.id for o in orders[:2]}
    assert closed_event_counts(engine) == Counter(dict.fromkeys(first_two, 1))
    rows = sql_rows(engine)
    assert {oid for oid, row in rows.items() if row.status == "unpaid"} == {
        o.id for o in orders[2:]
    }
    sweeper.tick()  # a stopped sweeper does nothing any more
    assert asked == 2
    monkeypatch.undo()
    assert service.sweep_expired().closed == 4
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})


def test_sweeper_whose_lease_was_taken_over_stops_after_the_batch_in_hand(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    orders = create_orders(service, [1, 2, 3, 4], users=["u1", "u2"])
    clock.advance(s=10)
    slow = Sweeper(service, batch_size=1, lease_ttl_s=0.3, owner="host:1:slow")
    other = Sweeper(service, owner="host:2:other")
    original = service.sweep_expired
    asked = 0

    def lease_lapses_after_one_batch(**kwargs: Any) -> Any:
        inner = kwargs.pop("should_stop")

        def should_stop() -> bool:
            nonlocal asked
            asked += 1
            if asked == 2:  # the first batch is done; meanwhile the lease lapses and moves
                service.index.client.delete(lease_of(service).key)
                assert lease_of(service).acquire(other.owner, 5000)
                time.sleep(0.11)  # past the renewal period (lease_ttl_s / 3)
            return bool(inner())

        return original(**kwargs, should_stop=should_stop)

    monkeypatch.setattr(service, "sweep_expired", lease_lapses_after_one_batch)
    caplog.set_level(logging.INFO, logger="orders.sweeper")

    assert slow.tick() == slow.cadence_s

    assert closed_event_counts(engine) == Counter({orders[0].id: 1})
    assert not slow.holds_lease
    assert lease_of(service).owner() == other.owner
    events = [r["event"] for r in sweeper_records(caplog, logging.INFO)]
    assert events == ["lease_acquired", "lease_lost"]  # the lag is the new holder's to judge


def test_close_releases_our_lease_and_never_another_owners(service: OrderService) -> None:
    holder = Sweeper(service)
    other = Sweeper(service)
    holder.tick()
    other.tick()

    other.close()
    assert lease_of(service).owner() == holder.owner
    holder.close()
    assert lease_of(service).owner() is None
    assert holder.tick() == holder.cadence_s  # closed: does not take the lease again
    assert lease_of(service).owner() is None


@pytest.mark.parametrize(
    "kwargs",
    [{"interval_s": 0}, {"lease_ttl_s": -1.0}, {"interval_s": float("nan")}, {"batch_size": 0}],
)
def test_sweeper_refuses_bad_settings(service: OrderService, kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        Sweeper(service, **kwargs)
    with pytest.raises(InvalidInput):
        Sweeper(service, owner=" ")


def test_sweeper_rebuilds_the_index_once_active_unless_told_to_skip_the_startup_rebuild(
    service: OrderService,
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=60)
    service.index.client.delete(service.index.key("u1"))  # the member is lost
    service.index.epoch.set("before")  # but the index looks whole: no "index_lost" rebuild

    skipping = Sweeper(service, reconcile_at_start=False)
    skipping.tick()
    assert skipping.holds_lease
    skipping.reconcile_if_due()
    assert service.index.epoch.get() == "before"
    assert service.index.members("u1") == {}
    skipping.close()

    default = Sweeper(service)
    default.tick()
    default.reconcile_if_due()
    assert service.index.epoch.get() != "before"
    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    default.close()


# --- what the scheduler logs -------------------------------------------------------------------


def test_summary_comes_at_most_once_per_period_with_the_totals_since_the_last_one(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mono = Monotonic()
    sweeper = Sweeper(service, batch_size=2, summary_period_s=10, monotonic=mono)
    sweeps = record_sweeps(service, monkeypatch)
    caplog.set_level(logging.DEBUG, logger="orders.sweeper")
    caplog.clear()
    summaries: list[tuple[float, int, dict[str, Any]]] = []  # (when, sweeps before it, line)
    created = 0
    for n in range(12):  # a tick every 3 s; before each, 1 to 3 orders fall due 1 s late
        created += len(create_orders(service, [1] * (n % 3 + 1), users=[f"u{n}", "v"]))
        clock.advance(s=2)
        mono.advance(3)
        caplog.clear()
        sweeper.tick()
        for line in sweeper_records(caplog, logging.INFO):
            if line["event"] == "summary":
                summaries.append((mono.now, len(sweeps), line))

    assert [when for when, _, _ in summaries] == [1012, 1024, 1036]
    start = 0
    for _, end, line in summaries:
        window = [r for r in sweeps[start:end] if r.closed]
        start = end
        assert line == {
            "event": "summary",
            "sweeps": len(window),
            "closed": sum(r.closed for r in window),
            "batches": sum(r.batches for r in window),
            "max_lag_ms": max(r.max_lag_ms or 0 for r in window),
            "handled": 0,
            "failed": 0,
            "retried_ok": 0,
            "over_s": 12.0,
            "owner": sweeper.owner,
        }
    assert sum(line["closed"] for _, _, line in summaries) == created
    assert count_closed_events(engine) == created

    # Nothing closed: however long it is quiet, no summary.
    caplog.clear()
    for _ in range(5):
        mono.advance(30)
        sweeper.tick()
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []

    # After a quiet spell a close is summed up at once; what is left at close, then.
    create_orders(service, [1, 1], users=["w"])
    clock.advance(s=2)
    sweeper.tick()
    create_orders(service, [1], users=["w"])
    clock.advance(s=2)
    mono.advance(1)
    sweeper.tick()
    sweeper.close()
    lines = sweeper_records(caplog, logging.INFO)
    assert [(r["event"], r.get("closed")) for r in lines] == [
        ("summary", 2),
        ("summary", 1),
        ("lease_released", None),
    ]
    # Each sweep that closed something had its own line, at DEBUG.
    assert [r.levelno for r in caplog.records if '"event": "sweep"' in r.getMessage()] == [
        logging.DEBUG,
        logging.DEBUG,
    ]


def test_backlog_is_logged_at_once_when_it_starts_and_once_when_it_clears(
    service: OrderService,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mono = Monotonic()
    sweeper = Sweeper(service, batch_size=2, backlog_lag_s=5, summary_period_s=3600, monotonic=mono)
    sweeper.tick()
    original = service.sweep_expired

    def one_batch(**kwargs: Any) -> SweepResult:
        return original(**kwargs, max_batches=1)

    monkeypatch.setattr(service, "sweep_expired", one_batch)
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    caplog.clear()
    create_orders(service, [1] * 5, users=["u1", "u2", "u3"])
    clock.advance(s=61)  # the scheduler was away for a minute
    mono.advance(61)

    sweeper.tick()  # closes 2 a minute late, leaves 3 as old

    assert [(r.levelno, json.loads(r.getMessage())) for r in caplog.records] == [
        (
            logging.WARNING,
            {
                "event": "backlog",
                "lag_ms": 60_000,
                "max_lag_ms": 60_000,
                "oldest_due_ms": 60_000,
                "due": 3,
                "threshold_ms": 5000,
                "owner": sweeper.owner,
            },
        )
    ]
    caplog.clear()
    for _ in range(2):  # still behind: nothing more
        mono.advance(1)
        sweeper.tick()
    create_orders(service, [1])
    clock.advance(s=4)  # 3 s late: under the threshold, yet over half of it
    mono.advance(4)
    sweeper.tick()
    assert sweeper_records(caplog, logging.INFO) == []

    mono.advance(1)
    sweeper.tick()  # nothing due any more
    for _ in range(3):
        mono.advance(1)
        sweeper.tick()

    assert sweeper_records(caplog, logging.INFO) == [
        {"event": "backlog_cleared", "lasted_s": 7.0, "owner": sweeper.owner}
    ]
    assert service.count_due() == 0


def test_lease_changes_are_logged_at_once_by_both_sweepers(
    service: OrderService, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    mono = Monotonic()  # never moves: no summary is due until close
    a = Sweeper(service, owner="host:1:a", monotonic=mono)
    b = Sweeper(service, owner="host:2:b", monotonic=mono)
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    caplog.clear()

    a.tick()
    b.tick()
    assert events_of(caplog, logging.INFO) == [("lease_acquired", "host:1:a")]
    create_orders(service, [1, 1])
    clock.advance(s=2)
    a.tick()  # closes 2; the summary waits for its period
    assert events_of(caplog, logging.INFO) == [("lease_acquired", "host:1:a")]

    caplog.clear()
    service.index.client.delete(lease_of(service).key)  # a's lease lapsed (a stalled)
    b.tick()
    assert events_of(caplog, logging.INFO) == [("lease_acquired", "host:2:b")]
    a.tick()
    assert events_of(caplog, logging.INFO)[1:] == [("lease_lost", "host:1:a")]

    caplog.clear()
    a.close()
    b.close()
    assert events_of(caplog, logging.INFO) == [
        ("summary", "host:1:a"),
        ("lease_released", "host:2:b"),
    ]


def test_rebuild_waits_for_a_running_tick_before_it_starts_and_between_its_chunks(
    service: OrderService, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for user in ("u1", "u2", "u3"):
        service.create_unpaid_order(user, ttl_s=60)
        service.index.client.delete(service.index.key(user))  # the rebuild has work
    sweeper = Sweeper(service)
    sweeper.tick()  # takes the lease
    steps: list[str] = []
    in_sweep, release_sweep, chunk_one = threading.Event(), threading.Event(), threading.Event()
    original_sweep, original_reconcile = service.sweep_expired, service.reconcile

    def blocking_sweep(**kwargs: Any) -> SweepResult:
        in_sweep.set()
        assert release_sweep.wait(10)
        steps.append("sweep ends")
        return original_sweep(**kwargs)

    def reconcile_in_chunks_of_one(**kwargs: Any) -> Any:
        steps.append("rebuild starts")
        inner = kwargs.pop("on_progress")

        def on_progress(users: int) -> None:
            if users == 1:
                chunk_one.set()
                assert in_sweep.wait(10)  # a tick is now in the middle of its sweep
            inner(users)
            steps.append(f"after chunk {users}")

        return original_reconcile(**kwargs, chunk_size=1, on_progress=on_progress)

    monkeypatch.setattr(service, "sweep_expired", blocking_sweep)
    monkeypatch.setattr(service, "reconcile", reconcile_in_chunks_of_one)

    def run(target: Callable[[], object]) -> threading.Thread:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    # 1. A tick is sweeping: the rebuild does not start until it ends.
    ticking = run(sweeper.tick)
    assert in_sweep.wait(10)
    in_sweep.clear()
    rebuilding = run(sweeper.reconcile_if_due)
    time.sleep(0.3)  # time enough for a rebuild that does not wait to start
    steps.append("released")
    release_sweep.set()
    ticking.join(10)
    release_sweep.clear()
    assert chunk_one.wait(10)
    assert steps[:3] == ["released", "sweep ends", "rebuild starts"]

    # 2. A tick starts after the rebuild's first chunk: the next chunk waits for it.
    ticking = run(sweeper.tick)
    assert in_sweep.wait(10)
    time.sleep(0.3)  # time enough for a rebuild that does not wait to go on
    steps.append("released")
    release_sweep.set()
    ticking.join(10)
    rebuilding.join(10)
    assert not rebuilding.is_alive()
    assert steps[3:6] == ["released", "sweep ends", "after chunk 1"]
    assert "after chunk 3" in steps
    assert all(service.index.members(u) != {} for u in ("u1", "u2", "u3"))
    sweeper.close()


def test_a_stop_request_ends_a_rebuild_between_two_chunks(
    service: OrderService, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for user in ("u1", "u2", "u3"):
        service.create_unpaid_order(user, ttl_s=60)
    service.index.client.flushdb()
    sweeper = Sweeper(service)
    sweeper.tick()
    chunks: list[int] = []
    original = service.reconcile

    def reconcile_in_chunks_of_one(**kwargs: Any) -> Any:
        inner = kwargs.pop("on_progress")

        def on_progress(users: int) -> None:
            chunks.append(users)
            sweeper.request_stop()  # SIGTERM arrives during the first chunk
            inner(users)

        return original(**kwargs, chunk_size=1, on_progress=on_progress)

    monkeypatch.setattr(service, "reconcile", reconcile_in_chunks_of_one)
    caplog.set_level(logging.DEBUG, logger="orders.sweeper")
    caplog.clear()

    sweeper.reconcile_if_due()

    assert chunks == [1]
    assert service.index.epoch.get() is None  # not a whole rebuild: no marker
    assert [r["event"] for r in sweeper_records(caplog, logging.DEBUG)] == ["reconcile_stopped"]
    sweeper.close()


# --- the APScheduler job, in this process ------------------------------------------------------


def test_background_scheduler_wakes_at_each_expiry_and_shuts_down_cleanly(
    engine: Engine, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    service = real_clock_service(engine, redis_client)
    # A cadence longer than the test may wait: the orders close on time only if each run
    # comes when the last tick asked, at the next expiry.
    sweeper = Sweeper(service, interval_s=60, lease_ttl_s=600)
    scheduler = build_scheduler(sweeper, blocking=False)
    job = scheduler.get_job(JOB_ID)
    assert scheduler.timezone == UTC
    assert (job.max_instances, job.coalesce, job.misfire_grace_time) == (1, True, None)
    caplog.set_level(logging.WARNING)
    ids = {o.id for o in create_orders(service, [0.5, 0.6, 0.65], users=["u1", "u2"])}
    scheduler.add_job(noop, "interval", seconds=0.05, id="the-hosts-own")  # keeps its trigger
    scheduler.start()
    try:
        wait_until(
            lambda: closed_event_counts(engine).keys() >= ids, "the orders to close", check=noop
        )
        assert lease_of(service).owner() == sweeper.owner
    finally:
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()

    rows = sql_rows(engine)
    assert max(rows[oid].closed_at_ms - rows[oid].expires_at_ms for oid in ids) < 1500
    assert lease_of(service).owner() is None
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_tick_longer_than_the_interval_is_never_run_twice_at_once_nor_warned_about(
    engine: Engine, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    service = real_clock_service(engine, redis_client)
    sweeper = Sweeper(service, interval_s=0.05)
    running = 0
    overlaps = ticks = 0
    real_tick = sweeper.tick

    def slow_tick() -> float:
        nonlocal running, overlaps, ticks
        running += 1
        overlaps += running > 1
        time.sleep(0.3)
        running -= 1
        ticks += 1
        return real_tick()

    sweeper.tick = slow_tick  # type: ignore[method-assign]
    scheduler = build_scheduler(sweeper, blocking=False)
    caplog.set_level(logging.WARNING)
    scheduler.start()
    try:
        wait_until(lambda: ticks >= 3, "three slow ticks", check=noop)
    finally:
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()

    assert overlaps == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_slow_rebuild_is_never_warned_about_and_the_sweep_goes_on_meanwhile(
    engine: Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = real_clock_service(engine, redis_client)
    sweeper = Sweeper(service, interval_s=0.2)
    started: list[float] = []
    release = threading.Event()
    original = service.reconcile

    def slow_reconcile(**kwargs: Any) -> Any:
        started.append(time.monotonic())
        assert release.wait(30)
        return original(**kwargs)

    monkeypatch.setattr(service, "reconcile", slow_reconcile)
    scheduler = build_scheduler(sweeper, blocking=False)
    caplog.set_level(logging.WARNING)
    scheduler.start()
    try:
        wait_until(lambda: started, "the startup rebuild to start", check=noop)
        ids = {o.id for o in create_orders(service, [0.2, 0.4, 0.6], users=["u1", "u2"])}
        wait_until(
            lambda: closed_event_counts(engine).keys() >= ids, "the sweep to close", check=noop
        )
        wait_until(
            lambda: time.monotonic() - started[0] > 4 * RECONCILE_CHECK_S,
            "four check intervals into the rebuild",
            check=noop,
        )
        assert len(started) == 1
        release.set()
        wait_until(service.index.epoch.get, "the rebuild to end", check=noop)
    finally:
        release.set()
        scheduler.shutdown(wait=True)
        sweeper.close()

    assert len(started) == 1
    assert closed_event_counts(engine) == Counter(dict.fromkeys(ids, 1))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []


def test_handler_runs_are_debug_lines_counted_in_the_summary_and_a_slow_one_is_not_warned_about(
    engine: Engine, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    service = real_clock_service(engine, redis_client)
    handled: list[str] = []

    def remember(event: OrderEvent) -> None:
        if not handled:
            time.sleep(1.2)  # a slow handler: the job runs over two of its intervals
        handled.append(event.order_id)

    service.on_closed(remember)
    sweeper = Sweeper(service, interval_s=0.2)
    scheduler = build_scheduler(sweeper, blocking=False)
    caplog.set_level(logging.DEBUG, logger="orders.sweeper")
    scheduler.start()
    try:
        ids = {o.id for o in create_orders(service, [0.2, 0.3, 0.4], users=["u1", "u2"])}
        wait_until(lambda: set(handled) >= ids, "the handler to see the closes", check=noop)
    finally:
        scheduler.shutdown(wait=True)
        sweeper.close()

    info = sweeper_records(caplog, logging.INFO)
    summaries = [line for line in info if line["event"] == "summary"]
    assert len(summaries) == 1  # the run was shorter than the period: written at close
    assert {k: summaries[0][k] for k in ("closed", "handled", "failed", "retried_ok")} == {
        "closed": 3,
        "handled": 3,
        "failed": 0,
        "retried_ok": 0,
    }
    assert not {line["event"] for line in info} & {"sweep", "handlers"}
    debug = sweeper_records(caplog, logging.DEBUG)
    assert sum(line["handled"] for line in debug if line["event"] == "handlers") == 3
    assert sum(line["closed"] for line in debug if line["event"] == "sweep") == 3
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_handlers_outage_is_warned_about_once_and_its_end_once(
    engine: Engine,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = real_clock_service(engine, redis_client)
    service.on_closed(lambda event: None)
    sweeper = Sweeper(service, interval_s=0.2)
    runs: list[str] = []
    real_run_once = EventConsumer.run_once

    def unavailable(self: EventConsumer) -> ConsumeResult:
        runs.append("failed")
        raise StoreUnavailable("sql", "the database is restarting")

    def counted(self: EventConsumer) -> ConsumeResult:
        runs.append("ran")
        return real_run_once(self)

    monkeypatch.setattr(EventConsumer, "run_once", unavailable)
    scheduler = build_scheduler(sweeper, blocking=False)
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    scheduler.start()
    try:
        wait_until(lambda: runs.count("failed") >= 4, "four failed handler runs", check=noop)
        monkeypatch.setattr(EventConsumer, "run_once", counted)
        wait_until(lambda: runs.count("ran") >= 3, "three handler runs after", check=noop)
    finally:
        scheduler.shutdown(wait=True)
        sweeper.close()

    events = [r["event"] for r in sweeper_records(caplog, logging.INFO)]
    assert [e for e in events if e.startswith("handlers")] == ["handlers_failed", "handlers_back"]


# --- real scheduler processes ------------------------------------------------------------------

# A summary after every tick that closed something (a 1 ms period), so a process killed with
# SIGKILL has logged all it closed but what its last tick did.
SCHEDULER_CODE = (
    "import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s'); "
    "from orders.scheduler.process import run_scheduler; "
    "from orders.bootstrap import build_service; "
    "from orders.config import Settings; "
    "run_scheduler(build_service(Settings.from_env()), summary_period_s=0.001)"
)


class Schedulers:
    """Starts scheduler processes on the test's stores and kills whatever is left at the end."""

    def __init__(self, tmp_path: Path, database_url: str, redis_url: str) -> None:
        self.tmp_path = tmp_path
        self.env = child_env(
            ORDERS_HOME=str(tmp_path / "home"),
            ORDERS_DATABASE_URL=database_url,
            ORDERS_REDIS_URL=redis_url,
            ORDERS_SWEEP_INTERVAL_S="0.2",
            ORDERS_LEASE_TTL_S="1",
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        with open(self.tmp_path / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-c", SCHEDULER_CODE],
                env={**self.env, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.tmp_path / f"{name}.log").read_text(errors="replace")

    def summary_lines(self, name: str) -> list[dict[str, Any]]:
        prefix = f"{LOGGER_NAME} "  # the logger kept its name through the move
        lines = [line[len(prefix) :] for line in self.log(name).splitlines()]
        return [
            json.loads(line)
            for line in lines
            if line.startswith('{"event": "summary"')  # only our JSON lines
        ]

    def check_running(self, *names: str) -> None:
        for name in names:
            code = self.procs[name].poll()
            if code is not None:
                raise AssertionError(f"scheduler {name} exited with {code}:\n{self.log(name)}")

    def kill_all(self) -> None:
        for proc in self.procs.values():
            stop_process(proc, signum=signal.SIGKILL)


@pytest.fixture
def schedulers(tmp_path: Path, database_url: str, redis_url: str) -> Iterator[Schedulers]:
    started = Schedulers(tmp_path, database_url, redis_url)
    try:
        yield started
    finally:
        started.kill_all()


def test_two_scheduler_processes_close_each_order_once_and_fail_over_on_kill(
    schedulers: Schedulers,
    engine: Engine,
    redis_client: redis.Redis,
    record_property: Callable[[str, object], None],
) -> None:
    service = real_clock_service(engine, redis_client)
    lease = lease_of(service)
    a = schedulers.start("a")
    b = schedulers.start("b")
    alive = ["a", "b"]

    def check_alive() -> None:
        schedulers.check_running(*alive)

    wait_until(lease.owner, "a lease holder", check=check_alive)
    first = create_orders(
        service, [0.5 + 0.1 * i for i in range(10)], users=["u1", "u2", "u3", "u4"]
    )
    first_ids = {o.id for o in first}

    def first_closed() -> bool:
        return closed_event_counts(engine).keys() >= first_ids

    wait_until(first_closed, "the first orders to close", check=check_alive)

    rows = sql_rows(engine)
    assert {rows[oid].status for oid in first_ids} == {"closed"}
    assert closed_event_counts(engine) == Counter(dict.fromkeys(first_ids, 1))
    lags_ms = [rows[oid].closed_at_ms - rows[oid].expires_at_ms for oid in first_ids]
    record_property("max_close_lag_ms", max(lags_ms))
    print(f"close lag with a healthy scheduler: max {max(lags_ms)} ms, all {sorted(lags_ms)}")
    assert min(lags_ms) >= 0
    assert max(lags_ms) < 1500

    active_pid = pid_of(lease.owner())
    assert active_pid in {a.pid, b.pid}
    active, survivor, survivor_name = (a, b, "b") if active_pid == a.pid else (b, a, "a")
    os.kill(active.pid, signal.SIGKILL)
    assert active.wait(10) == -signal.SIGKILL
    alive = [survivor_name]

    second = create_orders(service, [0.5] * 5, users=["u5", "u6"])
    second_ids = {o.id for o in second}

    def taken_over() -> bool:
        done = closed_event_counts(engine).keys() >= second_ids
        return done and pid_of(lease.owner()) == survivor.pid

    wait_until(taken_over, "the survivor to take over and close the new orders", check=check_alive)

    assert closed_event_counts(engine) == Counter(dict.fromkeys(first_ids | second_ids, 1))
    os.kill(survivor.pid, signal.SIGTERM)
    assert survivor.wait(10) == 0, schedulers.log(survivor_name)
    assert lease.owner() is None
    # The summary lines account for each order once: the survivor, stopped by SIGTERM,
    # says everything it closed (its last summary is forced at shutdown): the second
    # orders, none of the first. The killed one's closes since its last summary died with
    # it (a summary comes at most every 10 s), so its lines may say fewer, never more.
    killed_name = "a" if survivor_name == "b" else "b"
    said = {name: schedulers.summary_lines(name) for name in ("a", "b")}
    assert sum(line["closed"] for line in said[survivor_name]) == len(second_ids)
    assert sum(line["closed"] for line in said[killed_name]) <= len(first_ids)
    assert {pid_of(line["owner"]) for lines in said.values() for line in lines} <= {a.pid, b.pid}


def insert_due_orders(engine: Engine, count: int, now_ms: int) -> None:
    """``count`` unpaid orders already past their expiry, straight into SQL (the sweep needs
    no Redis member; creating them one by one would take most of the test's time)."""
    rows = [
        {
            "id": f"bulk-{i:05d}",
            "user_id": f"user-{i % 100}",
            "status": "unpaid",
            "created_at_ms": now_ms - 60_000,
            "expires_at_ms": now_ms - 30_000 + i,
            "updated_at_ms": now_ms - 60_000,
        }
        for i in range(count)
    ]
    with engine.begin() as conn:
        conn.execute(insert(orders_table), rows)


def test_sigterm_in_the_middle_of_a_large_sweep_stops_after_a_whole_batch_and_exits_0(
    schedulers: Schedulers, engine: Engine, redis_client: redis.Redis
) -> None:
    # Small batches make the sweep long (hundreds of commits), so the signal lands inside.
    total, batch = 5000, 10
    service = real_clock_service(engine, redis_client)
    insert_due_orders(engine, total, service.clock())
    proc = schedulers.start("big", ORDERS_SWEEP_BATCH_SIZE=str(batch))

    wait_until(
        lambda: count_closed_events(engine),
        "the sweep to start",
        timeout_s=30,
        check=lambda: schedulers.check_running("big"),
    )
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(15) == 0, schedulers.log("big")

    rows = sql_rows(engine)
    events = closed_event_counts(engine)
    closed = {oid for oid, row in rows.items() if row.status == "closed"}
    unpaid = {oid for oid, row in rows.items() if row.status == "unpaid"}
    assert closed | unpaid == set(rows)
    assert events == Counter(dict.fromkeys(closed, 1))  # none half-done, none twice
    assert len(closed) % batch == 0, "stopped inside a batch"
    assert 0 < len(closed) < total, "the signal did not land in the middle of the sweep"
    assert redis_client.exists(lease_of(service).key) == 0

    assert service.sweep_expired().closed == len(unpaid)
    assert closed_event_counts(engine) == Counter(dict.fromkeys(rows, 1))
