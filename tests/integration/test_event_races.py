"""Two consumers of one name racing: only OrdersError leaves, and no event is lost.

``EventConsumer`` is documented as one instance per name at a time, but a second scheduler
started by mistake (or a deploy overlapping the old one) runs a second. Each test lines the
two up with a barrier just before the first write of their first transaction, so on
PostgreSQL both find no row and both insert one: the race that used to raise a raw
``IntegrityError``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, event, select

from orders.events.consumer import EventConsumer, EventPosition, OrderEvent, read_events
from orders.service import OrderService
from orders.sql.models import cursors_table, retries_table
from tests.support.clocks import ManualClock
from tests.support.threads import errors_of_threads


class FirstWriteBarrier:
    """Holds each thread at its first INSERT/UPDATE of ``table`` until both are there."""

    def __init__(self, engine: Engine, table: str) -> None:
        self.engine = engine
        self.table = table
        self.barrier = threading.Barrier(2, timeout=10)
        self.seen = threading.local()

    def __call__(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        words = statement.split()
        writes = words[0] in ("INSERT", "UPDATE") and self.table in words[:3]
        if writes and not getattr(self.seen, "done", False):
            self.seen.done = True
            self.barrier.wait()


@pytest.fixture
def line_up(engine: Engine) -> Iterator[Any]:
    listeners: list[FirstWriteBarrier] = []

    def install(table: str) -> None:
        listener = FirstWriteBarrier(engine, table)
        event.listen(engine, "before_cursor_execute", listener)
        listeners.append(listener)

    yield install
    for listener in listeners:
        event.remove(engine, "before_cursor_execute", listener)


def run_twice_at_once(consumers: list[EventConsumer]) -> list[BaseException]:
    return errors_of_threads(EventConsumer.run_once, [(c,) for c in consumers], timeout_s=30)


def test_two_consumers_of_one_name_creating_the_cursor_at_once_both_succeed(
    service: OrderService, engine: Engine, clock: ManualClock, line_up: Any
) -> None:
    for i in range(5):
        service.create_unpaid_order(f"u{i}")
    handled: Counter[int] = Counter()
    lock = threading.Lock()

    def handler(e: OrderEvent) -> None:
        with lock:
            handled[e.id] += 1

    line_up(cursors_table.name)
    consumers = [
        EventConsumer(engine, "twin", handler, clock=clock, start="oldest") for _ in range(2)
    ]

    assert run_twice_at_once(consumers) == []

    every = read_events(engine, EventPosition(), 100)
    assert set(handled) == {e.id for e in every}  # nothing lost; duplicates are allowed
    consumers[0].run_once()  # whatever the race left, the stream goes on from the end
    assert consumers[0].position() == every[-1].position
    with engine.connect() as conn:
        assert conn.execute(select(cursors_table.c.name)).scalars().all() == ["twin"]


def test_two_consumers_of_one_name_failing_on_one_event_at_once_keep_one_retry(
    service: OrderService, engine: Engine, clock: ManualClock, line_up: Any
) -> None:
    order = service.create_unpaid_order("u1")

    def handler(e: OrderEvent) -> None:
        raise RuntimeError("stock service down")

    line_up(retries_table.name)
    consumers = [
        EventConsumer(engine, "twin", handler, clock=clock, start="oldest") for _ in range(2)
    ]

    assert run_twice_at_once(consumers) == []

    with engine.connect() as conn:
        rows = conn.execute(select(retries_table)).all()
    assert [(r.consumer, r.attempts) for r in rows] == [("twin", 1)]
    assert read_events(engine)[0].order_id == order.id
    assert consumers[0].position() == read_events(engine)[-1].position
