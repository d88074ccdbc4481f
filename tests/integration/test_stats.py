"""The stats read API on both engines: close-lag percentiles within their documented error,
window boundaries, empty windows, and counts that only look at what each index holds.

Rows are inserted directly with chosen timestamps: these tests are about reading them.
The expected figures are computed here from the raw lags, by another route than the SQL
histogram (sorting, nearest rank, rounding through the decimal string).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, create_engine, insert

from orders.errors import SchemaNotReady
from orders.sql.models import orders_table
from orders.sql.stats import (
    LAG_BUCKETS_MAX,
    CloseLag,
    Window,
    close_lag,
    count_in_window,
    count_unpaid,
    expiries_ahead,
    read_stats,
)

NOW = 1_800_000_000_000
#: Past this lag (ms) the histogram has one last bucket (the module's documented top).
TOP_MS = 10**13
_ids = itertools.count()


def order_row(status: str, expires_at_ms: int, **times: int) -> dict[str, Any]:
    at = times.get("closed_at_ms") or times.get("paid_at_ms") or expires_at_ms
    return {
        "id": f"o{next(_ids)}",
        "user_id": "u",
        "status": status,
        "amount": None,
        "currency": None,
        "created_at_ms": expires_at_ms - 60_000,
        "expires_at_ms": expires_at_ms,
        "updated_at_ms": at,
        "paid_at_ms": times.get("paid_at_ms"),
        "closed_at_ms": times.get("closed_at_ms"),
        "close_reason": None,
        "payment_ref": None,
        "metadata": None,
        "extensions": 0,
    }


def closed(closed_at_ms: int, lag_ms: int) -> dict[str, Any]:
    return order_row("closed", closed_at_ms - lag_ms, closed_at_ms=closed_at_ms)


def put(engine: Engine, rows: list[dict[str, Any]]) -> None:
    with engine.begin() as conn:
        conn.execute(insert(orders_table), rows)


def lag_of(engine: Engine, window: Window) -> CloseLag:
    with engine.connect() as conn:
        return close_lag(conn, window)


def rounded_up(lag: int) -> int | str:
    """The documented bucket of a lag: <= 0 together, exact up to 100 ms, then rounded up to
    two significant digits; one bucket past the top."""
    if lag <= 0:
        return 0
    if lag <= 100:
        return lag
    if lag > TOP_MS:
        return "top"
    unit = 10 ** (len(str(lag)) - 2)
    return -(-lag // unit) * unit


def expected_percentile(lags: list[int], rank: int) -> int:
    """The largest lag sharing its bucket with the exact nearest-rank value."""
    exact = sorted(lags)[rank - 1]
    return max(lag for lag in lags if rounded_up(lag) == rounded_up(exact))


def some_lags(seed: int) -> list[int]:
    rng = random.Random(seed)
    lags = [0, 1, 100, 101, 999, 1000, 1001, TOP_MS, TOP_MS + 1, -7]
    for low, high, n in [
        (-500, 0, 20),
        (1, 100, 60),
        (101, 10_000, 200),
        (10_000, 10**8, 200),
        (10**8, 10**12, 40),
        (TOP_MS + 2, TOP_MS + 10**9, 3),
    ]:
        lags += [rng.randint(low, high) for _ in range(n)]
    return lags


# --- the close lag ----------------------------------------------------------------------


def test_every_rank_is_the_documented_bucket_value_and_within_ten_percent(
    engine: Engine,
) -> None:
    lags = some_lags(seed=7)
    put(engine, [closed(NOW - 1000 - i, lag) for i, lag in enumerate(lags)])

    found = lag_of(engine, Window(NOW - 10_000, NOW))

    n = len(lags)
    assert found.count == n
    assert found.max_ms == max(lags)
    assert len(found.buckets) == len({rounded_up(lag) for lag in lags}) <= LAG_BUCKETS_MAX
    for rank in range(1, n + 1):
        exact = sorted(lags)[rank - 1]
        got = found.percentile((rank - 0.5) / n)
        assert got == expected_percentile(lags, rank), (rank, exact)
        assert got >= exact
        if 0 <= exact <= 100:
            assert got == exact
        elif 100 < exact <= TOP_MS:
            assert got < exact * 1.1


def test_p50_p99_and_max_of_a_known_set(engine: Engine) -> None:
    # 1..1000 ms, one each: exact p50 500 (bucket 491-500), p99 990 (bucket 981-990).
    put(engine, [closed(NOW - i, lag) for i, lag in enumerate(range(1, 1001))])

    with engine.connect() as conn:
        found = read_stats(conn, NOW, window_s=60)

    assert (found.lag_p50_ms, found.lag_p99_ms, found.lag_max_ms) == (500, 990, 1000)
    assert found.closed_in_window == found.by_status["closed"] == 1000


def test_percentiles_report_the_bucket_maximum_not_the_exact_value(engine: Engine) -> None:
    # 51 lags of 1_201 ms and 50 of 1_299 ms: the exact p50 is 1_201, in the bucket
    # (1_200, 1_300] whose largest lag is 1_299: that is what is reported, 8.2 % high.
    put(engine, [closed(NOW, 1_201) for _ in range(51)] + [closed(NOW, 1_299) for _ in range(50)])

    found = lag_of(engine, Window(NOW - 1, NOW))

    assert found.percentile(0.5) == 1_299
    assert found.percentile(0.01) == 1_299
    assert len(found.buckets) == 1


def test_the_window_is_open_at_its_start_and_closed_at_its_end(engine: Engine) -> None:
    since, until = NOW - 60_000, NOW
    put(
        engine,
        [
            closed(since - 1, 1),
            closed(since, 2),  # out: the window starts just after ``since``
            closed(since + 1, 30),
            closed(until, 40),
            closed(until + 1, 5_000),
            order_row("paid", NOW + 9, paid_at_ms=since),
            order_row("paid", NOW + 9, paid_at_ms=since + 1),
            order_row("paid", NOW + 9, paid_at_ms=until),
            order_row("paid", NOW + 9, paid_at_ms=until + 1),
            order_row("cancelled", NOW + 9, closed_at_ms=since),
            order_row("cancelled", NOW + 9, closed_at_ms=until),
            order_row("cancelled", NOW + 9, closed_at_ms=until + 1),
        ],
    )

    with engine.connect() as conn:
        found = read_stats(conn, until, window_s=60)
        settled = count_in_window(conn, Window(since, until))

    assert found.closed_in_window == 2
    assert (found.lag_p50_ms, found.lag_max_ms) == (30, 40)
    assert (settled.paid, settled.cancelled) == (2, 1)
    assert found.by_status == {"unpaid": 0, "paid": 2, "cancelled": 1, "closed": 2}


def test_replaced_and_reminded_orders_of_the_window_are_counted_with_its_edges(
    engine: Engine,
) -> None:
    since, until = NOW - 60_000, NOW

    def replaced(at_ms: int) -> dict[str, Any]:
        row = order_row("cancelled", NOW + 9, closed_at_ms=at_ms)
        return {**row, "close_reason": "replaced", "reminded_at_ms": None}

    def reminded(status: str, at_ms: int) -> dict[str, Any]:
        return {**order_row(status, NOW + 9, paid_at_ms=NOW + 1), "reminded_at_ms": at_ms}

    put(
        engine,
        [
            replaced(since),  # out: the window starts just after ``since``
            replaced(since + 1),
            replaced(until),
            replaced(until + 1),
            {**order_row("cancelled", NOW + 9, closed_at_ms=until), "reminded_at_ms": None},
            reminded("unpaid", since),
            reminded("unpaid", until),
            reminded("paid", since + 1),  # reminded, then paid: still a reminder sent
            reminded("unpaid", until + 1),
        ],
    )

    with engine.connect() as conn:
        settled = count_in_window(conn, Window(since, until))
        found = read_stats(conn, until, window_s=60)

    assert (settled.cancelled, settled.replaced, settled.reminded) == (3, 2, 2)
    assert (found.replaced_in_window, found.reminded_in_window) == (2, 2)


def test_cancelled_and_paid_orders_never_count_as_closes(engine: Engine) -> None:
    # A cancel sets closed_at_ms too: its "lag" (a negative or a huge one) is no close lag.
    put(
        engine,
        [
            closed(NOW, 250),
            order_row("cancelled", NOW - 10**9, closed_at_ms=NOW),
            order_row("cancelled", NOW + 10**6, closed_at_ms=NOW),
            order_row("paid", NOW - 10**9, paid_at_ms=NOW),
        ],
    )

    found = lag_of(engine, Window(NOW - 1, NOW))

    assert found.count == 1
    assert found.percentile(0.01) == found.max_ms == 250


def test_an_empty_window_has_no_percentiles(engine: Engine) -> None:
    put(engine, [closed(NOW - 120_000, 5), order_row("unpaid", NOW + 1)])

    with engine.connect() as conn:
        found = read_stats(conn, NOW, window_s=60)

    assert found.closed_in_window == 0
    assert found.lag_p50_ms is None
    assert found.lag_p99_ms is None
    assert found.lag_max_ms is None
    assert found.by_status == {"unpaid": 1, "paid": 0, "cancelled": 0, "closed": 0}


@pytest.mark.parametrize("fraction", [0, -0.5, 1.01])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        CloseLag(()).percentile(fraction)


# --- unpaid ---------------------------------------------------------------------------


def test_an_unpaid_order_is_open_before_its_expiry_and_backlog_from_it_on(engine: Engine) -> None:
    put(
        engine,
        [
            order_row("unpaid", NOW - 1),
            order_row("unpaid", NOW),  # due at its expiry: backlog
            order_row("unpaid", NOW + 1),
            order_row("unpaid", NOW + 10**7),
            order_row("closed", NOW - 5, closed_at_ms=NOW),
            order_row("paid", NOW + 5, paid_at_ms=NOW),
        ],
    )

    with engine.connect() as conn:
        found = count_unpaid(conn, NOW)

    assert (found.open, found.backlog) == (2, 2)


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda conn: close_lag(conn, Window(NOW - 1, NOW)), id="close_lag"),
        pytest.param(lambda conn: count_unpaid(conn, NOW), id="count_unpaid"),
        pytest.param(
            lambda conn: count_in_window(conn, Window(NOW - 1, NOW)),
            id="count_in_window",
        ),
        pytest.param(lambda conn: expiries_ahead(conn, NOW, 600, 10), id="expiries_ahead"),
    ],
)
def test_each_read_on_a_database_without_the_schema_raises_schema_not_ready(
    tmp_path: Path, read: Callable[[Connection], object]
) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'empty.db'}")
    try:
        with engine.connect() as conn, pytest.raises(SchemaNotReady):
            read(conn)
    finally:
        engine.dispose()
