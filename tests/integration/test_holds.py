"""Holds on counted resources (issue 43), as SQL keeps them on both engines: taken with the
order or not at all, sold by its payment, released by its cancel or close in the same
transaction, the close event naming the units; a per-user cap across unpaid and paid
orders; a late payment takes its units again only if they are free."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, insert, select, text

from orders import (
    HoldRefused,
    InvalidInput,
    OrderClosed,
    OrderConflict,
    OrderService,
    OrderStatus,
)
from orders.domain import RefusalReason
from orders.sql.inventory_tables import holds_table, resources_table
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock

HOLD = holds_table.c


def add_resource(
    engine: Engine, resource_id: str, capacity: int, per_user: int | None = None
) -> None:
    with engine.begin() as conn:
        conn.execute(
            insert(resources_table).values(
                id=resource_id, capacity=capacity, per_user=per_user, sold=0, updated_at_ms=0
            )
        )


def holds_in_sql(
    engine: Engine, order_id: str | None = None
) -> dict[tuple[str, str], tuple[int, str]]:
    query = select(HOLD.order_id, HOLD.resource_id, HOLD.quantity, HOLD.status)
    if order_id is not None:
        query = query.where(HOLD.order_id == order_id)
    with engine.connect() as conn:
        return {(r.order_id, r.resource_id): (r.quantity, r.status) for r in conn.execute(query)}


def counts(engine: Engine, resource_id: str) -> tuple[int, int]:
    """(held, sold) of a resource, read from SQL."""
    with engine.connect() as conn:
        held = conn.scalar(
            select(func.coalesce(func.sum(HOLD.quantity), 0)).where(
                HOLD.resource_id == resource_id, HOLD.status == "held"
            )
        )
        sold = conn.scalar(
            select(resources_table.c.sold).where(resources_table.c.id == resource_id)
        )
    return int(held or 0), int(sold or 0)


def last_event(engine: Engine, order_id: str) -> tuple[str, Any]:
    query = (
        select(events_table.c.kind, events_table.c.data)
        .where(events_table.c.order_id == order_id)
        .order_by(events_table.c.id.desc())
        .limit(1)
    )
    with engine.connect() as conn:
        kind, data = conn.execute(query).one()
    return kind, data


def refused(service: OrderService, user_id: str, holds: dict[str, int]) -> HoldRefused:
    with pytest.raises(HoldRefused) as caught:
        service.create_unpaid_order(user_id, holds=holds)
    return caught.value


def test_holds_are_taken_up_to_the_capacity_and_the_next_is_refused_with_nothing_written(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("sku:42", 3)
    first = service.create_unpaid_order("u1", holds={"sku:42": 2})
    assert first.holds == {"sku:42": 2}
    service.create_unpaid_order("u2", holds={"sku:42": 1})

    refusal = refused(service, "u3", {"sku:42": 1})

    assert (refusal.resource_id, refusal.reason, refusal.free) == ("sku:42", "sold_out", 0)
    assert counts(engine, "sku:42") == (3, 0)
    assert service.list_unpaid("u3") == []
    assert service.index.members("u3") == {}


def test_a_cart_is_taken_whole_or_not_at_all(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 5)
    service.set_capacity("b", 1)
    service.create_unpaid_order("u1", holds={"b": 1})

    refusal = refused(service, "u2", {"a": 2, "b": 1})

    assert (refusal.resource_id, refusal.reason, refusal.requested) == ("b", "sold_out", 1)
    assert counts(engine, "a") == (0, 0)
    unknown = refused(service, "u2", {"a": 1, "nope": 1})
    assert (unknown.resource_id, unknown.reason, unknown.free) == ("nope", "unknown_resource", None)
    assert counts(engine, "a") == (0, 0)
    assert len(holds_in_sql(engine)) == 1


def test_payment_sells_the_units_and_a_cancel_releases_them_naming_them_in_its_event(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 4)
    service.set_capacity("b", 4)
    paid = service.create_unpaid_order("u1", holds={"a": 1, "b": 2})
    cancelled = service.create_unpaid_order("u1", holds={"a": 3})

    service.mark_paid(paid.id, payment_ref="p1")
    service.cancel_order(cancelled.id)

    assert holds_in_sql(engine, paid.id) == {
        (paid.id, "a"): (1, "sold"),
        (paid.id, "b"): (2, "sold"),
    }
    assert holds_in_sql(engine, cancelled.id) == {(cancelled.id, "a"): (3, "released")}
    assert counts(engine, "a") == (0, 1)
    assert counts(engine, "b") == (0, 2)
    kind, data = last_event(engine, cancelled.id)
    assert kind == "cancelled"
    assert data["released"] == {"a": 3}
    # The released units are free again: 3 of a's 4 (1 sold).
    service.create_unpaid_order("u2", holds={"a": 3})
    assert refused(service, "u3", {"a": 1}).free == 0


def test_the_sweep_releases_the_units_of_the_orders_it_closes_in_the_same_batch(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("seat-pool", 2)
    held = [
        service.create_unpaid_order(f"u{i}", ttl_s=60, holds={"seat-pool": 1}) for i in range(2)
    ]
    plain = service.create_unpaid_order("u9", ttl_s=60)
    clock.advance(s=61)

    result = service.sweep_expired()

    assert result.closed == 3
    for order in held:
        assert holds_in_sql(engine, order.id) == {(order.id, "seat-pool"): (1, "released")}
        assert last_event(engine, order.id) == ("closed", {"released": {"seat-pool": 1}})
    assert last_event(engine, plain.id)[1] is None
    assert counts(engine, "seat-pool") == (0, 0)
    service.create_unpaid_order("u5", holds={"seat-pool": 2})


def test_a_per_user_cap_counts_unpaid_and_paid_orders_of_the_user(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("coupon:SPRING", 100, per_user=2)
    first = service.create_unpaid_order("u1", holds={"coupon:SPRING": 1})
    service.mark_paid(first.id)
    service.create_unpaid_order("u1", holds={"coupon:SPRING": 1})

    refusal = refused(service, "u1", {"coupon:SPRING": 1})

    assert (refusal.reason, refusal.free) == ("user_cap", 0)
    service.create_unpaid_order("u2", holds={"coupon:SPRING": 2})  # another user's own cap


def test_a_retry_with_the_same_order_id_returns_the_same_holds_and_takes_nothing_more(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 5)
    first = service.create_unpaid_order("u1", order_id="o-1", holds={"a": 2})
    again = service.create_unpaid_order("u1", order_id="o-1", holds={"a": 2})

    assert again.id == first.id
    assert again.holds == {"a": 2}
    assert counts(engine, "a") == (2, 0)
    with pytest.raises(OrderConflict):
        service.create_unpaid_order("u1", order_id="o-1", holds={"a": 3})


@pytest.mark.parametrize(
    "holds",
    [
        {"a": 0},
        {"a": -1},
        {"a": 1.5},
        {"a": 10**6 + 1},
        {"": 1},
        {"x" * 129: 1},
        {"a\x00": 1},
        {f"r{i}": 1 for i in range(101)},
        {"a": True},
        ["a"],
    ],
)
def test_bad_holds_are_refused_before_anything_is_written(
    service: OrderService, engine: Engine, holds: Any
) -> None:
    service.set_capacity("a", 5)
    with pytest.raises(InvalidInput):
        service.create_unpaid_order("u1", holds=holds)
    assert service.list_unpaid("u1") == []
    assert holds_in_sql(engine) == {}


WINDOW_S = 600


def test_a_late_payment_takes_its_units_again_only_while_they_are_free(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=10, late_payment_window_s=WINDOW_S)
    service.set_capacity("a", 2)
    lucky = service.create_unpaid_order("u1", ttl_s=60, holds={"a": 1})
    unlucky = service.create_unpaid_order("u2", ttl_s=60, holds={"a": 1})
    clock.advance(s=61)
    service.sweep_expired()
    service.create_unpaid_order("u3", holds={"a": 1})  # one of the two freed units

    paid = service.mark_paid(lucky.id, payment_ref="late-1")
    with pytest.raises(OrderClosed):
        service.mark_paid(unlucky.id, payment_ref="late-2")

    assert paid.status is OrderStatus.PAID
    assert holds_in_sql(engine, lucky.id) == {(lucky.id, "a"): (1, "sold")}
    assert holds_in_sql(engine, unlucky.id) == {(unlucky.id, "a"): (1, "released")}
    assert counts(engine, "a") == (1, 1)
    owed = service.refused_payments(pending_only=True)
    assert [(r.order_id, r.reason) for r in owed] == [(unlucky.id, RefusalReason.UNITS_TAKEN)]


def test_erasure_and_replace_the_oldest_release_what_the_cancelled_orders_held(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(unpaid_limit=1, erasure_key="k" * 32)
    service.set_capacity("a", 3)
    oldest = service.create_unpaid_order("u1", holds={"a": 2})

    newer = service.create_unpaid_order("u1", holds={"a": 1}, on_limit="replace_oldest")

    assert holds_in_sql(engine, oldest.id) == {(oldest.id, "a"): (2, "released")}
    assert counts(engine, "a") == (1, 0)
    service.erase_user("u1")
    assert counts(engine, "a") == (0, 0)
    with engine.connect() as conn:
        users = set(conn.scalars(select(HOLD.user_id)))
    assert "u1" not in users
    assert len(users) == 1
    assert holds_in_sql(engine, newer.id) == {(newer.id, "a"): (1, "released")}


def test_a_create_closing_due_holders_never_deadlocks_with_the_sweep_claiming_one_of_them(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    """A create at the limit closes its user's due orders (slot reuse) while the sweep has
    claimed one of them (its row locked) and then waits for their resource's row. Closed one
    at a time, the create held the resource's lock from the first close while it waited for
    the claimed order: PostgreSQL found a deadlock and failed one of the two."""
    if engine.dialect.name != "postgresql":
        pytest.skip("row locks: SQLite's write transaction holds the whole file")
    service = make_service(unpaid_limit=2)
    service.set_capacity("r1", 5)
    first, second = (service.create_unpaid_order("u1", ttl_s=5, holds={"r1": 1}) for _ in "ab")
    clock.advance(s=5)
    sweep = engine.connect()  # plays the sweep: it claimed the second due order
    sweep.exec_driver_sql("SET lock_timeout = '20s'")
    sweep.execute(select(orders_table.c.id).where(orders_table.c.id == second.id).with_for_update())
    outcome: dict[str, Any] = {}

    def create() -> None:
        try:
            outcome["order"] = service.create_unpaid_order("u1", holds={"r1": 1})
        except Exception as exc:  # reported by the assertion below
            outcome["error"] = exc

    creating = threading.Thread(target=create)
    creating.start()
    try:
        wait_for_a_lock_wait(engine, deadline_s=20)
        # The create waits for the claimed order; the sweep's next lock must not wait on it.
        sweep.execute(
            select(resources_table.c.id).where(resources_table.c.id == "r1").with_for_update()
        )
        sweep.rollback()
    finally:
        sweep.close()
        creating.join(30)
    assert "error" not in outcome, outcome
    assert holds_in_sql(engine, first.id) == {(first.id, "r1"): (1, "released")}
    assert holds_in_sql(engine, second.id) == {(second.id, "r1"): (1, "released")}
    assert counts(engine, "r1") == (1, 0)
    assert service.resource("r1").held == 1


def wait_for_a_lock_wait(engine: Engine, deadline_s: float) -> None:
    """Until another backend of this database waits for a row lock (the create)."""
    waiting = text(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
    )
    ends = time.monotonic() + deadline_s
    with engine.connect() as conn:
        while conn.scalar(waiting) == 0:
            assert time.monotonic() < ends, "the create never waited for the claimed order"
            conn.rollback()
            time.sleep(0.01)
