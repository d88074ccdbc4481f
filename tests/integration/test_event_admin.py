"""The operator's view of event consumers (lag, retrying, parked) and its two actions."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.domain import Actor, ActorKind, EventKind
from orders.errors import InvalidInput
from orders.events.admin import (
    ParkedAction,
    act_on_parked,
    lag_statements,
    list_consumers,
    list_parked,
)
from orders.events.consumer import EventConsumer, EventPosition, read_events
from orders.service import OrderService
from orders.sql.models import events_table, retries_table
from tests.support.clocks import ManualClock
from tests.support.doubles import Poison
from tests.support.plans import explain

HOUR_S = 3600
REQUEUE, DISCARD = ParkedAction.REQUEUE, ParkedAction.DISCARD


def parked_consumer(
    service: OrderService, engine: Engine, clock: ManualClock
) -> tuple[EventConsumer, Poison, str]:
    """Consumer "stock" of ``created`` events with the first order's event parked after 2
    attempts (only ``created``: a requeue or discard is an event of the order too)."""
    order = service.create_unpaid_order("u1")
    handler = Poison(order.id)
    consumer = EventConsumer(
        engine,
        "stock",
        handler,
        kinds=[EventKind.CREATED],
        clock=clock,
        max_attempts=2,
        start="oldest",
    )
    consumer.run_once()
    clock.advance(s=HOUR_S)
    assert consumer.run_once().parked == 1
    return consumer, handler, order.id


def retry_row(engine: Engine) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(retries_table)).one_or_none()


def test_consumers_show_position_lag_oldest_wait_and_failure_counts(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    consumer, _, _ = parked_consumer(service, engine, clock)
    bad = service.create_unpaid_order("u2")
    consumer.handler.order_ids.add(bad.id)  # type: ignore[attr-defined]
    consumer.run_once()  # one retrying now, one parked
    EventConsumer(engine, "audit", lambda e: None, clock=clock, start="oldest").run_once()
    assert [c.lag_events for c in list_consumers(engine, clock=clock)] == [0, 0]

    clock.advance(s=10)
    first_unread_at_ms = clock()
    for i in range(4):
        service.create_unpaid_order(f"n{i}")
        clock.advance(s=1)

    audit, stock = list_consumers(engine, clock=clock)
    last = read_events(engine, EventPosition(), 100)[-5]
    assert (audit.name, audit.lag_events, audit.retrying, audit.parked) == ("audit", 4, 0, 0)
    assert audit.oldest_unread_age_ms == clock() - first_unread_at_ms == 4000
    assert audit.position == last.position
    assert (stock.name, stock.lag_events, stock.retrying, stock.parked) == ("stock", 4, 1, 1)
    assert not audit.lag_capped

    # A capped count stops at the cap, and says so; the oldest unread is the same.
    for cap, expected in ((3, (3, True)), (4, (4, True)), (5, (4, False))):
        capped = list_consumers(engine, clock=clock, lag_cap=cap)[0]
        assert (capped.lag_events, capped.lag_capped) == expected, cap
        assert capped.oldest_unread_age_ms == audit.oldest_unread_age_ms


def test_the_lag_count_and_the_oldest_unread_are_index_range_scans(engine: Engine) -> None:
    count, first = lag_statements(engine, EventPosition(5, 7))
    capped, _ = lag_statements(engine, EventPosition(5, 7), cap=10_000)
    for statement in (count, first, capped):
        plan = explain(engine, statement)
        if engine.dialect.name == "postgresql":  # a range of the index, not all of it
            assert "ix_oes_order_events_txid_id" in plan, plan
            assert "Index Cond" in plan, plan
        else:
            assert "USING INTEGER PRIMARY KEY (rowid>?)" in plan, plan


def test_parked_events_are_listed_with_their_order_kind_attempts_and_error(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    _, _, order_id = parked_consumer(service, engine, clock)

    [parked] = list_parked(engine)

    assert (parked.consumer, parked.event_id, parked.order_id, parked.kind) == (
        "stock",
        1,
        order_id,
        "created",
    )
    assert parked.attempts == 2
    assert parked.parked_at_ms == clock()
    assert parked.last_error == f"RuntimeError: no stock row for {order_id}"
    assert list_parked(engine, consumer="stock") == [parked]
    with pytest.raises(InvalidInput, match="no consumer with that name"):
        list_parked(engine, consumer="nope")


def test_requeue_makes_a_parked_event_run_again_and_succeed(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    consumer, handler, order_id = parked_consumer(service, engine, clock)
    clock.advance(s=HOUR_S)
    consumer.run_once()
    assert handler.calls == [1, 1]  # parked: not tried again

    act_on_parked(engine, REQUEUE, "stock", 1, clock=clock)
    row = retry_row(engine)
    assert (row.attempts, row.next_at_ms, row.parked_at_ms) == (0, clock(), None)
    handler.order_ids.clear()  # the bug is fixed
    result = consumer.run_once()

    assert result.retried_ok == 1
    assert handler.handled == [order_id]
    assert retry_row(engine) is None
    assert list_consumers(engine, clock=clock)[0].parked == 0


def test_a_requeued_event_that_fails_again_gets_max_attempts_more_tries(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    consumer, handler, _ = parked_consumer(service, engine, clock)
    act_on_parked(engine, REQUEUE, "stock", 1, clock=clock)

    for _ in range(5):
        consumer.run_once()
        clock.advance(s=HOUR_S)

    assert handler.calls == [1, 1, 1, 1]
    assert retry_row(engine).parked_at_ms is not None


def test_discard_removes_the_parked_entry_and_keeps_the_event(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    consumer, handler, order_id = parked_consumer(service, engine, clock)

    act_on_parked(engine, DISCARD, "stock", 1)

    assert retry_row(engine) is None
    assert read_events(engine)[0].order_id == order_id
    clock.advance(s=HOUR_S)
    consumer.run_once()
    assert handler.calls == [1, 1]
    assert list_parked(engine) == []


@pytest.mark.parametrize("action", list(ParkedAction))
def test_requeue_and_discard_refuse_what_is_not_a_parked_event(
    service: OrderService, engine: Engine, clock: ManualClock, action: ParkedAction
) -> None:
    consumer, _, _ = parked_consumer(service, engine, clock)
    retrying = service.create_unpaid_order("u2")
    consumer.handler.order_ids.add(retrying.id)  # type: ignore[attr-defined]
    consumer.run_once()

    cases = [
        ("nope", 1, "consumer", "no consumer with that name"),
        ("stock", 999, "event_id", "no parked event with that id"),
        ("stock", 2, "event_id", "is retrying, not parked"),
        ("", 1, "consumer", "printable"),
        ("stock", 0, "event_id", "positive integer"),
        ("stock", True, "event_id", "positive integer"),
    ]
    for name, event_id, field, words in cases:
        with pytest.raises(InvalidInput, match=words) as refused:
            act_on_parked(engine, action, name, event_id, clock=clock)
        assert refused.value.field == field
    with pytest.raises(InvalidInput, match="requeue or discard"):
        act_on_parked(engine, "retry", "stock", 1)  # type: ignore[arg-type]
    assert [p.event_id for p in list_parked(engine)] == [1]  # nothing was changed
    assert consumer.pending_retries() == 1


def test_requeue_and_discard_are_recorded_as_events_naming_the_operator(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    _, _, order_id = parked_consumer(service, engine, clock)
    ann = Actor(ActorKind.OPERATOR, "ann@ops-1")

    act_on_parked(engine, REQUEUE, "stock", 1, clock=clock, actor=ann)
    consumer_again = EventConsumer(
        engine,
        "stock",
        Poison(order_id),
        kinds=[EventKind.CREATED],
        clock=clock,
        max_attempts=1,
        start="oldest",
    )
    consumer_again.run_once()  # fails once more: parked again (max_attempts=1)
    clock.advance(s=HOUR_S)
    consumer_again.run_once()
    act_on_parked(engine, DISCARD, "stock", 1, clock=clock)

    with engine.connect() as conn:
        rows = conn.execute(
            select(events_table.c.kind, events_table.c.actor_kind, events_table.c.actor)
            .add_columns(events_table.c.data)
            .where(events_table.c.order_id == order_id, events_table.c.kind != "created")
            .order_by(events_table.c.id)
        ).all()
    assert [tuple(r) for r in rows] == [
        ("requeued", "operator", "ann@ops-1", {"consumer": "stock", "event_id": 1}),
        ("discarded", "operator", None, {"consumer": "stock", "event_id": 1}),
    ]
