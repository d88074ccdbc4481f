"""``orders stats``: the expiry pipeline's health, read from SQL by bounded queries.

Each query is served by an index and none scans the whole table: the unpaid counts and the
expiries ahead read the partial indexes over unpaid orders; the paid, cancelled and closed
counts read the partial indexes over each terminal status, keyed on its transition's time,
and so count what happened within a time window, not since the beginning. The users with a
limit of their own are a count of ``oes_user_limits``, which holds only those users.

The close lag (closed_at_ms - expires_at_ms) is summed up in SQL as a histogram with a fixed
set of buckets, so that Python holds at most ``LAG_BUCKETS_MAX`` rows however many orders
closed. A lag falls in the bucket of its value rounded up to two significant digits (lags of
at most 100 ms are buckets of their own, lags at or below 0 share one); a percentile is the
largest lag of the bucket the percentile's rank falls in. It is therefore never below the
exact nearest-rank percentile, and above it by less than 10 % (exact up to 100 ms); the
maximum is exact.

The functions taking a Connection are the read API (a dashboard reuses them); they raise
StoreUnavailable like the rest of the package. ``collect_stats`` is what the command runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    and_,
    case,
    func,
    literal_column,
    select,
)

from orders.domain import REPLACED_REASON, Clock, OrderStatus
from orders.sql.failures import sql_errors
from orders.sql.models import orders_table, user_limits_table
from orders.sql.predicates import UNPAID_PREDICATE, open_at
from orders.validation import check_count

OC = orders_table.c

#: The histogram's decades: lags up to 100 ms are exact, then each power of ten up to
#: 10**LAG_TOP_DECADE ms (over 300 years) is cut into 90 buckets. Past that: one bucket.
LAG_EXACT_MS = 100
LAG_TOP_DECADE = 13
#: The most rows the lag histogram can return: lags <= 0, 1..100 ms, 90 per decade, past top.
LAG_BUCKETS_MAX = 1 + LAG_EXACT_MS + 90 * (LAG_TOP_DECADE - 2) + 1


def status_is(status: OrderStatus) -> ColumnElement[bool]:
    # An inline literal: the form a partial index serves, generic plans included.
    return OC.status == literal_column(f"'{status.value}'")


def _int(value: int) -> ColumnElement[int]:
    return literal_column(str(value), BigInteger())


@dataclass(frozen=True, slots=True)
class Window:
    """The instants ``since_ms < t <= until_ms``."""

    since_ms: int
    until_ms: int

    @classmethod
    def ending_at(cls, until_ms: int, seconds: int) -> Window:
        """The last ``seconds`` up to and including ``until_ms``."""
        return cls(until_ms - seconds * 1000, until_ms)

    def holds(self, column: ColumnElement[Any]) -> ColumnElement[bool]:
        return and_(column > self.since_ms, column <= self.until_ms)


@dataclass(frozen=True, slots=True)
class UnpaidCounts:
    #: Unpaid with the expiry still ahead: what counts against the users' limits.
    open: int
    #: Unpaid with the expiry passed: due, not closed yet.
    backlog: int


@dataclass(frozen=True, slots=True)
class WindowCounts:
    """Orders paid, cancelled (of which ``replaced`` by a newer create at the limit) and
    reminded within a window (closed ones: ``CloseLag.count``)."""

    paid: int
    cancelled: int
    replaced: int
    reminded: int


@dataclass(frozen=True, slots=True)
class LagBucket:
    #: Every lag in the bucket is at most this (ms); None for the bucket past the top.
    upper_ms: int | None
    count: int
    #: The largest lag in the bucket (ms), exact.
    max_ms: int


@dataclass(frozen=True, slots=True)
class CloseLag:
    """The close lags of the orders closed within a window, as a histogram."""

    #: In increasing order of lag.
    buckets: tuple[LagBucket, ...]

    @property
    def count(self) -> int:
        return sum(bucket.count for bucket in self.buckets)

    @property
    def max_ms(self) -> int | None:
        return self.buckets[-1].max_ms if self.buckets else None

    def percentile(self, fraction: float) -> int | None:
        """The nearest-rank percentile, from above: the largest lag of the bucket holding
        the rank (less than 10 % over the exact value; exact up to 100 ms). None if empty.
        """
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], not {fraction}")
        rank = max(1, -(-self.count * fraction // 1))
        seen = 0
        for bucket in self.buckets:
            seen += bucket.count
            if seen >= rank:
                return bucket.max_ms
        return None


def lag_bucket(lag: ColumnElement[Any]) -> ColumnElement[Any]:
    """SQL: the upper bound of ``lag``'s bucket, ``lag`` rounded up to two significant
    digits (0 for lags <= 0, the lag itself up to 100 ms, NULL past the top decade)."""
    whens: list[tuple[ColumnElement[bool], ColumnElement[Any]]] = [
        (lag <= _int(0), _int(0)),
        (lag <= _int(LAG_EXACT_MS), lag),
    ]
    for decade in range(3, LAG_TOP_DECADE + 1):
        step = _int(10 ** (decade - 2))
        whens.append((lag <= _int(10**decade), ((lag - _int(1)) // step + _int(1)) * step))
    return case(*whens, else_=None)


def close_lag(conn: Connection, window: Window) -> CloseLag:
    """The close lags of the orders closed in ``window``, summed up in SQL (one index range
    read: ``ix_oes_orders_closed_closed_at_ms_expires_at_ms``)."""
    lag = OC.closed_at_ms - OC.expires_at_ms
    # OFFSET 0 keeps the subquery from being merged into the grouping query: merged,
    # PostgreSQL would guess one group per row from the columns' statistics and sort every
    # lag of the window (on disk beyond work_mem) instead of hashing into a few hundred.
    lags = (
        select(lag_bucket(lag).label("upper_ms"), lag.label("lag"))
        .where(status_is(OrderStatus.CLOSED), window.holds(OC.closed_at_ms))
        .offset(0)
        .subquery()
    )
    query = select(lags.c.upper_ms, func.count(), func.max(lags.c.lag)).group_by(lags.c.upper_ms)
    with sql_errors():
        rows: Sequence[Any] = conn.execute(query).all()
    buckets = [LagBucket(_opt(upper), int(count), int(top)) for upper, count, top in rows]
    # None (past the top decade) sorts last.
    buckets.sort(key=lambda b: (b.upper_ms is None, b.upper_ms or 0))
    return CloseLag(tuple(buckets))


def _opt(value: Any) -> int | None:
    return None if value is None else int(value)


def count_unpaid(conn: Connection, now_ms: int) -> UnpaidCounts:
    """Open and overdue unpaid orders at ``now_ms`` (the partial index over unpaid orders)."""
    query = select(func.count().filter(OC.expires_at_ms > now_ms), func.count()).where(
        UNPAID_PREDICATE
    )
    with sql_errors():
        open_count, unpaid = conn.execute(query).one()
    return UnpaidCounts(open=int(open_count), backlog=int(unpaid) - int(open_count))


def count_in_window(conn: Connection, window: Window) -> WindowCounts:
    """Orders paid (by paid_at_ms), cancelled (by closed_at_ms; the replaced ones among
    them by their close reason) and reminded (by reminded_at_ms) within ``window``, in one
    statement, each counted from its partial index."""
    cancelled_in_window = and_(status_is(OrderStatus.CANCELLED), window.holds(OC.closed_at_ms))
    counts = (
        select(func.count()).where(status_is(OrderStatus.PAID), window.holds(OC.paid_at_ms)),
        select(func.count()).where(cancelled_in_window),
        select(func.count()).where(
            cancelled_in_window, OC.close_reason == literal_column(f"'{REPLACED_REASON}'")
        ),
        select(func.count()).where(OC.reminded_at_ms.is_not(None), window.holds(OC.reminded_at_ms)),
    )
    with sql_errors():
        row = conn.execute(select(*(count.scalar_subquery() for count in counts))).one()
    paid, cancelled, replaced, reminded = (int(n) for n in row)
    return WindowCounts(paid=paid, cancelled=cancelled, replaced=replaced, reminded=reminded)


def expiries_ahead(
    conn: Connection, now_ms: int, horizon_s: int, buckets: int
) -> list[tuple[int, int]]:
    """Open orders expiring in the next ``horizon_s``, in ``buckets`` equal slices:
    (seconds from ``now_ms`` to the slice's start, count) per slice."""
    check_count("horizon_s", horizon_s, 1, 31 * 86_400)
    check_count("buckets", buckets, 1, 100)
    step_ms = max(1, horizon_s * 1000 // buckets)
    # The slot computed once, in a subquery: grouping by the expression itself would repeat
    # its parameters, which PostgreSQL cannot prove the same in a prepared statement.
    slots = (
        select(((OC.expires_at_ms - now_ms) // step_ms).label("slot"))
        .where(open_at(now_ms), OC.expires_at_ms < now_ms + step_ms * buckets)
        .subquery()
    )
    query = select(slots.c.slot, func.count()).group_by(slots.c.slot)
    with sql_errors():
        per_slot = {int(k): int(v) for k, v in conn.execute(query).all()}
    return [(i * step_ms // 1000, per_slot.get(i, 0)) for i in range(buckets)]


@dataclass(frozen=True, slots=True)
class Stats:
    at_ms: int
    #: unpaid: all unpaid orders now; paid, cancelled, closed: those transitions within the
    #: window (the last ``window_s`` seconds), not since the beginning.
    by_status: dict[str, int]
    #: Unpaid with the expiry still ahead: what counts against the users' limits.
    open_unpaid: int
    #: Unpaid with the expiry passed: due, not closed yet.
    backlog: int
    window_s: int
    closed_in_window: int
    #: closed_at - expires_at percentiles of the orders closed in the window (ms): from
    #: above, less than 10 % over the exact value (see the module's docstring); max exact.
    lag_p50_ms: int | None
    lag_p99_ms: int | None
    lag_max_ms: int | None
    #: Expiries due ahead, per bucket: (seconds from now to the bucket's start, count).
    upcoming: list[tuple[int, int]]
    #: Users with a limit of their own (``set_user_limit``): one row each, a small table.
    users_with_own_limit: int = 0
    #: Within the window: orders cancelled to make room for a newer one at the limit
    #: (``on_limit="replace_oldest"``), and reminders written (``expiring`` events).
    replaced_in_window: int = 0
    reminded_in_window: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_stats(
    conn: Connection, now_ms: int, *, window_s: int = 3600, horizon_s: int = 600, buckets: int = 10
) -> Stats:
    """Every figure of ``orders stats`` at ``now_ms``, on ``conn``."""
    check_count("window_s", window_s, 1, 366 * 86_400)
    window = Window.ending_at(now_ms, window_s)
    unpaid = count_unpaid(conn, now_ms)
    settled = count_in_window(conn, window)
    lag = close_lag(conn, window)
    upcoming = expiries_ahead(conn, now_ms, horizon_s, buckets)
    by_status = {
        OrderStatus.UNPAID.value: unpaid.open + unpaid.backlog,
        OrderStatus.PAID.value: settled.paid,
        OrderStatus.CANCELLED.value: settled.cancelled,
        OrderStatus.CLOSED.value: lag.count,
    }
    return Stats(
        at_ms=now_ms,
        by_status=by_status,
        open_unpaid=unpaid.open,
        backlog=unpaid.backlog,
        window_s=window_s,
        closed_in_window=lag.count,
        lag_p50_ms=lag.percentile(0.50),
        lag_p99_ms=lag.percentile(0.99),
        lag_max_ms=lag.max_ms,
        upcoming=upcoming,
        users_with_own_limit=conn.scalar(select(func.count()).select_from(user_limits_table)) or 0,
        replaced_in_window=settled.replaced,
        reminded_in_window=settled.reminded,
    )


def collect_stats(
    engine: Engine, clock: Clock, *, window_s: int = 3600, horizon_s: int = 600, buckets: int = 10
) -> Stats:
    """``read_stats`` at ``clock``'s time, on a connection of ``engine`` (a service's two)."""
    check_count("window_s", window_s, 1, 366 * 86_400)
    check_count("horizon_s", horizon_s, 1, 31 * 86_400)
    check_count("buckets", buckets, 1, 100)
    with sql_errors(), engine.connect() as conn:
        return read_stats(conn, clock(), window_s=window_s, horizon_s=horizon_s, buckets=buckets)
