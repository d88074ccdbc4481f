"""A payment for an order SQL does not hold (pruned by retention, or never seen): the caller
gets OrderNotFound, and the refund owed is recorded first, once per order and reference,
with no order and no event beside it (``reason`` ``unknown_order``). On both engines; time
moves only through ``clock``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders.errors import InvalidInput, OrderNotFound
from orders.service import OrderService
from orders.sql.models import events_table, refusals_table
from tests.support.clocks import ManualClock
from tests.support.threads import outcomes_of_race

DAY_MS = 86_400_000


def refusal_rows(engine: Engine) -> list[Any]:
    query = select(refusals_table).order_by(refusals_table.c.refused_at_ms)
    with engine.connect() as conn:
        return list(conn.execute(query).all())


def event_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(events_table)) or 0)


@pytest.mark.both_apis
def test_a_payment_for_an_order_never_seen_raises_not_found_and_records_its_refund_once(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    for _ in range(2):  # the payment provider retries its callback
        with pytest.raises(OrderNotFound) as missing:
            service.mark_paid("o-gone", payment_ref="psp-1", amount="19.90", currency="EUR")
        assert missing.value.order_id == "o-gone"

    [row] = refusal_rows(engine)
    assert (row.order_id, row.payment_ref, row.reason) == ("o-gone", "psp-1", "unknown_order")
    assert (row.user_id, row.event_id, row.amount, row.currency) == (None, None, "19.90", "EUR")
    assert (row.refused_at_ms, row.handled_at_ms) == (clock(), None)
    assert event_count(engine) == 0  # an event belongs to an order: there is none
    [owed] = service.refused_payments(pending_only=True)
    assert (owed.order_id, owed.reason.value, owed.user_id, owed.position) == (
        "o-gone",
        "unknown_order",
        None,
        None,
    )
    handled = service.mark_refund_handled("o-gone", "psp-1", actor="refund-worker")
    assert handled.handled
    assert service.refused_payments(pending_only=True) == []


def test_a_payment_for_a_pruned_order_is_owed_and_outlives_every_prune(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    shop = make_service()
    order = shop.create_unpaid_order("u1", ttl_s=600)
    shop.cancel_order(order.id)
    clock.advance(ms=100 * DAY_MS)
    assert shop.operations.prune(90 * 86_400).orders == 1

    with pytest.raises(OrderNotFound):
        shop.mark_paid(order.id, payment_ref="psp-late")
    clock.advance(ms=100 * DAY_MS)
    shop.operations.prune(1)

    [owed] = shop.refused_payments(pending_only=True)
    assert (owed.order_id, owed.payment_ref) == (order.id, "psp-late")
    assert owed.reason.value == "unknown_order"


def test_concurrent_retries_of_one_payment_for_a_missing_order_record_one_refusal(
    service: OrderService, engine: Engine
) -> None:
    pay = lambda: service.mark_paid("o-gone", payment_ref="psp-1")  # noqa: E731

    outcomes = outcomes_of_race([pay] * 8)

    assert all(isinstance(outcome, OrderNotFound) for outcome in outcomes), outcomes
    assert [(r.order_id, r.payment_ref) for r in refusal_rows(engine)] == [("o-gone", "psp-1")]


@pytest.mark.parametrize("order_id", ["", "x" * 129, "line\nbreak", 7])
def test_a_malformed_order_id_is_invalid_input_and_records_no_refusal(
    service: OrderService, engine: Engine, order_id: Any
) -> None:
    with pytest.raises(InvalidInput) as refused:
        service.mark_paid(order_id, payment_ref="psp-1")

    assert refused.value.field == "order_id"
    assert refusal_rows(engine) == []
