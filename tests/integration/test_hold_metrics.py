"""The metrics of holds (issue 43), on both engines: ``orders_holds_total{outcome}`` moves by
one per order and resource for ``taken``, ``released`` and ``sold``, by one per refused
create for each ``refused_<reason>``, and by nothing else; ``orders_resource_drift_total
{kind}`` by one per resource reconcile rebuilt, and not on a dry run. Each test reads the
counters of the process's default registry before and after one event and compares every
label value, so an outcome counted under another one is caught too."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import redis
from prometheus_client import REGISTRY
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine

from orders import HoldRefused, OrderService
from orders.metrics import DRIFT_KINDS, HOLD_OUTCOMES
from tests.support.clocks import ManualClock

LATE_WINDOW_S = 3600


def counters() -> dict[str, float]:
    """Every label value of both counters (``holds:<outcome>``, ``drift:<kind>``)."""
    found = {
        f"holds:{outcome}": REGISTRY.get_sample_value("orders_holds_total", {"outcome": outcome})
        for outcome in HOLD_OUTCOMES
    }
    found |= {
        f"drift:{kind}": REGISTRY.get_sample_value("orders_resource_drift_total", {"kind": kind})
        for kind in DRIFT_KINDS
    }
    return {name: value or 0.0 for name, value in found.items()}


@contextmanager
def moves() -> Iterator[dict[str, float]]:
    """The counters that changed inside the block, by how much (filled in at its end)."""
    moved: dict[str, float] = {}
    before = counters()
    yield moved
    moved.update({k: v - before[k] for k, v in counters().items() if v != before[k]})


def refused(service: OrderService, user_id: str, holds: dict[str, int]) -> str:
    with pytest.raises(HoldRefused) as caught:
        service.create_unpaid_order(user_id, holds=holds)
    return f"{caught.value.reason}/{caught.value.source}"


def test_a_create_counts_one_hold_taken_per_resource_and_a_retry_or_a_plain_create_none(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 5)
    service.set_capacity("b", 5)

    with moves() as created:
        order = service.create_unpaid_order("u1", holds={"a": 3, "b": 1})
    with moves() as retried:
        service.create_unpaid_order("u1", order_id=order.id, holds={"a": 3, "b": 1})
    with moves() as plain:
        service.create_unpaid_order("u1")

    assert created == {"holds:taken": 2}
    assert retried == plain == {}


def test_each_refusal_counts_once_under_its_reason_whoever_refused(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("one", 1)
    service.set_capacity("capped", 5, per_user=1)
    service.create_unpaid_order("u1", holds={"one": 1, "capped": 1})  # SQL decides; rebuilt

    with moves() as by_redis:
        how_redis = refused(service, "u2", {"one": 1})
    service.resource_index.forget("one")  # lost: SQL refuses
    with moves() as by_sql:
        how_sql = refused(service, "u2", {"one": 1})
    with moves() as capped:
        how_capped = refused(service, "u1", {"capped": 1})
    with moves() as unknown:
        how_unknown = refused(service, "u2", {"nowhere": 1})
    service.resource_index.forget("one")  # the SQL refusal rebuilt it: SQL decides again
    with moves() as cart:  # two resources short: one refusal, the first in id order
        refused(service, "u1", {"capped": 1, "one": 1})

    assert (how_redis, how_sql) == ("sold_out/redis", "sold_out/sql")
    assert (how_capped, how_unknown) == ("user_cap/sql", "unknown_resource/sql")
    assert by_redis == by_sql == {"holds:refused_sold_out": 1}
    assert capped == cart == {"holds:refused_user_cap": 1}
    assert unknown == {"holds:refused_unknown_resource": 1}


def test_payment_counts_sold_and_cancel_replace_and_sweep_count_released_per_resource(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=2)
    service.set_capacity("a", 10)
    service.set_capacity("b", 10)
    paid = service.create_unpaid_order("u1", holds={"a": 2, "b": 1})
    cancelled = service.create_unpaid_order("u2", holds={"a": 1, "b": 1})
    oldest = service.create_unpaid_order("u3", holds={"b": 1})
    service.create_unpaid_order("u3", ttl_s=60, holds={"a": 1})
    for user in ("u4", "u5"):
        service.create_unpaid_order(user, ttl_s=60, holds={"a": 1, "b": 1})

    with moves() as pay:
        service.mark_paid(paid.id, payment_ref="p1")
    with moves() as repeat:
        service.mark_paid(paid.id, payment_ref="p1")
    with moves() as cancel:
        service.cancel_order(cancelled.id)
    with moves() as replace:
        service.create_unpaid_order("u3", holds={"a": 1, "b": 2}, on_limit="replace_oldest")
    clock.advance(s=61)
    with moves() as sweep:
        assert service.sweep_expired().closed == 3

    assert pay == {"holds:sold": 2}
    assert repeat == {}
    assert cancel == {"holds:released": 2}
    assert service.get_order(oldest.id).status.value == "cancelled"
    assert replace == {"holds:released": 1, "holds:taken": 2}
    assert sweep == {"holds:released": 5}  # u3's one, u4's two, u5's two


def test_a_sweep_counts_what_it_released_in_sql_while_redis_is_down(
    make_service: Callable[..., OrderService],
    engine: Engine,
    clock: ManualClock,
    database_url: str,
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 10)
    for n in range(3):
        service.create_unpaid_order(f"u{n}", ttl_s=60, holds={"a": 1})
    nowhere = redis.Redis(
        unix_socket_path="/nonexistent/redis.sock", retry=Retry(NoBackoff(), retries=0)
    )
    down = OrderService(engine, nowhere, service.settings, clock=clock)
    clock.advance(s=61)

    try:
        with moves() as sweep:
            assert down.sweep_expired().closed == 3
    finally:
        nowhere.close()

    assert sweep == {"holds:released": 3}


def test_a_late_payment_that_takes_its_units_again_counts_them_sold(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=10, late_payment_window_s=LATE_WINDOW_S)
    service.set_capacity("a", 5)
    late = service.create_unpaid_order("u1", ttl_s=60, holds={"a": 2})
    clock.advance(s=61)
    service.sweep_expired()

    with moves() as paid:
        assert service.mark_paid(late.id, payment_ref="late-1").status.value == "paid"

    assert paid == {"holds:sold": 1}


def test_reconcile_counts_each_rebuilt_resource_by_kind_and_a_dry_run_nothing(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    for rid in ("r1", "r2", "r3"):
        service.set_capacity(rid, 5)
    service.create_unpaid_order("u1", holds={"r1": 1, "r2": 1, "r3": 1})
    service.resource_index.forget("r1")  # missing
    service.resource_index.rebuild("r2", 5, 0, [], service.clock())  # stale: its hold lost
    service.resource_index.rebuild("gone", 1, 0, [], service.clock())  # removed: not counted

    with moves() as dry:
        service.reconcile(dry_run=True)
    with moves() as done:
        service.reconcile()
    with moves() as again:
        service.reconcile()

    assert dry == {}
    assert done == {"drift:missing": 1, "drift:stale": 1}
    assert again == {}
