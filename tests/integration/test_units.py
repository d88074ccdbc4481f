"""Named units (issue 44), on both engines: a unit is held or sold by one order at most,
asked for by name or picked lowest first, sold by the payment, freed by a cancel or close in
the same transaction, taken again by a late payment only while nobody else took it; the
list of units changes without ever dropping a unit in use."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders import (
    HoldRefused,
    InvalidInput,
    OrderClosed,
    OrderService,
    OrderStatus,
)
from orders.domain import RefusalReason
from orders.sql.inventory_tables import units_table
from tests.support.clocks import ManualClock
from tests.support.stores import DriverStatements, flush_db

UNIT = units_table.c
#: Every test here also runs on orders.aio's service (tests/support/aio.py).
pytestmark = pytest.mark.both_apis
SEATS = [f"A-{n}" for n in range(1, 11)]


def unit_rows(engine: Engine, resource_id: str = "ev7") -> dict[str, tuple[str, str | None]]:
    """name -> (state, order id) as SQL has them."""
    query = select(UNIT.name, UNIT.state, UNIT.order_id).where(UNIT.resource_id == resource_id)
    with engine.connect() as conn:
        return {row.name: (row.state, row.order_id) for row in conn.execute(query)}


@pytest.fixture
def seats(make_service: Callable[..., OrderService]) -> OrderService:
    service = make_service(unpaid_limit=10)
    service.set_units("ev7", SEATS)
    return service


def test_units_asked_by_name_are_held_by_one_order_and_a_second_ask_is_refused_naming_them(
    seats: OrderService, engine: Engine
) -> None:
    resource = seats.resource("ev7")
    assert (resource.capacity, resource.named, resource.free) == (10, True, 10)

    first = seats.create_unpaid_order("u1", holds={"ev7": ["A-3", "A-2"]})
    with pytest.raises(HoldRefused) as refused:
        seats.create_unpaid_order("u2", holds={"ev7": ["A-4", "A-3"]})

    assert first.holds == {"ev7": ("A-2", "A-3")}
    assert seats.get_order(first.id).holds == {"ev7": ("A-2", "A-3")}
    assert (refused.value.reason, refused.value.units) == ("taken", ("A-3",))
    rows = unit_rows(engine)
    assert {name for name, (state, _) in rows.items() if state == "held"} == {"A-2", "A-3"}
    assert rows["A-4"] == ("free", None)  # the refused cart took nothing
    assert seats.resource("ev7").held == 2
    assert seats.units("ev7")["held"] == ["A-2", "A-3"]


def test_a_count_of_a_named_resource_picks_the_lowest_free_units_in_its_order(
    seats: OrderService,
) -> None:
    seats.create_unpaid_order("u1", holds={"ev7": ["A-1", "A-3"]})

    picked = seats.create_unpaid_order("u2", holds={"ev7": 3})

    assert picked.holds == {"ev7": ("A-2", "A-4", "A-5")}
    assert seats.get_order(picked.id).holds == picked.holds


def test_payment_sells_the_units_and_cancel_and_the_sweep_free_them_naming_them(
    seats: OrderService, engine: Engine, clock: ManualClock
) -> None:
    paid = seats.create_unpaid_order("u1", holds={"ev7": ["A-1"]})
    cancelled = seats.create_unpaid_order("u2", holds={"ev7": ["A-2"]})
    swept = seats.create_unpaid_order("u3", ttl_s=5, holds={"ev7": ["A-3"]})

    seats.mark_paid(paid.id)
    seats.cancel_order(cancelled.id)
    clock.advance(s=6)
    seats.sweep_expired()

    rows = unit_rows(engine)
    assert rows["A-1"] == ("sold", paid.id)
    assert rows["A-2"] == ("free", cancelled.id)  # its last holder stays named
    assert rows["A-3"] == ("free", swept.id)
    assert (seats.resource("ev7").held, seats.resource("ev7").sold) == (0, 1)
    again = seats.create_unpaid_order("u4", holds={"ev7": ["A-2", "A-3"]})
    assert again.holds == {"ev7": ("A-2", "A-3")}
    with pytest.raises(HoldRefused, match="A-1"):
        seats.create_unpaid_order("u5", holds={"ev7": ["A-1"]})


def test_a_cart_of_named_and_counted_units_is_taken_whole_or_not_at_all(
    seats: OrderService, engine: Engine
) -> None:
    seats.set_capacity("parking", 1)
    seats.create_unpaid_order("u1", holds={"parking": 1})

    with pytest.raises(HoldRefused) as refused:
        seats.create_unpaid_order("u2", holds={"ev7": ["A-5"], "parking": 1})

    assert refused.value.resource_id == "parking"
    assert unit_rows(engine)["A-5"] == ("free", None)
    assert seats.resource("ev7").held == 0


def test_units_can_be_added_reordered_and_removed_but_never_one_held_or_sold(
    seats: OrderService, engine: Engine
) -> None:
    order = seats.create_unpaid_order("u1", holds={"ev7": ["A-1"]})

    with pytest.raises(InvalidInput, match="A-1"):
        seats.set_units("ev7", SEATS[1:])
    assert unit_rows(engine)["A-1"] == ("held", order.id)

    changed = seats.set_units("ev7", ["B-1", "A-1", "A-2"])

    assert (changed.capacity, changed.held, changed.free) == (3, 1, 2)
    assert set(unit_rows(engine)) == {"B-1", "A-1", "A-2"}
    assert seats.create_unpaid_order("u2", holds={"ev7": 1}).holds == {"ev7": ("B-1",)}
    with pytest.raises(InvalidInput, match="named units"):
        seats.set_capacity("ev7", 50)


def test_a_late_payment_takes_its_units_again_only_while_nobody_else_took_them(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=10, late_payment_window_s=600)
    service.set_units("ev7", SEATS)
    lucky = service.create_unpaid_order("u1", ttl_s=60, holds={"ev7": ["A-1"]})
    unlucky = service.create_unpaid_order("u2", ttl_s=60, holds={"ev7": ["A-2"]})
    clock.advance(s=61)
    service.sweep_expired()
    service.create_unpaid_order("u3", holds={"ev7": ["A-2"]})  # free seats remain

    paid = service.mark_paid(lucky.id, payment_ref="late-1")
    with pytest.raises(OrderClosed):
        service.mark_paid(unlucky.id, payment_ref="late-2")

    assert paid.status is OrderStatus.PAID
    rows = unit_rows(engine)
    assert rows["A-1"] == ("sold", lucky.id)
    assert rows["A-2"][0] == "held"
    assert rows["A-2"][1] != unlucky.id
    owed = service.refused_payments(pending_only=True)
    assert [(r.order_id, r.reason) for r in owed] == [(unlucky.id, RefusalReason.UNITS_TAKEN)]


def test_a_retry_with_the_same_order_id_returns_the_same_units(seats: OrderService) -> None:
    first = seats.create_unpaid_order("u1", order_id="o-1", holds={"ev7": 2})

    again = seats.create_unpaid_order("u1", order_id="o-1", holds={"ev7": 2})

    assert again.holds == first.holds == {"ev7": ("A-1", "A-2")}
    assert seats.resource("ev7").held == 2


def test_a_per_user_cap_counts_named_units_too(seats: OrderService) -> None:
    seats.set_capacity("ev7", 10, per_user=2)
    seats.create_unpaid_order("u1", holds={"ev7": ["A-1", "A-2"]})

    with pytest.raises(HoldRefused) as refused:
        seats.create_unpaid_order("u1", holds={"ev7": ["A-3"]})

    assert refused.value.reason == "user_cap"


@pytest.mark.parametrize(
    ("units", "message"),
    [
        (["A-1", "A-1"], "twice"),
        ([""], "empty"),
        (["x" * 65], "at most 64"),
        (["A\x001"], "control"),
        ([], "1 to"),
        ([f"u{n}" for n in range(100_001)], "1 to 100000"),
        ("A-1", "list"),
    ],
)
def test_bad_unit_lists_are_refused_before_anything_is_written(
    seats: OrderService, engine: Engine, units: object, message: str
) -> None:
    with pytest.raises(InvalidInput, match=message):
        seats.set_units("ev7", units)  # type: ignore[arg-type]
    assert set(unit_rows(engine)) == set(SEATS)


@pytest.mark.parametrize(
    ("holds", "error", "message"),
    [
        ({"ev7": ["Z-9"]}, InvalidInput, "no unit 'Z-9'"),
        ({"ev7": ["A-1", "A-1"]}, InvalidInput, "twice"),
        ({"ev7": []}, InvalidInput, "1 to"),
        ({"plain": ["A-1"]}, InvalidInput, "no named units"),
    ],
)
def test_bad_named_holds_are_refused_and_write_nothing(
    seats: OrderService, engine: Engine, holds: object, error: type[Exception], message: str
) -> None:
    seats.set_capacity("plain", 5)
    with pytest.raises(error, match=message):
        seats.create_unpaid_order("u1", holds=holds)  # type: ignore[arg-type]
    assert all(state == "free" for state, _ in unit_rows(engine).values())
    assert seats.list_unpaid("u1") == []
    assert seats.resource("ev7").held == 0


def test_a_unit_taken_or_a_sold_out_resource_is_refused_by_redis_without_sql(
    seats: OrderService, engine: Engine
) -> None:
    first = seats.create_unpaid_order("u1", holds={"ev7": SEATS[:-1]})
    seats.mark_paid(first.id)
    seats.create_unpaid_order("u2", holds={"ev7": 1})  # picks the last, A-10
    with DriverStatements() as counter:  # SQLAlchemy's and the direct path's alike
        with pytest.raises(HoldRefused) as bought:
            seats.create_unpaid_order("u3", holds={"ev7": ["A-4"]})
        with pytest.raises(HoldRefused) as held:
            seats.create_unpaid_order("u3", holds={"ev7": ["A-10"]})
        with pytest.raises(HoldRefused) as sold_out:
            seats.create_unpaid_order("u3", holds={"ev7": 1})

    assert (bought.value.reason, bought.value.source, bought.value.units) == (
        "taken",
        "redis",
        ("A-4",),
    )
    assert (held.value.reason, held.value.source, held.value.units) == ("taken", "redis", ("A-10",))
    assert (sold_out.value.reason, sold_out.value.source) == ("sold_out", "redis")
    assert counter.statements == []


def test_a_unit_freed_by_a_cancel_or_lost_from_redis_is_not_refused_by_redis(
    seats: OrderService, engine: Engine, redis_client: Any
) -> None:
    order = seats.create_unpaid_order("u1", holds={"ev7": ["A-1"]})
    seats.cancel_order(order.id)
    assert seats.create_unpaid_order("u2", holds={"ev7": ["A-1"]}).holds == {"ev7": ("A-1",)}

    flush_db(redis_client)  # the index forgets who holds A-1: SQL still refuses it,
    with pytest.raises(HoldRefused) as refused:  # naming the one unit taken
        seats.create_unpaid_order("u3", holds={"ev7": ["A-2", "A-1"]})
    assert (refused.value.reason, refused.value.source) == ("taken", "sql")
    assert refused.value.units == ("A-1",)
    assert unit_rows(engine)["A-2"] == ("free", None)
    with pytest.raises(HoldRefused) as again:  # the resource was rebuilt from SQL meanwhile
        seats.create_unpaid_order("u3", holds={"ev7": ["A-2", "A-1"]})
    assert (again.value.reason, again.value.source, again.value.units) == (
        "taken",
        "redis",
        ("A-1",),
    )
    assert seats.reconcile().resources_stale == 0


def test_the_readmes_seat_map_example(make_service: Callable[..., OrderService]) -> None:
    service = make_service()
    service.set_units("ev7", ["A-1", "A-2"])
    order = service.create_unpaid_order("anna", holds={"ev7": ["A-2"]})
    assert service.create_unpaid_order("ben", holds={"ev7": 1}).holds == {"ev7": ("A-1",)}
    with pytest.raises(HoldRefused) as refused:
        service.create_unpaid_order("dora", holds={"ev7": ["A-2"]})
    assert (refused.value.reason, refused.value.units, refused.value.source) == (
        "taken",
        ("A-2",),
        "redis",
    )
    entry = service.wait_for("carl", "ev7", until=datetime(2030, 1, 5, tzinfo=UTC))

    service.cancel_order(order.id)

    served = service.get_order(f"waiting-{entry.id}")
    assert (served.user_id, served.holds) == ("carl", {"ev7": ("A-2",)})
