"""Counted resources (issue 43): set, changed, lowered below what is held and sold, shown,
listed a page at a time, the dashboard's running-out list; every bad input refused before a
statement reaches SQL; the module functions and orders.aio on the same rules. On both
engines. The holds themselves are written here as rows: the create does not take them yet."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, insert, select, update

import orders
import orders.aio
from orders import InvalidInput, OrderService, Resource, StoreUnavailable
from orders.domain import Actor, ActorKind
from orders.errors import UnknownResource
from orders.sql.inventory_tables import (
    HOLD_HELD,
    HOLD_RELEASED,
    HOLD_SOLD,
    holds_table,
    resources_table,
)
from orders.sql.resources import ResourceRecords
from tests.support.aio import run_checked
from tests.support.clocks import ManualClock
from tests.support.stores import DriverStatements

#: Every bad input of the issue, as (resource_id, capacity, per_user).
BAD_INPUTS = {
    "capacity-below-0": ("sku:1", -1, None),
    "capacity-not-a-whole-number": ("sku:1", 2.5, None),
    "capacity-a-bool": ("sku:1", True, None),
    "capacity-too-large": ("sku:1", 10**12 + 1, None),
    "per-user-0": ("sku:1", 5, 0),
    "per-user-above-capacity": ("sku:1", 5, 6),
    "id-empty": ("", 5, None),
    "id-blank": ("   ", 5, None),
    "id-too-long": ("s" * 129, 5, None),
    "id-with-nul": ("sku:\x001", 5, None),
    "id-with-newline": ("sku:\n1", 5, None),
    "id-with-hash-tag": ("sku:{1}", 5, None),
    "id-not-text": (None, 5, None),
}


def resource_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(resources_table))]


def hold(engine: Engine, order_id: str, resource_id: str, units: int, status: str) -> None:
    row = {
        "order_id": order_id,
        "resource_id": resource_id,
        "user_id": "u1",
        "quantity": units,
        "status": status,
    }
    with engine.begin() as conn:
        conn.execute(insert(holds_table).values(row))
        if status == "held":  # as a create's take() counts it
            counted = resources_table.c.held + units
            rid = resources_table.c.id == resource_id
            conn.execute(update(resources_table).where(rid).values(held=counted))


def actor_of(engine: Engine, resource_id: str) -> Actor | None:
    with engine.connect() as conn:
        row = conn.execute(select(resources_table).where(resources_table.c.id == resource_id)).one()
    return Actor.from_columns(row.updated_by_kind, row.updated_by)


def set_sold(engine: Engine, resource_id: str, sold: int) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(resources_table).where(resources_table.c.id == resource_id).values(sold=sold)
        )


def order_ids(service: OrderService, count: int) -> list[str]:
    """Orders for the holds rows to belong to (``oes_holds.order_id`` is a foreign key)."""
    return [service.create_unpaid_order(f"u{n}", ttl_s=600).id for n in range(count)]


def test_set_creates_a_resource_and_a_second_set_changes_it_naming_who_and_when(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    made = service.set_capacity("sku:42", 5, per_user=2, actor="ops-anna")

    assert made == Resource("sku:42", 5, 0, 0, per_user=2, updated_at_ms=clock())
    assert made.free == 5
    assert actor_of(engine, "sku:42") == Actor(ActorKind.APPLICATION, "ops-anna")
    set_sold(engine, "sku:42", 3)
    clock.advance(s=1)
    changed = service.set_capacity("sku:42", 8)

    assert changed == Resource("sku:42", 8, 0, 3, per_user=None, updated_at_ms=clock())
    assert changed.free == 5
    assert service.resource("sku:42") == changed
    with engine.connect() as conn:
        row = conn.execute(select(resources_table)).one()
    assert (row.capacity, row.per_user, row.sold, row.updated_at_ms) == (8, None, 3, clock())
    assert actor_of(engine, "sku:42") == Actor(ActorKind.APPLICATION)


def test_lowering_capacity_below_held_and_sold_is_allowed_and_takes_nothing_back(
    service: OrderService, engine: Engine
) -> None:
    service.set_capacity("sku:1", 10)
    first, second, third = order_ids(service, 3)
    hold(engine, first, "sku:1", 2, HOLD_HELD)
    hold(engine, second, "sku:1", 1, HOLD_HELD)
    hold(engine, third, "sku:1", 4, HOLD_RELEASED)  # free again: not held
    set_sold(engine, "sku:1", 2)
    with engine.connect() as conn:
        holds_before = conn.execute(select(holds_table).order_by(holds_table.c.order_id)).all()

    lowered = service.set_capacity("sku:1", 4)

    assert (lowered.capacity, lowered.held, lowered.sold, lowered.free) == (4, 3, 2, 0)
    assert service.resource("sku:1") == lowered
    with engine.connect() as conn:
        assert conn.execute(select(holds_table).order_by(holds_table.c.order_id)).all() == (
            holds_before
        )
    raised = service.set_capacity("sku:1", 6)
    assert (raised.held, raised.sold, raised.free) == (3, 2, 1)


def test_held_counts_only_held_rows_of_that_resource(service: OrderService, engine: Engine) -> None:
    service.set_capacity("sku:1", 10)
    service.set_capacity("sku:2", 10)
    first, second = order_ids(service, 2)
    hold(engine, first, "sku:1", 3, HOLD_HELD)
    hold(engine, first, "sku:2", 5, HOLD_HELD)
    hold(engine, second, "sku:1", 4, HOLD_SOLD)  # counted in the sold column, not here

    assert service.resource("sku:1").held == 3
    assert service.resource("sku:2").held == 5


def test_an_unknown_resource_raises_unknown_resource_naming_it(service: OrderService) -> None:
    service.set_capacity("sku:1", 1)

    with pytest.raises(UnknownResource) as missing:
        service.resource("sku:2")

    assert missing.value.resource_id == "sku:2"
    assert isinstance(missing.value, orders.OrdersError | LookupError)
    assert "sku:2" not in str(missing.value)  # no value echoed, as OrderNotFound


def test_resources_lists_by_id_a_page_at_a_time_with_what_is_held(
    service: OrderService, engine: Engine
) -> None:
    for name in ["coupon:SPRING", "sku:9", "sku:10", "slot:2027-01-05T10:00", "sku:1"]:
        service.set_capacity(name, 3)
    [order] = order_ids(service, 1)
    hold(engine, order, "sku:10", 2, HOLD_HELD)

    first = service.resources(limit=2)
    second = service.resources(after=first[-1].id, limit=2)
    third = service.resources(after=second[-1].id, limit=2)

    assert [r.id for r in first] == ["coupon:SPRING", "sku:1"]
    assert [r.id for r in second] == ["sku:10", "sku:9"]
    assert [r.id for r in third] == ["slot:2027-01-05T10:00"]
    assert service.resources(after=third[-1].id) == []
    assert second[0].held == 2
    assert [r.id for r in service.resources()] == sorted(r.id for r in first + second + third)


def test_running_out_lists_the_smallest_free_share_first_without_capacity_zero(
    service: OrderService, engine: Engine
) -> None:
    for name, capacity in [("a", 10), ("b", 4), ("c", 100), ("d", 0), ("e", 2), ("f", 1)]:
        service.set_capacity(name, capacity)
    [order] = order_ids(service, 1)
    hold(engine, order, "a", 9, HOLD_HELD)  # 1 of 10 free
    hold(engine, order, "b", 1, HOLD_HELD)  # 3 of 4 free
    set_sold(engine, "e", 2)  # sold out
    set_sold(engine, "f", 3)  # sold out, its capacity lowered below what was sold
    set_sold(engine, "c", 50)  # 50 of 100 free

    found = ResourceRecords(service.records.tx).running_out(limit=4)

    assert [(r.id, r.free) for r in found] == [("e", 0), ("f", 0), ("a", 1), ("c", 50)]


@pytest.mark.parametrize(
    ("resource_id", "capacity", "per_user"), BAD_INPUTS.values(), ids=BAD_INPUTS
)
def test_bad_input_is_invalid_input_before_any_statement_reaches_sql(
    service: OrderService,
    engine: Engine,
    sql_statements: DriverStatements,
    resource_id: Any,
    capacity: Any,
    per_user: Any,
) -> None:
    with pytest.raises(InvalidInput):
        service.set_capacity(resource_id, capacity, per_user=per_user)
    if resource_id != "sku:1":
        with pytest.raises(InvalidInput):
            service.resource(resource_id)
    if resource_id not in ("sku:1", None):  # None: from the first page
        with pytest.raises(InvalidInput):
            service.resources(after=resource_id)

    assert sql_statements.statements == []
    assert resource_rows(engine) == []


@pytest.mark.parametrize("limit", [0, -1, 10_001, 2.5, "3"])
def test_a_bad_page_size_is_invalid_input(service: OrderService, limit: Any) -> None:
    with pytest.raises(InvalidInput, match="limit"):
        service.resources(limit=limit)


def test_the_capacity_hook_gets_the_committed_resource_and_its_redis_failure_is_logged(
    service: OrderService, engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[Resource, int]] = []

    def copy(resource: Resource) -> None:
        seen.append((resource, len(resource_rows(engine))))  # committed: another connection

    service.capacities.after_capacity = copy
    made = service.set_capacity("sku:1", 3)
    with pytest.raises(InvalidInput):
        service.set_capacity("sku:1", -3)
    assert seen == [(made, 1)]

    def down(resource: Resource) -> None:
        raise StoreUnavailable("redis", "connection refused")

    service.capacities.after_capacity = down
    with caplog.at_level(logging.WARNING, logger="orders.service"):
        changed = service.set_capacity("sku:1", 4)
    assert changed.capacity == 4 == service.resource("sku:1").capacity
    assert "reconcile will fix it" in caplog.text


@pytest.fixture
def bound(service: OrderService) -> Iterator[OrderService]:
    orders.configure(service)
    try:
        yield service
    finally:
        orders.configure(None)


def test_the_module_functions_run_on_the_default_service(bound: OrderService) -> None:
    made = orders.set_capacity("sku:1", 3, per_user=1, actor="ops")

    assert (made.capacity, made.per_user) == (3, 1)

    assert orders.resource("sku:1") == made == bound.resource("sku:1")
    assert orders.resources(limit=1) == [made]
    with pytest.raises(UnknownResource):
        orders.resource("sku:2")


def test_orders_aio_runs_the_same_rules(
    database_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ORDERS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORDERS_DATABASE_URL", database_url)
    monkeypatch.setenv("ORDERS_REDIS_URL", redis_url)
    orders.aio.configure(None)

    async def main() -> tuple[Resource, Resource, list[Resource]]:
        try:
            made = await orders.aio.set_capacity("sku:1", 3, per_user=2)
            with pytest.raises(UnknownResource):
                await orders.aio.resource("sku:2")
            with pytest.raises(InvalidInput):
                await orders.aio.set_capacity("sku:1", 3, per_user=4)
            return made, await orders.aio.resource("sku:1"), await orders.aio.resources()
        finally:
            await (await orders.aio.default_service()).aclose()
            orders.aio.configure(None)

    made, shown, listed = run_checked(main())

    assert (made.capacity, made.per_user) == (3, 2)
    assert shown == made
    assert listed == [made]
