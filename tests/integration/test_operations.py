"""Metrics and stats move as orders are created, paid and closed."""

from __future__ import annotations

import contextlib
import re

from orders import OrderClosed, UnpaidOrderLimitReached
from orders.metrics import exposition
from orders.service import OrderService
from orders.sql.stats import CloseLag, LagBucket, collect_stats
from tests.support.clocks import ManualClock


def scrape() -> dict[str, float]:
    values: dict[str, float] = {}
    for line in exposition()[0].decode().splitlines():
        match = re.match(r"^(orders_[a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def test_metrics_move_as_orders_are_created_paid_and_closed(
    make_service: type, clock: ManualClock
) -> None:
    service: OrderService = make_service(unpaid_limit=2)
    before = scrape()

    paid = service.create_unpaid_order("u1", ttl_s=10)
    service.create_unpaid_order("u1", ttl_s=10)
    with contextlib.suppress(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1")
    service.mark_paid(paid.id)
    service.mark_paid(paid.id)
    clock.advance(s=12)
    service.sweep_expired()
    late = service.create_unpaid_order("u2", ttl_s=1)
    clock.advance(s=2)
    service.sweep_expired()
    with contextlib.suppress(OrderClosed):
        service.mark_paid(late.id)

    after = scrape()

    def moved(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved('orders_creates_total{result="admitted"}') == 3
    assert moved('orders_creates_total{result="refused_redis"}') == 1
    assert moved('orders_payments_total{outcome="on_time"}') == 1
    assert moved('orders_payments_total{outcome="repeat"}') == 1
    assert moved('orders_payments_total{outcome="refused_after_close"}') == 1
    assert moved("orders_closes_total") == 2
    assert moved("orders_close_lag_seconds_count") == 2
    assert moved("orders_sweep_duration_seconds_count") == 2


def test_stats_count_by_status_backlog_lag_and_the_expiries_ahead(
    service: OrderService, clock: ManualClock
) -> None:
    due = [service.create_unpaid_order(f"d{i}", ttl_s=5) for i in range(3)]
    service.mark_paid(due[0].id)
    for i, ttl in enumerate([70, 130, 130, 590]):
        service.create_unpaid_order(f"a{i}", ttl_s=ttl)
    clock.advance(s=6)
    service.sweep_expired()  # closes d1 and d2 at 6 s, 1 s after their expiry
    backlog_order = service.create_unpaid_order("b", ttl_s=1)
    clock.advance(s=2)

    found = collect_stats(service.engine, service.clock, window_s=60, horizon_s=600, buckets=10)

    assert found.by_status == {"unpaid": 5, "paid": 1, "cancelled": 0, "closed": 2}
    assert found.backlog == 1  # backlog_order: due, not closed
    assert found.open_unpaid == 4
    assert found.closed_in_window == 2
    assert found.lag_p50_ms == found.lag_max_ms == 1000
    # a0..a3 expire 70, 130, 130 and 590 s after creation, i.e. 62, 122, 122, 582 s ahead
    assert [count for _, count in found.upcoming] == [0, 1, 2, 0, 0, 0, 0, 0, 0, 1]
    assert backlog_order.id


def test_percentile_is_nearest_rank_read_off_the_cumulative_counts() -> None:
    """The histogram's percentile is the largest lag of the bucket holding the rank."""
    lags = CloseLag((LagBucket(0, 1, -5), LagBucket(7, 2, 7), LagBucket(110, 1, 104)))

    assert CloseLag(()).percentile(0.5) is None
    assert CloseLag(()).max_ms is None
    assert lags.count == 4
    assert lags.percentile(0.25) == -5  # rank 1
    assert lags.percentile(0.5) == 7  # rank 2
    assert lags.percentile(0.75) == 7  # rank 3
    assert lags.percentile(0.99) == lags.max_ms == 104  # rank 4
