"""``EventConsumer(..., transactional=True)``: the handler writes on the consumer's own
Connection, in the transaction that records the event's outcome.

A handler that fails (by raising, or by a statement the database refuses) leaves none of
its writes; two consumers of one name racing on threads hand no event over twice. The
kill -9 side is ``tests/crash/test_exactly_once_consumer.py``.
"""

from __future__ import annotations

import functools
import time
from collections import Counter

import pytest
from sqlalchemy import Connection, Engine

from orders.errors import InvalidInput
from orders.events.consumer import (
    ConsumeResult,
    EventConsumer,
    EventPosition,
    OrderEvent,
    read_events,
)
from tests.support.clocks import ManualClock
from tests.support.effects import (
    create_effects_table,
    effect_counts,
    record_effect,
    retry_rows,
    tried_before,
    write_events,
)
from tests.support.threads import outcomes_of_race


def test_a_failing_handler_leaves_no_writes_and_its_failure_is_recorded(
    engine: Engine, clock: ManualClock
) -> None:
    create_effects_table(engine)
    first, raises, refused, last = write_events(engine, 4)
    failing = {raises, refused}

    def handler(event: OrderEvent, conn: Connection) -> None:
        record_effect(event, conn)
        if event.id == raises and event.id in failing:
            raise RuntimeError("no stock row")
        if event.id == refused and event.id in failing:
            # A statement the database refuses: on PostgreSQL it aborts the transaction,
            # which the consumer's savepoint must bring back.
            conn.exec_driver_sql("SELECT * FROM no_such_table")

    consumer = EventConsumer(
        engine, "stock", handler, transactional=True, clock=clock, start="oldest"
    )
    assert consumer.run_once() == ConsumeResult(handled=2, failed=2)
    assert effect_counts(engine) == Counter({first: 1, last: 1})
    assert retry_rows(engine, "stock") == {raises: (1, False), refused: (1, False)}
    assert consumer.position().event_id == last

    failing.clear()
    clock.advance(s=3600)
    assert consumer.run_once() == ConsumeResult(retried_ok=2)
    assert effect_counts(engine) == Counter({first: 1, raises: 1, refused: 1, last: 1})
    assert retry_rows(engine, "stock") == {}


def test_a_handler_that_commits_the_consumer_s_transaction_is_refused(
    engine: Engine, clock: ManualClock
) -> None:
    create_effects_table(engine)
    write_events(engine, 2)

    def handler(event: OrderEvent, conn: Connection) -> None:
        record_effect(event, conn)
        conn.commit()

    consumer = EventConsumer(
        engine, "stock", handler, transactional=True, clock=clock, start="oldest"
    )
    with pytest.raises(InvalidInput, match="never commit"):
        consumer.run_once()
    assert consumer.position() == EventPosition()  # the event is not marked handled


def drain(consumer: EventConsumer, last: EventPosition) -> ConsumeResult:
    """run_once in small batches until the cursor is at ``last`` and nothing is retrying."""
    total = ConsumeResult()
    deadline = time.monotonic() + 60
    while consumer.position() < last or consumer.pending_retries():
        assert time.monotonic() < deadline, "the twins did not get through in 60 s"
        result = consumer.run_once(limit=5)
        total.handled += result.handled
        total.failed += result.failed
        total.retried_ok += result.retried_ok
    return total


def test_twin_consumers_racing_hand_each_event_over_exactly_once(
    engine: Engine, clock: ManualClock
) -> None:
    create_effects_table(engine)
    ids = write_events(engine, 120, transactions=6)
    fails_once = set(ids[::4])

    def handler(event: OrderEvent, conn: Connection) -> None:
        record_effect(event, conn)
        if event.id in fails_once and not tried_before(conn, "twin", event):
            raise RuntimeError("first try fails")

    twins = [
        EventConsumer(
            engine, "twin", handler, transactional=True, clock=clock, backoff_s=0, start="oldest"
        )
        for _ in range(2)
    ]
    last = read_events(engine, limit=1000)[-1].position
    results = outcomes_of_race([functools.partial(drain, c, last) for c in twins])

    assert all(isinstance(r, ConsumeResult) for r in results), results
    counts = effect_counts(engine)
    assert [e for e, n in counts.items() if n != 1] == []
    assert set(counts) == set(ids)
    assert retry_rows(engine, "twin") == {}
    done = [r for r in results if isinstance(r, ConsumeResult)]
    assert sum(r.handled + r.retried_ok for r in done) == len(ids)
    assert sum(r.failed for r in done) == len(fails_once)
