"""Retries that give up: attempts counted, jittered backoff, parked after max_attempts.

Time moves with the manual clock and the jitter comes from an injected random source, so
nothing sleeps and every delay is known.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.config import Settings
from orders.errors import InvalidInput
from orders.events.consumer import EventConsumer
from orders.service import OrderService
from orders.sql.models import retries_table
from tests.support.clocks import ManualClock
from tests.support.doubles import Poison

HOUR_S = 3600


def retry_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(retries_table).order_by(retries_table.c.event_id)).all()


def test_attempts_are_counted_and_the_last_error_kept_on_one_line(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    consumer = EventConsumer(
        engine, "stock", Poison(order.id), clock=clock, max_attempts=5, start="oldest"
    )

    seen = []
    for _ in range(3):
        consumer.run_once()
        [row] = retry_rows(engine)
        seen.append(row.attempts)
        clock.advance(s=HOUR_S)

    assert seen == [1, 2, 3]
    assert row.last_error == f"RuntimeError: no stock row for {order.id}"
    assert row.parked_at_ms is None
    assert consumer.pending_retries() == 1


def test_backoff_is_full_jitter_below_the_doubling_ceiling(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    consumer = EventConsumer(
        engine,
        "stock",
        Poison(order.id),
        clock=clock,
        backoff_s=1,
        max_backoff_s=20,
        max_attempts=100,
        rand=random.Random(7).random,
        start="oldest",
    )

    delays, ceilings = [], []
    for attempt in range(1, 11):
        consumer.run_once()
        [row] = retry_rows(engine)
        assert row.attempts == attempt
        delays.append(row.next_at_ms - clock())
        ceilings.append(min(20_000, 1000 * 2 ** (attempt - 1)))
        clock.set(row.next_at_ms)  # exactly when it is due

    assert all(0 <= d <= c for d, c in zip(delays, ceilings, strict=True)), delays
    assert sum(d < 0.9 * c for d, c in zip(delays, ceilings, strict=True)) >= 3, delays


def test_the_jitter_draw_scales_the_ceiling(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    consumer = EventConsumer(
        engine,
        "stock",
        Poison(order.id),
        clock=clock,
        backoff_s=2,
        rand=lambda: 0.25,
        start="oldest",
    )
    assert [consumer.backoff_ms(n) for n in (1, 2, 3, 20)] == [500, 1000, 2000, 75_000]
    consumer.run_once()
    assert retry_rows(engine)[0].next_at_ms == clock() + 500


def test_an_event_that_used_its_attempts_is_parked_logged_once_and_never_tried_again(
    service: OrderService, engine: Engine, clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    poison = service.create_unpaid_order("u1")
    handler = Poison(poison.id)
    consumer = EventConsumer(engine, "stock", handler, clock=clock, max_attempts=3, start="oldest")
    caplog.set_level(logging.WARNING, logger="orders.events")

    parked = 0
    parked_at_ms = clock() + 2 * HOUR_S * 1000  # the third try
    for _ in range(10):
        parked += consumer.run_once().parked
        clock.advance(s=HOUR_S)
    later = service.create_unpaid_order("u2")
    consumer.run_once()

    assert handler.calls.count(1) == 3  # the first try and two retries, then no more
    assert parked == 1
    [row] = retry_rows(engine)
    assert (row.event_id, row.attempts, row.parked_at_ms) == (1, 3, parked_at_ms)
    assert row.last_error.startswith("RuntimeError: no stock row")
    assert consumer.pending_retries() == 0
    assert handler.handled == [later.id]  # the stream went on past it
    lines = [r.getMessage() for r in caplog.records if "parked" in r.getMessage()]
    assert lines == [
        "event consumer stock parked event 1 after 3 attempts; see `orders events parked`"
    ]
    assert all(r.levelno == logging.WARNING for r in caplog.records)


def test_max_attempts_one_parks_at_the_first_failure(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    consumer = EventConsumer(
        engine, "stock", Poison(order.id), clock=clock, max_attempts=1, start="oldest"
    )

    assert consumer.run_once().parked == 1

    [row] = retry_rows(engine)
    assert (row.attempts, row.parked_at_ms) == (1, clock())


@pytest.mark.parametrize("bad", [0, 1001, True, 2.5, "3"])
def test_max_attempts_out_of_range_is_refused(engine: Engine, bad: Any) -> None:
    with pytest.raises(InvalidInput, match="max_attempts"):
        EventConsumer(engine, "stock", print, max_attempts=bad)


def test_event_max_attempts_setting_reads_its_environment_variable() -> None:
    assert Settings().event_max_attempts == 10
    assert Settings.from_env({"ORDERS_EVENT_MAX_ATTEMPTS": "4"}).event_max_attempts == 4
    with pytest.raises(InvalidInput, match="event_max_attempts"):
        Settings.from_env({"ORDERS_EVENT_MAX_ATTEMPTS": "0"})
