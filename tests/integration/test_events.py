"""order_events consumers, closed-order handlers, extend_order and the pre-close check."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, insert, select

from orders import InvalidInput, OrderClosed, UnpaidOrderLimitReached
from orders.domain import EventKind, Order
from orders.errors import OrderAlreadyPaid, OrderExpired
from orders.events.consumer import EventConsumer, EventPosition, OrderEvent, read_events
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import events_table
from tests.support.clocks import ManualClock, RunningClock
from tests.support.processes import REPO, child_env, stop_process
from tests.support.stores import sql_rows


def kinds_of(engine: Engine, order_id: str) -> list[str]:
    with engine.connect() as conn:
        query = select(events_table.c.kind).where(events_table.c.order_id == order_id)
        return list(conn.scalars(query.order_by(events_table.c.id)))


# --- reading events ------------------------------------------------------------------------


def test_events_come_in_commit_order_and_positions_advance(
    service: OrderService, engine: Engine
) -> None:
    a = service.create_unpaid_order("u1")
    b = service.create_unpaid_order("u2")
    service.mark_paid(a.id)
    service.cancel_order(b.id)

    first = read_events(engine, limit=3)
    rest = read_events(engine, first[-1].position)

    assert [(e.order_id, e.kind) for e in [*first, *rest]] == [
        (a.id, EventKind.CREATED),
        (b.id, EventKind.CREATED),
        (a.id, EventKind.PAID),
        (b.id, EventKind.CANCELLED),
    ]
    assert read_events(engine, rest[-1].position) == []


def test_postgresql_readers_never_pass_an_event_of_a_transaction_still_running(
    service: OrderService, engine: Engine
) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has one writer at a time: ids are already in commit order")
    early = service.create_unpaid_order("u1")
    late = service.create_unpaid_order("u2")
    with engine.connect() as slow:
        # A transaction takes the next event id, and is still running...
        slow.execute(
            insert(events_table).values(order_id=early.id, user_id="u1", kind="paid", at_ms=1)
        )
        # ...while a later one commits.
        service.cancel_order(late.id)
        seen = read_events(engine)
        assert [e.kind for e in seen] == [EventKind.CREATED, EventKind.CREATED]
        slow.commit()
    after = read_events(engine, seen[-1].position)
    assert sorted(e.kind for e in after) == [EventKind.CANCELLED, EventKind.PAID]


# --- consumers -----------------------------------------------------------------------------


def test_a_failing_handler_is_retried_with_backoff_without_holding_up_later_events(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = [service.create_unpaid_order(f"u{i}") for i in range(4)]
    failures = {orders[1].id: 2}  # fails twice, then works
    handled: list[str] = []

    def handler(event: OrderEvent) -> None:
        if failures.get(event.order_id, 0) > 0:
            failures[event.order_id] -= 1
            raise RuntimeError("payment provider down")
        handled.append(event.order_id)

    # rand 1.0: the top of the jitter range, so the delays are the plain doubling.
    consumer = EventConsumer(
        engine, "test", handler, clock=clock, backoff_s=1, rand=lambda: 1.0, start="oldest"
    )
    first = consumer.run_once()
    assert (first.handled, first.failed) == (3, 1)
    assert handled == [orders[0].id, orders[2].id, orders[3].id]
    assert consumer.pending_retries() == 1

    assert consumer.run_once().failed == 0  # not due yet: nothing happens
    clock.advance(s=1)
    assert consumer.run_once().failed == 1  # due, fails again; backoff doubles
    clock.advance(s=1)
    assert consumer.run_once().retried_ok == 0
    clock.advance(s=1)
    assert consumer.run_once().retried_ok == 1
    assert handled[-1] == orders[1].id
    assert consumer.pending_retries() == 0


def test_kinds_filter_passes_other_events_by(service: OrderService, engine: Engine) -> None:
    order = service.create_unpaid_order("u1")
    service.cancel_order(order.id)
    seen: list[EventKind] = []
    consumer = EventConsumer(
        engine, "cancels", lambda e: seen.append(e.kind), kinds=["cancelled"], start="oldest"
    )
    consumer.run_once()
    assert seen == [EventKind.CANCELLED]
    assert consumer.position().event_id > 0


CONSUMER_PROCESS = """
import os, sys, time
from orders.bootstrap import build_engine
from orders.config import Settings
from orders.events.consumer import EventConsumer

out = open(sys.argv[2], "a")
def handler(event):
    out.write(f"{event.id}\\n"); out.flush(); os.fsync(out.fileno())
    time.sleep(0.01)
engine = build_engine(Settings(database_url=sys.argv[1]))
consumer = EventConsumer(engine, "killed", handler, start="oldest")
while consumer.run_once(limit=5).handled:
    pass
"""


def test_a_consumer_killed_mid_stream_resumes_without_losing_or_skipping_an_event(
    service: OrderService, engine: Engine, database_url: str, tmp_path: Path
) -> None:
    for i in range(60):
        service.create_unpaid_order(f"u{i}")
    handled_file = tmp_path / "handled.txt"
    handled_file.touch()

    def start() -> subprocess.Popen[bytes]:
        args = [sys.executable, "-c", CONSUMER_PROCESS, database_url, str(handled_file)]
        return subprocess.Popen(args, cwd=REPO, env=child_env())

    proc = start()
    try:
        deadline = time.monotonic() + 30
        while len(handled_file.read_text().split()) < 20:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        stop_process(proc, signum=signal.SIGKILL)
        proc = start()
        assert proc.wait(60) == 0
    finally:
        stop_process(proc, signum=signal.SIGKILL)

    handled = Counter(int(line) for line in handled_file.read_text().split())
    every = {e.id for e in read_events(engine, EventPosition(), 1000)}
    assert set(handled) == every  # nothing lost, nothing skipped
    assert sum(handled.values()) - len(handled) <= 1  # at most the event in hand, twice


#: How long after its expiry an order may close while a handler hangs or fails: the sweep
#: runs every SWEEP_INTERVAL_S; the rest is room for a loaded machine. A sweep waiting for
#: the hanging handler would exceed it by far (the handler is released only at the end).
SWEEP_INTERVAL_S = 0.05
CLOSE_LAG_BOUND_MS = 300


class Handlers:
    """Two closed-order handlers: one that always raises, one that hangs until released.

    Methods, so that each consumer gets its own short durable name (a name is the
    handler's qualified name cut to 64 characters; two nested test functions would share
    one).
    """

    def __init__(self) -> None:
        self.failed: Counter[str] = Counter()
        self.hanging_on: list[str] = []
        self.hanging = threading.Event()
        self.release = threading.Event()

    def fail(self, event: OrderEvent) -> None:
        self.failed[event.order_id] += 1
        raise RuntimeError("stock service down")

    def hang(self, event: OrderEvent) -> None:
        self.hanging_on.append(event.order_id)
        self.hanging.set()
        self.release.wait(60)


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_hanging_or_failing_closed_order_handler_never_delays_the_sweep(
    make_service: Any, engine: Engine, redis_client: redis.Redis
) -> None:
    clock = RunningClock()
    service = OrderService(engine, redis_client, make_service().settings, clock=clock)
    handlers = Handlers()
    service.on_closed(handlers.fail)  # the events job runs it first, then...
    service.on_closed(handlers.hang)  # ...this one, which holds the job until released

    first = [service.create_unpaid_order(f"u{i}", ttl_s=60) for i in range(3)]
    second: list[Order] = []
    sweeper = Sweeper(service, interval_s=SWEEP_INTERVAL_S)
    scheduler = build_scheduler(sweeper, blocking=False)
    scheduler.start()
    try:
        clock.advance_to(max(o.expires_at_ms for o in first))
        assert handlers.hanging.wait(20), "the handlers never ran"
        assert set(handlers.failed) == {o.id for o in first}

        # With one handler hanging and the other failing, the sweep keeps its pace.
        second = [service.create_unpaid_order(f"u{i}", ttl_s=60) for i in range(3)]
        clock.advance_to(max(o.expires_at_ms for o in second))
        wait_until(lambda: all(sql_rows(engine)[o.id].status == "closed" for o in second), 5)
        hanging_on_meanwhile = list(handlers.hanging_on)

        # Released, the hanging handler gets every closed order; the failing one is retried
        # once its backoff (1 s) has passed.
        handlers.release.set()
        clock.advance_to(clock() + 1_000)
        assert wait_until(
            lambda: (
                set(handlers.hanging_on) == {o.id for o in [*first, *second]}
                and all(handlers.failed[o.id] >= 2 for o in first)
            ),
            20,
        ), (handlers.hanging_on, handlers.failed)
    finally:
        handlers.release.set()
        scheduler.shutdown(wait=True)
        sweeper.close()

    # Every order closed within the bound of its expiry...
    rows = sql_rows(engine)
    orders = [*first, *second]
    assert {o.id: rows[o.id].status for o in orders} == {o.id: "closed" for o in orders}
    lags_ms = {o.id: rows[o.id].closed_at_ms - o.expires_at_ms for o in orders}
    assert all(0 <= lag <= CLOSE_LAG_BOUND_MS for lag in lags_ms.values()), lags_ms
    # ...while the hanging handler was still on the first event: the hang was real.
    assert hanging_on_meanwhile == [first[0].id]


# --- extend_order ---------------------------------------------------------------------------


def test_extend_moves_the_expiry_in_sql_and_redis(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=60)
    clock.advance(s=30)

    extended = service.extend_order(order.id, 90)

    assert extended.expires_at_ms == order.expires_at_ms + 90_000
    assert extended.extensions == 1
    assert service.index.members("u1") == {order.id: extended.expires_at_ms}
    assert kinds_of(engine, order.id) == ["created", "extended"]
    clock.advance(s=60)  # past the old expiry: the sweep leaves it alone
    assert service.sweep_expired().closed == 0


def test_a_payment_between_the_extensions_commit_and_its_redis_write_frees_the_slot(
    service: OrderService, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The extension's Redis write comes after its commit; a payment that commits and
    removes the member in between must not see the member come back at the new score."""
    order = service.create_unpaid_order("u1", ttl_s=60)
    move = service.admitter.followups.move_after_commit

    def paid_first(extended: Order) -> None:
        service.mark_paid(order.id)
        move(extended)

    monkeypatch.setattr(service.admitter.followups, "move_after_commit", paid_first)
    service.extend_order(order.id, 90)

    assert sql_rows(engine)[order.id].status == "paid"
    assert service.index.members("u1") == {}


def test_extend_refuses_closed_paid_expired_and_too_long(
    service: OrderService, clock: ManualClock, make_service: Any
) -> None:
    closed = service.create_unpaid_order("u1", ttl_s=5)
    paid = service.create_unpaid_order("u2", ttl_s=60)
    service.mark_paid(paid.id)
    expired = service.create_unpaid_order("u3", ttl_s=5)
    clock.advance(s=5)
    service.sweep_expired(now_ms=closed.expires_at_ms - 1)  # closes nothing yet
    with pytest.raises(OrderExpired):
        service.extend_order(expired.id, 10)
    service.sweep_expired()
    with pytest.raises(OrderClosed):
        service.extend_order(closed.id, 10)
    with pytest.raises(OrderAlreadyPaid):
        service.extend_order(paid.id, 10)
    short_lived = make_service(max_lifetime_s=100)
    fresh = short_lived.create_unpaid_order("u4", ttl_s=60)
    with pytest.raises(InvalidInput, match="maximum lifetime"):
        short_lived.extend_order(fresh.id, 41)
    assert short_lived.extend_order(fresh.id, 40).expires_at_ms == fresh.created_at_ms + 100_000


def test_extend_at_exactly_expires_at_is_refused_and_one_ms_before_is_not(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    # The extension's compare-and-set is the one transition guarded by open_at: an order
    # stops being open at its expiry instant, not one ms after it (strict pay has its own
    # bound and the sweep uses due_at, so neither would notice open_at moving by one ms).
    on_time = service.create_unpaid_order("u1", ttl_s=60)
    at_expiry = service.create_unpaid_order("u2", ttl_s=60)

    clock.set(on_time.expires_at_ms - 1)
    extended = service.extend_order(on_time.id, 30)
    clock.set(at_expiry.expires_at_ms)
    with pytest.raises(OrderExpired):
        service.extend_order(at_expiry.id, 30)

    rows = sql_rows(engine)
    assert (rows[on_time.id].expires_at_ms, rows[on_time.id].extensions) == (
        on_time.expires_at_ms + 30_000,
        1,
    )
    assert extended.expires_at_ms == on_time.expires_at_ms + 30_000
    assert (rows[at_expiry.id].expires_at_ms, rows[at_expiry.id].extensions) == (
        at_expiry.expires_at_ms,
        0,
    )
    assert kinds_of(engine, on_time.id) == ["created", "extended"]
    assert kinds_of(engine, at_expiry.id) == ["created"]
    assert service.index.members("u1") == {on_time.id: on_time.expires_at_ms + 30_000}
    assert service.index.members("u2") == {at_expiry.id: at_expiry.expires_at_ms}


def test_extend_racing_the_sweep_exactly_one_wins(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = [service.create_unpaid_order(f"u{i}", ttl_s=10) for i in range(40)]
    clock.advance(s=10, ms=-1)  # 1 ms before every expiry
    outcomes: dict[str, str] = {}
    barrier = threading.Barrier(2)

    def extend_all() -> None:
        barrier.wait()
        for order in orders:
            try:
                service.extend_order(order.id, 30)
                outcomes[order.id] = "extended"
            except OrderClosed:
                outcomes[order.id] = "closed"

    def sweep() -> None:
        barrier.wait()
        clock.advance(ms=1)  # now every order is due
        service.sweep_expired(batch_size=3)

    threads = [threading.Thread(target=extend_all), threading.Thread(target=sweep)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for order in orders:
        kinds = kinds_of(engine, order.id)
        status = service.get_order(order.id).status
        if outcomes[order.id] == "extended":
            assert kinds == ["created", "extended"]
            assert status == "unpaid"
        else:
            assert "extended" not in kinds
            assert status == "closed"


# --- the pre-close check --------------------------------------------------------------------


def test_a_pre_close_check_extends_an_order_once_then_the_close_goes_ahead(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=5)
    asked: list[str] = []

    def payment_in_progress(o: Order) -> float:
        asked.append(o.id)
        return 30

    service.set_pre_close_check(payment_in_progress)
    clock.advance(s=5)
    assert service.sweep_expired().closed == 0
    reopened = service.get_order(order.id)
    assert reopened.expires_at_ms == clock() + 30_000
    assert service.index.members("u1") == {order.id: reopened.expires_at_ms}

    clock.advance(s=30)
    assert service.sweep_expired().closed == 1
    assert asked == [order.id]  # asked once: the second expiry closes without asking
    assert kinds_of(engine, order.id) == ["created", "extended", "closed"]


def test_a_failing_or_stuck_pre_close_check_lets_the_close_go_ahead_in_bounded_time(
    make_service: Any, clock: ManualClock
) -> None:
    service = make_service(pre_close_timeout_s=0.3)
    orders = [service.create_unpaid_order(f"u{i}", ttl_s=5) for i in range(6)]
    release = threading.Event()

    def check(o: Order) -> float | None:
        if o.user_id == "u0":
            raise RuntimeError("provider error")
        release.wait(30)  # stuck
        return 60

    service.set_pre_close_check(check)
    clock.advance(s=5)
    started = time.monotonic()
    result = service.sweep_expired()
    waited = time.monotonic() - started
    release.set()
    assert result.closed == 6
    assert all(service.get_order(o.id).status == "closed" for o in orders)
    assert waited < 10, waited  # one budget of 0.3 s per batch, not one per order


def test_a_pre_close_extension_is_refused_when_the_user_has_reached_the_limit(
    make_service: Any, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=1)
    old = service.create_unpaid_order("u1", ttl_s=5)
    clock.advance(s=5)
    # Under a per-call limit of 2 the new order takes the free slot 2 and leaves the
    # expired one be (with the setting's limit 1 the create would close it to take slot 1).
    new = service.create_unpaid_order("u1", ttl_s=60, limit=2)
    service.set_pre_close_check(lambda o: 30)

    assert service.sweep_expired().closed == 1

    assert service.get_order(old.id).status == "closed"
    assert set(service.index.members("u1")) == {new.id}
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1")
