"""Reminders before expiry (``Settings.remind_before_s``): the sweep writes one ``expiring``
event per unpaid order at ``expires_at - remind_before_s``, by compare-and-set on the order.

Every outcome is read from SQL (the order's ``remind_at_ms``/``reminded_at_ms`` and its
events); time moves only through ``clock``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, select

from orders.domain import ActorKind, EventKind, Order
from orders.events.consumer import EventConsumer, OrderEvent
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import events_table
from tests.support.clocks import ManualClock
from tests.support.stores import sql_rows

pytestmark = [pytest.mark.cluster_too]

OFFSET_S = 60
OFFSET_MS = OFFSET_S * 1000
TTL_S = 600


def expiring_events(engine: Engine) -> list[dict[str, object]]:
    query = (
        select(events_table).where(events_table.c.kind == "expiring").order_by(events_table.c.id)
    )
    with engine.connect() as conn:
        return [dict(row._mapping) for row in conn.execute(query)]


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.fixture
def reminding(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(remind_before_s=OFFSET_S)


def test_the_reminder_comes_at_exactly_the_expiry_minus_the_offset_once_by_the_sweeper(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    remind_at = order.expires_at_ms - OFFSET_MS
    assert order.remind_at_ms == remind_at
    sent_before = counter("orders_reminders_total")

    clock.set(remind_at - 1)
    assert reminding.sweep_expired().reminded == 0
    assert expiring_events(engine) == []

    clock.set(remind_at)
    assert reminding.sweep_expired().reminded == 1
    clock.advance(ms=1)
    assert reminding.sweep_expired().reminded == 0  # never twice

    (event,) = expiring_events(engine)
    assert event["order_id"] == order.id
    assert event["user_id"] == "u1"
    assert event["at_ms"] == remind_at
    assert event["actor_kind"] == "sweeper"
    assert event["data"] == {"expires_at_ms": order.expires_at_ms}
    row = sql_rows(engine)[order.id]
    assert (row.status, row.remind_at_ms, row.reminded_at_ms) == ("unpaid", None, remind_at)
    assert counter("orders_reminders_total") == sent_before + 1


def test_an_order_created_inside_the_window_gets_no_reminder(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    inside = reminding.create_unpaid_order("u1", ttl_s=OFFSET_S - 1)
    at_edge = reminding.create_unpaid_order("u1", ttl_s=OFFSET_S)  # would remind at creation
    outside = reminding.create_unpaid_order("u1", ttl_s=OFFSET_S + 0.001)
    assert (inside.remind_at_ms, at_edge.remind_at_ms) == (None, None)
    assert outside.remind_at_ms == outside.created_at_ms + 1

    clock.advance(s=OFFSET_S - 1.001)
    reminding.sweep_expired()
    assert [e["order_id"] for e in expiring_events(engine)] == [outside.id]
    clock.advance(s=2)
    assert reminding.sweep_expired().closed == 3
    assert [e["order_id"] for e in expiring_events(engine)] == [outside.id]


def test_no_reminder_after_paid_cancelled_or_closed(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    paid, cancelled, overdue = (reminding.create_unpaid_order("u1", ttl_s=TTL_S) for _ in range(3))
    reminding.mark_paid(paid.id, payment_ref="psp-1")
    reminding.cancel_order(cancelled.id)
    # The sweep runs only after the expiry (a scheduler that was down): closed, not reminded.
    clock.set(overdue.expires_at_ms)

    result = reminding.sweep_expired()

    assert (result.closed, result.reminded) == (1, 0)
    assert expiring_events(engine) == []
    rows = sql_rows(engine)
    assert [rows[o.id].status for o in (paid, cancelled, overdue)] == [
        "paid",
        "cancelled",
        "closed",
    ]
    assert all(rows[o.id].reminded_at_ms is None for o in (paid, cancelled, overdue))


def test_an_overdue_order_the_sweep_did_not_get_to_close_is_not_reminded_either(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    first, second = (reminding.create_unpaid_order("u1", ttl_s=TTL_S) for _ in range(2))
    clock.set(first.expires_at_ms)

    result = reminding.sweep_expired(batch_size=1, max_batches=1)

    assert (result.closed, result.reminded) == (1, 0)
    rows = sql_rows(engine)
    assert sorted(rows[o.id].status for o in (first, second)) == ["closed", "unpaid"]
    assert expiring_events(engine) == []


def test_reminders_are_off_by_default(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    assert order.remind_at_ms is None
    clock.set(order.expires_at_ms - 1)
    assert service.sweep_expired().reminded == 0
    assert expiring_events(engine) == []


def test_an_extension_moves_an_unsent_reminder_and_never_brings_a_second_one(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    extended = reminding.extend_order(order.id, 120)
    assert (
        extended.remind_at_ms == order.remind_at_ms + 120_000 == extended.expires_at_ms - OFFSET_MS
    )

    clock.set(order.expires_at_ms - OFFSET_MS)  # the reminder's old time: nothing now
    assert reminding.sweep_expired().reminded == 0
    clock.set(extended.expires_at_ms - OFFSET_MS)
    assert reminding.sweep_expired().reminded == 1

    # Reminded, then extended again: exactly once per order.
    again = reminding.extend_order(order.id, 120)
    assert (again.remind_at_ms, again.reminded_at_ms) == (None, clock())
    clock.set(again.expires_at_ms - OFFSET_MS)
    assert reminding.sweep_expired().reminded == 0
    assert [e["at_ms"] for e in expiring_events(engine)] == [extended.expires_at_ms - OFFSET_MS]


def test_the_pre_close_checks_reopen_moves_an_unsent_reminder_with_the_expiry(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    reminding.set_pre_close_check(lambda _order: 300)
    clock.set(order.expires_at_ms + 1_000)  # the scheduler was down through the reminder

    result = reminding.sweep_expired()

    reopened = reminding.get_order(order.id)
    assert (result.closed, result.reminded) == (0, 0)
    assert reopened.expires_at_ms == clock() + 300_000
    assert reopened.remind_at_ms == reopened.expires_at_ms - OFFSET_MS
    clock.set(reopened.expires_at_ms - OFFSET_MS)
    assert reminding.sweep_expired().reminded == 1
    assert [e["order_id"] for e in expiring_events(engine)] == [order.id]


def test_three_sweepers_at_once_write_each_reminder_exactly_once(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    services = [make_service(remind_before_s=OFFSET_S) for _ in range(3)]
    orders = [
        services[0].create_unpaid_order(f"user-{n % 7}", ttl_s=TTL_S, limit=100) for n in range(60)
    ]
    clock.set(orders[-1].expires_at_ms - OFFSET_MS)
    start = threading.Barrier(len(services))
    reminded: list[int] = []

    def sweep(service: OrderService) -> None:
        start.wait()
        reminded.append(service.sweep_expired(batch_size=4).reminded)

    threads = [threading.Thread(target=sweep, args=(s,)) for s in services]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sum(reminded) == len(orders)
    per_order = Counter(e["order_id"] for e in expiring_events(engine))
    assert per_order == Counter({o.id: 1 for o in orders})
    rows = sql_rows(engine)
    assert all(rows[o.id].remind_at_ms is None for o in orders)
    assert {rows[o.id].reminded_at_ms for o in orders} == {clock()}


@pytest.mark.both_apis
def test_a_create_through_either_api_writes_its_remind_at(
    reminding: OrderService, engine: Engine
) -> None:
    order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    assert order.remind_at_ms == order.expires_at_ms - OFFSET_MS
    assert sql_rows(engine)[order.id].remind_at_ms == order.remind_at_ms


def test_a_create_in_the_hosts_transaction_writes_its_remind_at(
    reminding: OrderService, engine: Engine
) -> None:
    with engine.begin() as conn:
        order = reminding.create_unpaid_order("u1", ttl_s=TTL_S, connection=conn)
    assert sql_rows(engine)[order.id].remind_at_ms == order.expires_at_ms - OFFSET_MS


def test_a_payment_of_a_reminded_order_is_counted_as_paid_after_a_reminder(
    reminding: OrderService, clock: ManualClock
) -> None:
    reminded, plain = (reminding.create_unpaid_order("u1", ttl_s=TTL_S) for _ in range(2))
    reminding.extend_order(plain.id, 300)  # its reminder is later than the other's
    clock.set(reminded.expires_at_ms - OFFSET_MS)
    assert reminding.sweep_expired().reminded == 1
    before = counter("orders_paid_after_reminder_total")

    assert reminding.mark_paid(plain.id, payment_ref="psp-plain").reminded_at_ms is None
    assert counter("orders_paid_after_reminder_total") == before
    paid = reminding.mark_paid(reminded.id, payment_ref="psp-reminded")
    assert paid.reminded_at_ms == clock()
    assert counter("orders_paid_after_reminder_total") == before + 1
    reminding.mark_paid(reminded.id, payment_ref="psp-reminded")  # a repeat: not again
    assert counter("orders_paid_after_reminder_total") == before + 1


def test_the_scheduler_wakes_for_the_earliest_reminder(
    reminding: OrderService, clock: ManualClock
) -> None:
    order: Order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    sweeper = Sweeper(reminding)
    cadence = sweeper.cadence_s
    assert sweeper.tick() == cadence  # the reminder is 540 s away
    clock.set(order.expires_at_ms - OFFSET_MS - 250)
    assert sweeper.tick() == pytest.approx(0.25)
    clock.set(order.expires_at_ms - OFFSET_MS)
    assert sweeper.tick() == cadence  # wrote it; the expiry is 60 s away
    assert reminding.get_order(order.id).reminded_at_ms == clock()
    sweeper.close()


def test_an_event_consumer_of_expiring_events_gets_each_reminder_with_its_expiry(
    reminding: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = reminding.create_unpaid_order("u1", ttl_s=TTL_S)
    reminding.create_unpaid_order("u2", ttl_s=TTL_S + 1)  # reminded 1 s later: not yet
    seen: list[OrderEvent] = []
    consumer = EventConsumer(
        engine, "send-reminders", seen.append, kinds=[EventKind.EXPIRING], start="oldest"
    )
    clock.set(order.expires_at_ms - OFFSET_MS)
    reminding.sweep_expired()

    consumer.run_once()

    assert [(e.order_id, e.user_id, dict(e.data)) for e in seen] == [
        (order.id, "u1", {"expires_at_ms": order.expires_at_ms})
    ]
    assert seen[0].actor is not None
    assert seen[0].actor.kind is ActorKind.SWEEPER
