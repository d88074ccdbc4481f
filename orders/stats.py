"""``orders stats``: the expiry pipeline's health, read from SQL."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy import func, select

from orders.domain import OrderStatus
from orders.models import UNPAID_PREDICATE, orders_table, sql_errors
from orders.service import OrderService
from orders.validation import check_count

OC = orders_table.c


@dataclass(frozen=True, slots=True)
class Stats:
    at_ms: int
    by_status: dict[str, int]
    #: Unpaid with the expiry still ahead: what counts against the users' limits.
    open_unpaid: int
    #: Unpaid with the expiry passed: due, not closed yet.
    backlog: int
    window_s: int
    closed_in_window: int
    #: closed_at - expires_at percentiles of the orders closed in the window (ms).
    lag_p50_ms: int | None
    lag_p99_ms: int | None
    lag_max_ms: int | None
    #: Expiries due ahead, per bucket: (seconds from now to the bucket's start, count).
    upcoming: list[tuple[int, int]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[int], fraction: float) -> int | None:
    """Nearest-rank percentile of an already sorted list (None for an empty one)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * fraction // 1))
    return sorted_values[int(rank) - 1]


def collect_stats(
    service: OrderService, *, window_s: int = 3600, horizon_s: int = 600, buckets: int = 10
) -> Stats:
    check_count("window_s", window_s, 1, 366 * 86_400)
    check_count("horizon_s", horizon_s, 1, 31 * 86_400)
    check_count("buckets", buckets, 1, 100)
    now_ms = service.clock()
    step_ms = max(1, horizon_s * 1000 // buckets)
    with sql_errors(), service.engine.connect() as conn:
        by_status = {status.value: 0 for status in OrderStatus}
        for status, count in conn.execute(select(OC.status, func.count()).group_by(OC.status)):
            by_status[status] = count
        open_unpaid = conn.scalar(
            select(func.count()).where(UNPAID_PREDICATE, OC.expires_at_ms > now_ms)
        )
        backlog = conn.scalar(
            select(func.count()).where(UNPAID_PREDICATE, OC.expires_at_ms <= now_ms)
        )
        lags = sorted(
            conn.scalars(
                select(OC.closed_at_ms - OC.expires_at_ms).where(
                    OC.status == OrderStatus.CLOSED.value,
                    OC.closed_at_ms >= now_ms - window_s * 1000,
                )
            )
        )
        slot = (OC.expires_at_ms - now_ms) // step_ms
        counts: dict[Any, Any] = dict(
            conn.execute(
                select(slot, func.count())
                .where(
                    UNPAID_PREDICATE,
                    OC.expires_at_ms > now_ms,
                    OC.expires_at_ms < now_ms + step_ms * buckets,
                )
                .group_by(slot)
            ).all()
        )
    per_slot = {int(k): int(v) for k, v in counts.items()}
    upcoming = [(i * step_ms // 1000, per_slot.get(i, 0)) for i in range(buckets)]
    return Stats(
        at_ms=now_ms,
        by_status=by_status,
        open_unpaid=int(open_unpaid or 0),
        backlog=int(backlog or 0),
        window_s=window_s,
        closed_in_window=len(lags),
        lag_p50_ms=percentile(lags, 0.50),
        lag_p99_ms=percentile(lags, 0.99),
        lag_max_ms=lags[-1] if lags else None,
        upcoming=upcoming,
    )
