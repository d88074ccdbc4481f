"""The money around the hold: refused payments recorded, late payments, amounts, actors.

Each test checks SQL (the order, its events, the refunds owed in ``oes_payment_refusals``)
and, where a slot is at stake, the user's Redis set. Time moves only through ``clock``.
"""

from __future__ import annotations

import threading
from decimal import Decimal
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, select

from orders.domain import Actor, ActorKind, Order, OrderStatus, Payment, RefusalReason
from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    PaymentMismatch,
)
from orders.events.consumer import OrderEvent
from orders.scheduler.event_jobs import closed_order_consumers
from orders.service import OrderService
from orders.sql.models import events_table, orders_table, refusals_table
from tests.support.clocks import ManualClock

#: The tests marked ``both_apis`` run on orders.aio too; the rest check rules decided in
#: the synchronous core (input checks, the refund list), once.

TTL_S = 60
WINDOW_S = 3600


def events_of(engine: Engine, order_id: str) -> list[Any]:
    query = select(events_table).where(events_table.c.order_id == order_id)
    with engine.connect() as conn:
        return list(conn.execute(query.order_by(events_table.c.id)).all())


def kinds_of(engine: Engine, order_id: str) -> list[str]:
    return [e.kind for e in events_of(engine, order_id)]


def refusal_rows(engine: Engine) -> list[Any]:
    query = select(refusals_table).order_by(refusals_table.c.refused_at_ms)
    with engine.connect() as conn:
        return list(conn.execute(query).all())


def row_count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def closed_by_the_sweep(service: OrderService, clock: ManualClock, **create: Any) -> Order:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S, **create)
    clock.advance(s=TTL_S)
    assert service.sweep_expired().closed == 1
    return order


# --- refused payments are records ---------------------------------------------------------


@pytest.mark.both_apis
def test_a_payment_for_a_closed_order_is_refused_with_its_refund_recorded_once(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = closed_by_the_sweep(service, clock, amount="19.90", currency="EUR")
    clock.advance(s=1)

    with pytest.raises(OrderClosed) as first:
        service.mark_paid(order.id, payment_ref="psp-1", amount="19.90", currency="EUR")
    with pytest.raises(OrderClosed) as again:  # the payment provider retries its callback
        service.mark_paid(order.id, payment_ref="psp-1", amount="19.90", currency="EUR")

    assert first.value.status == "closed"
    assert first.value.refusal is not None
    assert again.value.refusal == first.value.refusal
    refused = [e for e in events_of(engine, order.id) if e.kind == "payment_refused"]
    assert len(refused) == 1
    assert refused[0].id == first.value.refusal[1]
    assert refused[0].data == {
        "payment_ref": "psp-1",
        "amount": "19.90",
        "currency": "EUR",
        "reason": "closed",
    }
    [row] = refusal_rows(engine)
    assert (row.order_id, row.payment_ref, row.reason) == (order.id, "psp-1", "closed")
    assert (row.amount, row.currency, row.handled_at_ms) == ("19.90", "EUR", None)
    assert row.event_id == refused[0].id
    assert service.get_order(order.id).status is OrderStatus.CLOSED


@pytest.mark.both_apis
def test_a_second_reference_for_a_paid_order_is_refused_and_a_retry_is_not(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    service.mark_paid(order.id, payment_ref="psp-1")

    assert service.mark_paid(order.id, payment_ref="psp-1").status is OrderStatus.PAID
    assert service.mark_paid(order.id).status is OrderStatus.PAID
    with pytest.raises(OrderAlreadyPaid) as other:
        service.mark_paid(order.id, payment_ref="psp-2")

    assert other.value.payment_ref == "psp-1"
    assert other.value.refusal is not None
    assert kinds_of(engine, order.id) == ["created", "paid", "payment_refused"]
    [row] = refusal_rows(engine)
    assert (row.payment_ref, row.reason) == ("psp-2", "already_paid")


def test_a_payment_without_a_reference_is_one_refusal_per_order(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    service.cancel_order(order.id)

    for _ in range(2):
        with pytest.raises(OrderClosed):
            service.mark_paid(order.id)

    [row] = refusal_rows(engine)
    assert row.payment_ref == ""  # stored as '', read back as None
    [owed] = service.refused_payments()
    assert owed.payment_ref is None
    assert owed.reason is RefusalReason.CANCELLED


def test_refunds_owed_are_listed_until_marked_handled_and_the_first_handler_is_kept(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    first = service.create_unpaid_order("u1")
    service.cancel_order(first.id)
    with pytest.raises(OrderClosed):
        service.mark_paid(first.id, payment_ref="psp-a")
    clock.advance(s=10)
    second = service.create_unpaid_order("u2")
    service.cancel_order(second.id)
    with pytest.raises(OrderClosed):
        service.mark_paid(second.id, payment_ref="psp-b")
    since = clock()

    handled = service.mark_refund_handled(first.id, "psp-a", actor="refund-worker")
    again = service.mark_refund_handled(first.id, "psp-a", actor="someone-else")

    assert handled.handled_by == Actor(ActorKind.APPLICATION, "refund-worker")
    assert again.handled_by == handled.handled_by
    assert again.handled_at_ms == handled.handled_at_ms
    assert [r.order_id for r in service.refused_payments()] == [first.id, second.id]
    assert [r.order_id for r in service.refused_payments(pending_only=True)] == [second.id]
    assert [r.order_id for r in service.refused_payments(since_ms=since)] == [second.id]
    with pytest.raises(InvalidInput):
        service.mark_refund_handled(first.id, "psp-never")


# --- amounts checked ----------------------------------------------------------------------


@pytest.mark.both_apis
@pytest.mark.parametrize(
    ("amount", "currency", "field", "reason"),
    [
        ("19.89", "EUR", "amount", "amount_mismatch"),  # underpaid
        ("20.00", "EUR", "amount", "amount_mismatch"),  # overpaid
        ("19.90", "USD", "currency", "currency_mismatch"),
    ],
)
def test_a_payment_of_another_amount_never_pays_and_is_recorded(
    service: OrderService,
    engine: Engine,
    redis_client: redis.Redis,
    amount: str,
    currency: str,
    field: str,
    reason: str,
) -> None:
    order = service.create_unpaid_order("u1", amount="19.90", currency="EUR")

    with pytest.raises(PaymentMismatch) as refused:
        service.mark_paid(order.id, payment_ref="psp-1", amount=amount, currency=currency)

    assert refused.value.field == field
    assert refused.value.refusal is not None
    assert service.get_order(order.id).status is OrderStatus.UNPAID
    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    [row] = refusal_rows(engine)
    assert (row.reason, row.amount, row.currency) == (reason, amount, currency)
    # The right payment, under another reference, still pays it.
    paid = service.mark_paid(order.id, payment_ref="psp-2", amount="19.9", currency="EUR")
    assert paid.status is OrderStatus.PAID
    assert kinds_of(engine, order.id) == ["created", "payment_refused", "paid"]


def test_amounts_are_compared_only_when_both_sides_state_one(
    service: OrderService, engine: Engine
) -> None:
    with_amount = service.create_unpaid_order("u1", amount="5.00", currency="EUR")
    without = service.create_unpaid_order("u2")

    assert service.mark_paid(with_amount.id, payment_ref="a").status is OrderStatus.PAID
    paid = service.mark_paid(without.id, payment_ref="b", amount="99", currency="USD")
    assert paid.status is OrderStatus.PAID
    assert events_of(engine, without.id)[-1].data == {
        "payment_ref": "b",
        "amount": "99",
        "currency": "USD",
    }
    assert row_count(engine, refusals_table) == 0


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"amount": "1.00", "currency": "XYZ"}, "currency"),
        ({"amount": "1.00", "currency": "eur"}, "currency"),
        ({"amount": "-1.00", "currency": "EUR"}, "amount"),
        ({"amount": "ten", "currency": "EUR"}, "amount"),
        ({"amount": 1.5, "currency": "EUR"}, "amount"),
        ({"currency": "EUR"}, "currency"),
        ({"actor": "x" * 129}, "actor"),
        ({"actor": "line\nbreak"}, "actor"),
        ({"actor": 7}, "actor"),
    ],
)
def test_bad_payment_input_is_refused_before_anything_is_written(
    service: OrderService, engine: Engine, arguments: dict[str, Any], field: str
) -> None:
    order = service.create_unpaid_order("u1", amount="1.00", currency="EUR")
    events_before = row_count(engine, events_table)

    with pytest.raises(InvalidInput) as refused:
        service.mark_paid(order.id, payment_ref="psp-1", **arguments)

    assert refused.value.field == field
    assert service.get_order(order.id).status is OrderStatus.UNPAID
    assert row_count(engine, events_table) == events_before
    assert row_count(engine, refusals_table) == 0


def test_an_unknown_currency_is_refused_at_create_too(
    service: OrderService, engine: Engine
) -> None:
    with pytest.raises(InvalidInput) as refused:
        service.create_unpaid_order("u1", amount="1.00", currency="ABC")
    assert refused.value.field == "currency"
    assert row_count(engine, orders_table) == 0


# --- late payments ------------------------------------------------------------------------


@pytest.mark.both_apis
def test_within_the_window_a_late_payment_turns_the_closed_order_paid_once(
    make_service: Any, engine: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    service = make_service(late_payment_window_s=WINDOW_S)
    order = closed_by_the_sweep(service, clock)
    clock.advance(s=WINDOW_S - 1)

    paid = service.mark_paid(order.id, payment_ref="bank-1")
    again = service.mark_paid(order.id, payment_ref="bank-1")

    assert paid.status is again.status is OrderStatus.PAID
    assert paid.payment_ref == "bank-1"
    assert kinds_of(engine, order.id) == ["created", "closed", "paid"]
    assert events_of(engine, order.id)[-1].data == {"payment_ref": "bank-1", "late": True}
    assert service.index.members("u1") == {}
    assert row_count(engine, refusals_table) == 0


def test_after_the_window_a_payment_is_refused_as_closed(
    make_service: Any, engine: Engine, clock: ManualClock
) -> None:
    service = make_service(late_payment_window_s=WINDOW_S)
    order = closed_by_the_sweep(service, clock)
    clock.advance(s=WINDOW_S + 1)

    with pytest.raises(OrderClosed):
        service.mark_paid(order.id, payment_ref="bank-1")

    [row] = refusal_rows(engine)
    assert row.reason == "closed"
    assert service.get_order(order.id).status is OrderStatus.CLOSED


@pytest.mark.parametrize(("after_window_ms", "paid"), [(0, True), (1, False)])
def test_the_windows_last_millisecond_is_in_it_in_python_and_in_sql_alike(
    make_service: Any, engine: Engine, clock: ManualClock, after_window_ms: int, paid: bool
) -> None:
    # The service's own check and the compare-and-set's bound read the same instant: a
    # payment at exactly expires_at + the window is late but in time, one ms later is not.
    service = make_service(late_payment_window_s=WINDOW_S)
    order = closed_by_the_sweep(service, clock)
    clock.set(order.expires_at_ms + WINDOW_S * 1000 + after_window_ms)

    if paid:
        assert service.mark_paid(order.id, payment_ref="bank-1").status is OrderStatus.PAID
        assert kinds_of(engine, order.id) == ["created", "closed", "paid"]
    else:
        with pytest.raises(OrderClosed):
            service.mark_paid(order.id, payment_ref="bank-1")
        assert [r.reason for r in refusal_rows(engine)] == ["closed"]
    assert (service.get_order(order.id).status is OrderStatus.PAID) is paid


def test_without_a_window_a_late_payment_is_refused_as_today(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = closed_by_the_sweep(service, clock)
    clock.advance(ms=1)
    with pytest.raises(OrderClosed):
        service.mark_paid(order.id, payment_ref="bank-1")
    assert [r.reason for r in refusal_rows(engine)] == ["closed"]


def never_answers(stop: threading.Event) -> Any:
    def check(order: Order, payment: Payment) -> bool:
        stop.wait(30)
        return True

    return check


def raises(order: Order, payment: Payment) -> bool:
    raise RuntimeError("the stock service is down")


@pytest.mark.both_apis
@pytest.mark.parametrize("answer", ["false", "raises", "not_a_bool", "hangs"])
def test_a_late_payment_the_check_does_not_accept_is_refused_and_recorded(
    make_service: Any, engine: Engine, clock: ManualClock, answer: str
) -> None:
    service = make_service(late_payment_window_s=WINDOW_S, pre_close_timeout_s=0.2)
    order = closed_by_the_sweep(service, clock)
    stop = threading.Event()
    checks = {
        "false": lambda order, payment: False,
        "raises": raises,
        "not_a_bool": lambda order, payment: "yes",
        "hangs": never_answers(stop),
    }
    asked: list[tuple[str, str | None]] = []

    def check(order: Order, payment: Payment) -> Any:
        asked.append((order.id, payment.ref))
        return checks[answer](order, payment)

    service.set_late_payment_check(check)
    try:
        with pytest.raises(OrderClosed) as refused:
            service.mark_paid(order.id, payment_ref="bank-1")
    finally:
        stop.set()

    assert asked == [(order.id, "bank-1")]
    assert refused.value.refusal is not None
    assert service.get_order(order.id).status is OrderStatus.CLOSED
    [row] = refusal_rows(engine)
    assert row.reason == "late_payment_refused"


def test_a_late_payment_the_check_accepts_is_paid_and_the_check_sees_the_payment(
    make_service: Any, clock: ManualClock
) -> None:
    service = make_service(late_payment_window_s=WINDOW_S)
    order = closed_by_the_sweep(service, clock, amount="10.00", currency="EUR")
    seen: list[Payment] = []
    service.set_late_payment_check(lambda order, payment: seen.append(payment) is None)

    paid = service.mark_paid(order.id, payment_ref="bank-1", amount="10", currency="EUR")

    assert paid.status is OrderStatus.PAID
    assert seen == [Payment("bank-1", Decimal("10"), "EUR")]


def test_a_late_payment_of_the_wrong_amount_is_refused_without_asking_the_check(
    make_service: Any, engine: Engine, clock: ManualClock
) -> None:
    service = make_service(late_payment_window_s=WINDOW_S)
    order = closed_by_the_sweep(service, clock, amount="10.00", currency="EUR")
    asked: list[str] = []
    service.set_late_payment_check(lambda order, payment: asked.append(order.id) is None)

    with pytest.raises(PaymentMismatch):
        service.mark_paid(order.id, payment_ref="bank-1", amount="9.99", currency="EUR")

    assert asked == []
    assert service.get_order(order.id).status is OrderStatus.CLOSED
    assert [r.reason for r in refusal_rows(engine)] == ["amount_mismatch"]


@pytest.mark.both_apis
def test_strict_expiry_closes_an_expired_order_and_the_window_then_accepts_it_late(
    make_service: Any, engine: Engine, clock: ManualClock
) -> None:
    service = make_service(strict_expiry=True, late_payment_window_s=WINDOW_S)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    clock.advance(s=TTL_S + 1)  # expired, not yet swept

    paid = service.mark_paid(order.id, payment_ref="bank-1")

    assert paid.status is OrderStatus.PAID
    assert kinds_of(engine, order.id) == ["created", "closed", "paid"]
    assert service.index.members("u1") == {}


def test_strict_expiry_without_a_window_closes_and_records_the_refund(
    make_service: Any, engine: Engine, clock: ManualClock
) -> None:
    service = make_service(strict_expiry=True)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    clock.advance(s=TTL_S + 1)

    with pytest.raises(OrderClosed) as refused:
        service.mark_paid(order.id, payment_ref="bank-1")

    assert refused.value.status == "closed"
    assert kinds_of(engine, order.id) == ["created", "closed", "payment_refused"]
    [row] = refusal_rows(engine)
    assert (row.reason, row.payment_ref) == ("closed", "bank-1")
    assert service.index.members("u1") == {}


# --- who did it ---------------------------------------------------------------------------


@pytest.mark.both_apis
def test_every_event_names_who_caused_it(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    service.set_pre_close_check(lambda order: 30 if order.user_id == "u2" else None)
    closed = service.create_unpaid_order("u1", ttl_s=TTL_S, actor="checkout-7")
    extended = service.create_unpaid_order("u2", ttl_s=TTL_S)
    cancelled = service.create_unpaid_order("u3", actor=Actor(ActorKind.OPERATOR, "ann@ops"))
    service.cancel_order(cancelled.id, actor="support-desk")
    clock.advance(s=TTL_S)
    service.sweep_expired()
    with pytest.raises(OrderClosed):
        service.mark_paid(closed.id, payment_ref="psp-1", actor="psp-webhook")

    def actors(order_id: str) -> list[tuple[str, str | None, str | None]]:
        return [(e.kind, e.actor_kind, e.actor) for e in events_of(engine, order_id)]

    assert actors(closed.id) == [
        ("created", "application", "checkout-7"),
        ("closed", "sweeper", None),
        ("payment_refused", "application", "psp-webhook"),
    ]
    assert actors(extended.id) == [
        ("created", "application", None),
        ("extended", "pre_close_check", None),
    ]
    assert actors(cancelled.id) == [
        ("created", "operator", "ann@ops"),
        ("cancelled", "application", "support-desk"),
    ]
    [event] = [e for e in service.iter_events(limit=100) if e.kind == "payment_refused"]
    assert event.actor == Actor(ActorKind.APPLICATION, "psp-webhook")


# --- the refund consumer --------------------------------------------------------------------


def test_a_refused_payment_handler_gets_each_refusal_once_and_can_mark_it_handled(
    service: OrderService, clock: ManualClock
) -> None:
    """The README's refund consumer: registered with on_payment_refused, run by the
    scheduler's events job (here: its consumers, run by hand)."""
    refunded: list[tuple[str, str | None, str | None]] = []

    @service.on_payment_refused
    def refund(event: OrderEvent) -> None:
        refunded.append((event.order_id, event.data["payment_ref"], event.data.get("amount")))
        service.mark_refund_handled(event.order_id, event.data["payment_ref"], actor="refunds")

    order = closed_by_the_sweep(service, clock, amount="5.00", currency="EUR")
    for _ in range(2):
        with pytest.raises(OrderClosed):
            service.mark_paid(order.id, payment_ref="psp-9", amount="5.00", currency="EUR")
    [consumer] = closed_order_consumers(service)
    assert consumer.name.startswith("on_payment_refused:")

    assert consumer.run_once().handled == 1
    assert consumer.run_once().handled == 0

    assert refunded == [(order.id, "psp-9", "5.00")]
    assert service.refused_payments(pending_only=True) == []
    [done] = service.refused_payments()
    assert done.handled_by == Actor(ActorKind.APPLICATION, "refunds")
