"""Retention (``service.operations.prune``, ``orders prune``, the scheduler's job): terminal orders
past the age go with their events, in batches; none that a refund, a parked event or an
unread consumer still needs, and never an unpaid one. Read from SQL; time moves only
through ``clock``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders.errors import InvalidInput, OrderClosed
from orders.events.consumer import EventConsumer, OrderEvent
from orders.scheduler.retention_job import idle_s, prune_step
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.plans import captured, explain_sql
from tests.support.stores import sql_rows

DAY_MS = 86_400_000


def event_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(events_table)) or 0)


def order_ids(engine: Engine) -> set[str]:
    with engine.connect() as conn:
        return set(conn.scalars(select(orders_table.c.id)))


@pytest.fixture
def shop(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(unpaid_limit=1000)


def old_terminal_orders(shop: OrderService, clock: ManualClock) -> dict[str, str]:
    """One paid, one cancelled, one closed by expiry and one unpaid (never expiring soon)
    order, all 100 days old: name -> id."""
    paid = shop.create_unpaid_order("u1", ttl_s=600)
    shop.mark_paid(paid.id, payment_ref="p1")
    cancelled = shop.create_unpaid_order("u2", ttl_s=600)
    shop.cancel_order(cancelled.id)
    closed = shop.create_unpaid_order("u3", ttl_s=1)
    unpaid = shop.create_unpaid_order("u4", ttl_s=7 * 24 * 3600)
    clock.advance(ms=2000)
    assert shop.sweep_expired().closed == 1
    clock.advance(ms=100 * DAY_MS)
    return {"paid": paid.id, "cancelled": cancelled.id, "closed": closed.id, "unpaid": unpaid.id}


def test_old_terminal_orders_go_with_their_events_and_nothing_else(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    ids = old_terminal_orders(shop, clock)
    recent = shop.create_unpaid_order("u5", ttl_s=600)
    shop.mark_paid(recent.id)
    events_before = event_count(engine)

    dry = shop.operations.prune(90 * 86_400, dry_run=True)
    assert (dry.orders, dry.events, dry.dry_run) == (3, 6, True)
    assert (len(order_ids(engine)), event_count(engine)) == (5, events_before)

    archived: list[dict[str, Any]] = []
    shop.operations.set_archive_hook(archived.extend)
    done = shop.operations.prune(90 * 86_400, batch_size=1)
    assert (done.orders, done.events, done.batches) == (3, 6, 3)
    assert order_ids(engine) == {ids["unpaid"], recent.id}
    assert event_count(engine) == events_before - 6
    assert {row["id"] for row in archived} == {ids["paid"], ids["cancelled"], ids["closed"]}
    kinds = {row["id"]: [e["kind"] for e in row["events"]] for row in archived}
    assert kinds[ids["paid"]] == ["created", "paid"]
    assert kinds[ids["closed"]] == ["created", "closed"]
    assert shop.operations.prune(90 * 86_400).orders == 0  # nothing left to do


def test_an_order_still_needed_is_kept_until_it_is_not(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    ids = old_terminal_orders(shop, clock)
    # A refund owed: a payment refused for the closed order.
    with pytest.raises(OrderClosed):
        shop.mark_paid(ids["closed"], payment_ref="too-late")
    # A consumer that parks the paid order's events, and one that has read nothing since.
    failing = EventConsumer(
        engine, "failing", _fail_on(ids["paid"]), clock=clock, max_attempts=1, start="oldest"
    )
    failing.run_once(limit=1000)
    behind = EventConsumer(engine, "behind", lambda e: None, clock=clock, start="oldest")
    behind.run_once(limit=1)  # registered, one event read
    clock.advance(ms=DAY_MS)

    assert shop.operations.prune(90 * 86_400, batch_size=1).orders == 0
    behind.run_once(limit=1000)
    # The consumer caught up: now only the refund and the parked events hold their orders.
    assert shop.operations.prune(90 * 86_400).orders == 1  # the cancelled one
    shop.mark_refund_handled(ids["closed"], "too-late")
    assert shop.operations.prune(90 * 86_400).orders == 1  # the closed one
    assert shop.refused_payments() == []  # its refusal, handled, went with it
    assert ids["paid"] in order_ids(engine)  # parked events: an operator may requeue them
    assert ids["unpaid"] in order_ids(engine)


def cancelled_orders(shop: OrderService, count: int) -> None:
    """``count`` orders created and cancelled: two events each."""
    for n in range(count):
        shop.cancel_order(shop.create_unpaid_order(f"u{n % 50}", ttl_s=600).id)


def test_a_consumer_registered_after_1000_events_does_not_hold_the_prune_of_old_ones(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    """Issue 46: a new consumer read from the first event and saved its place there, so
    every order after it was kept until it had read all 1000. It starts from now."""
    cancelled_orders(shop, 500)
    clock.advance(ms=100 * DAY_MS)
    seen: list[OrderEvent] = []
    late = EventConsumer(engine, "late", seen.append, clock=clock)
    late.run_once(limit=10)  # registered

    done = shop.operations.prune(90 * 86_400)
    assert (done.orders, done.events, done.held_by, done.passed_by) == (500, 1000, (), ())
    assert seen == []
    shop.cancel_order(shop.create_unpaid_order("u1").id)
    late.run_once()
    assert [e.kind.value for e in seen] == ["created", "cancelled"]


def test_a_consumer_registered_from_the_oldest_reads_every_kept_event_holding_them_meanwhile(
    shop: OrderService, engine: Engine, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    cancelled_orders(shop, 500)
    clock.advance(ms=100 * DAY_MS)
    seen: list[int] = []
    reader = EventConsumer(
        engine, "archive", lambda e: seen.append(e.id), clock=clock, start="oldest"
    )
    reader.run_once(limit=10)  # the first five orders' events

    done = shop.operations.prune(90 * 86_400)
    assert (done.orders, done.held_by, done.passed_by) == (5, ("archive",), ())
    assert "consumer archive is behind" in caplog.text
    while reader.run_once(limit=500).handled:
        pass
    assert len(seen) == len(set(seen)) == 1000
    assert shop.operations.prune(90 * 86_400).orders == 495


def test_a_consumer_standing_still_for_the_retention_period_holds_nothing_past_it(
    shop: OrderService, engine: Engine, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention waits on a consumer that is behind while it reads; one whose cursor has not
    moved for the retention period is passed: its unread events that old go, and it is
    told in the log and the report."""
    cancelled_orders(shop, 20)
    stopped = EventConsumer(engine, "stopped", lambda e: None, clock=clock, start="oldest")
    stopped.run_once(limit=10)
    clock.advance(ms=100 * DAY_MS)

    done = shop.operations.prune(90 * 86_400)
    assert (done.orders, done.held_by, done.passed_by) == (20, (), ("stopped",))
    assert "consumer stopped has not moved" in caplog.text
    assert stopped.run_once().handled == 0  # its unread events went with their orders


def _fail_on(order_id: str) -> Callable[[OrderEvent], None]:
    def handle(event: OrderEvent) -> None:
        if event.order_id == order_id:
            raise RuntimeError("handler down")

    return handle


def test_an_archive_hook_that_raises_stops_the_prune_and_keeps_its_batch(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    ids = old_terminal_orders(shop, clock)
    seen: list[str] = []

    def archive(rows: list[dict[str, Any]]) -> None:
        seen.extend(row["id"] for row in rows)
        if len(seen) == 2:
            raise RuntimeError("archive store down")

    shop.operations.set_archive_hook(archive)
    with pytest.raises(RuntimeError, match="archive store down"):
        shop.operations.prune(90 * 86_400, batch_size=1)
    assert seen[0] not in order_ids(engine)
    assert seen[1] in order_ids(engine)  # handed over, then kept
    shop.operations.set_archive_hook(None)
    assert shop.operations.prune(90 * 86_400).orders == 2
    assert order_ids(engine) == {ids["unpaid"]}


def test_a_prune_beside_creates_payments_and_the_sweep_never_takes_an_open_order(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    for n in range(40):
        order = shop.create_unpaid_order(f"old{n}", ttl_s=600)
        shop.mark_paid(order.id)
    clock.advance(ms=100 * DAY_MS)
    stop = threading.Event()
    made: list[str] = []

    def shopping() -> None:
        n = 0
        while not stop.is_set():
            order = shop.create_unpaid_order(f"new{n % 7}", ttl_s=60)
            made.append(order.id)
            if n % 2:
                shop.mark_paid(order.id)
            shop.sweep_expired()
            n += 1

    worker = threading.Thread(target=shopping)
    worker.start()
    try:
        done = shop.operations.prune(90 * 86_400, batch_size=3)
    finally:
        stop.set()
        worker.join(30)
    assert done.orders == 40
    rows = sql_rows(engine)
    assert set(made) <= set(rows)  # every order made meanwhile is still there
    assert not any(row.user_id.startswith("old") for row in rows.values())


@pytest.mark.rotate("database_url")
@pytest.mark.parametrize("age", [0, -1, True, "90d", float("nan")])
def test_a_bad_age_is_invalid_input_and_nothing_is_deleted(
    shop: OrderService, engine: Engine, clock: ManualClock, age: object
) -> None:
    old_terminal_orders(shop, clock)
    with pytest.raises(InvalidInput, match="older_than"):
        shop.operations.prune(age)  # type: ignore[arg-type]
    assert len(order_ids(engine)) == 4


def test_the_active_scheduler_prunes_with_retention_days_set(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    shop = make_service(retention_days=30)
    old_terminal_orders(shop, clock)
    standby = Sweeper(shop, reconcile_at_start=False)
    try:
        assert prune_step(standby) == 60.0  # no lease yet: a standby does not prune
        assert len(order_ids(engine)) == 4
        standby.tick()  # takes the lease
        assert prune_step(standby) == 3600.0
    finally:
        standby.close()
    assert len(order_ids(engine)) == 1


def test_with_nothing_left_the_next_run_comes_after_a_tenth_of_the_retention() -> None:
    assert idle_s(90) == 3600.0  # a long retention: hourly
    assert idle_s(5 / 1440) == pytest.approx(30.0)  # five minutes: every 30 s
    assert idle_s(1 / 86_400) == 10.0  # never busier than every 10 s


def test_each_batch_of_a_prune_starts_its_index_scan_at_the_last_batchs_end(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    """A later batch must not walk the index past every order of the batches before it (a
    prune of n orders would cost n^2): its query bounds the index scan from below."""
    for n in range(3):
        order = shop.create_unpaid_order(f"u{n}", ttl_s=600)
        shop.mark_paid(order.id)
    clock.advance(ms=100 * DAY_MS)
    with captured(engine) as seen:
        assert shop.operations.prune(90 * 86_400, batch_size=1, dry_run=True).batches == 3
    paid_pages = [s for s in seen if "paid_at_ms" in s[0] and "ORDER BY" in s[0]]
    assert len(paid_pages) == 4  # a page each, then the empty one that ends the walk
    plan = explain_sql(engine, *paid_pages[1])  # the second batch: after the first's end
    if engine.dialect.name == "sqlite":
        assert "USING INDEX ix_oes_orders_paid_paid_at_ms (paid_at_ms>? AND paid_at_ms<?)" in plan
    else:
        scan = next(line for line in plan.splitlines() if "ix_oes_orders_paid_paid_at_ms" in line)
        bounds = plan.splitlines()[plan.splitlines().index(scan) + 1]
        assert "Index Cond" in bounds, plan
        assert "paid_at_ms >=" in bounds, plan
