"""Processes SIGKILLed around holds (issue 43): a create with holds, the payment of an order
with holds, a sweep batch that closes such orders, each stopped for good at a named point
between its SQL commit and its Redis writes (``tests/support/workers/hold_crash.py``) and
killed there, on both engines, on one Redis server and on a cluster (where "seat" and "meal"
sit in two slots on two nodes: a cart is one reserve per node).

After each kill, in SQL (``tests/support/hold_checks.py``): no resource oversold, every
hold's status follows its order's, each resource's ``sold`` is the sum of its sold holds.
In Redis: never a wrong "sold out" where it matters, and after one ``reconcile()`` the index
equals SQL (capacity, sold, held, members). A crashed create's units are free for another
buyer, after reconcile at the latest. Every process a test starts, it ends by its PID.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from orders import HoldRefused, OrderService
from orders.config import Settings
from orders.sql.inventory_tables import holds_table
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.hold_checks import index_problems, index_state, sql_problems, sql_state
from tests.support.processes import WorkerCrash

pytestmark = pytest.mark.cluster_too

MARKER_TIMEOUT_S = 60
RESOURCES = ["meal", "seat"]


@pytest.fixture
def crash(database_url: str, redis_options: dict[str, Any], tmp_path: Path) -> WorkerCrash:
    return WorkerCrash(
        "tests.support.workers.hold_crash", database_url, redis_options, tmp_path, MARKER_TIMEOUT_S
    )


@pytest.fixture
def service(engine: Engine, redis_client: redis.Redis, database_url: str) -> OrderService:
    """The service after the crash (the worker's clock starts where this one is)."""
    settings = Settings(database_url=database_url, unpaid_limit=10)
    return OrderService(engine, redis_client, settings, clock=ManualClock())


def holds_of(engine: Engine, order_id: str) -> dict[str, tuple[int, str]]:
    query = select(holds_table.c.resource_id, holds_table.c.quantity, holds_table.c.status)
    with engine.connect() as conn:
        rows = conn.execute(query.where(holds_table.c.order_id == order_id))
        return {resource_id: (units, status) for resource_id, units, status in rows}


def order_status(engine: Engine, order_id: str) -> str | None:
    query = select(orders_table.c.status).where(orders_table.c.id == order_id)
    with engine.connect() as conn:
        return conn.scalar(query)


def refusal(service: OrderService, user_id: str, holds: dict[str, int]) -> HoldRefused:
    with pytest.raises(HoldRefused) as caught:
        service.create_unpaid_order(user_id, holds=holds)
    return caught.value


def free_in_sql(engine: Engine, resource_id: str, now_ms: int) -> int:
    """Capacity less sold less every held hold (an expired, unswept order still holds)."""
    cap, sold, _, _ = sql_state(engine, resource_id, now_ms)
    with engine.connect() as conn:
        held = conn.execute(
            select(holds_table.c.quantity).where(
                holds_table.c.resource_id == resource_id, holds_table.c.status == "held"
            )
        ).scalars()
        return cap - sold - sum(int(units) for units in held)


def reconciled(service: OrderService, engine: Engine) -> None:
    """SQL keeps its rules; one reconcile makes the index equal SQL."""
    assert sql_problems(engine) == []
    service.reconcile()
    assert index_problems(service.resource_index, engine, RESOURCES, service.clock()) == []


def two_resources_indexed(service: OrderService, engine: Engine) -> None:
    """seat (3) and meal (2), one of each held by "b1", both known to the index."""
    service.set_capacity("seat", 3)
    service.set_capacity("meal", 2)
    service.create_unpaid_order("b1", ttl_s=600, holds={"seat": 1, "meal": 1})  # SQL decides
    assert index_problems(service.resource_index, engine, RESOURCES, service.clock()) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["create-reserved", "create-uncommitted"])
def test_a_create_killed_after_its_redis_reservation_sells_nothing_and_frees_its_units(
    service: OrderService, engine: Engine, crash: WorkerCrash, mode: str
) -> None:
    two_resources_indexed(service, engine)
    cart = {"seat": 2, "meal": 1}  # the last units of both

    crash.kill_at(
        mode, now_ms=service.clock(), user_id="crasher", order_id="crashed-1", holds=cart, ttl_s=600
    )

    # SQL never committed it (the server rolls back the dead connection's transaction).
    assert order_status(engine, "crashed-1") is None
    assert holds_of(engine, "crashed-1") == {}
    assert sql_problems(engine) == []
    # Redis reserved for it: the index is too pessimistic until reconcile or its expiry.
    seat = index_state(service.resource_index, "seat", service.clock())
    assert seat is not None
    assert "crashed-1" in seat[3]
    assert refusal(service, "b2", cart).source == "redis"

    reconciled(service, engine)
    taken = service.create_unpaid_order("b2", holds=cart)  # its units are free again
    assert taken.holds == cart
    assert refusal(service, "b3", {"seat": 1}).source == "redis"
    assert sql_problems(engine) == []
    assert index_problems(service.resource_index, engine, RESOURCES, service.clock()) == []


@pytest.mark.timeout(120)
def test_a_create_killed_after_its_commit_before_redis_rebuilt_a_lost_resource_never_oversells(
    service: OrderService, engine: Engine, crash: WorkerCrash
) -> None:
    two_resources_indexed(service, engine)
    service.resource_index.forget("meal")  # lost: the create's SQL decides for it

    crash.kill_at(
        "create-committed",
        now_ms=service.clock(),
        user_id="crasher",
        order_id="crashed-1",
        holds={"seat": 2, "meal": 1},
        ttl_s=600,
    )

    assert order_status(engine, "crashed-1") == "unpaid"
    assert holds_of(engine, "crashed-1") == {"meal": (1, "held"), "seat": (2, "held")}
    assert sql_problems(engine) == []
    assert index_state(service.resource_index, "meal", service.clock()) is None  # not rebuilt
    # Meal's last unit is the crashed order's: SQL refuses it though Redis lost the count.
    refused = refusal(service, "b2", {"meal": 1})
    assert (refused.source, refused.reason, refused.free) == ("sql", "sold_out", 0)
    assert refusal(service, "b2", {"seat": 1}).source == "redis"

    reconciled(service, engine)
    service.mark_paid("crashed-1")  # the crashed order is a real one: it sells
    assert sql_problems(engine) == []
    assert index_problems(service.resource_index, engine, RESOURCES, service.clock()) == []


@pytest.mark.timeout(120)
def test_a_payment_killed_between_its_commit_and_the_redis_sale_keeps_both_stores_right(
    service: OrderService, engine: Engine, crash: WorkerCrash
) -> None:
    clock = service.clock
    assert isinstance(clock, ManualClock)
    two_resources_indexed(service, engine)
    order = service.create_unpaid_order("buyer", ttl_s=60, holds={"seat": 1, "meal": 1})

    crash.kill_at("pay-committed", now_ms=service.clock(), order_id=order.id)

    assert order_status(engine, order.id) == "paid"
    assert holds_of(engine, order.id) == {"meal": (1, "sold"), "seat": (1, "sold")}
    assert sql_problems(engine) == []
    # Redis still counts the units held rather than sold: the same units taken, so the
    # index answers as SQL would.
    now_ms = service.clock()
    seat = service.resource_index.snapshot("seat", now_ms)
    assert seat is not None
    assert order.id in seat.members
    assert seat.sold == 0
    assert seat.free == free_in_sql(engine, "seat", now_ms) == 1
    assert refusal(service, "b2", {"meal": 1}).source == "redis"
    # Past the order's expiry its member no longer counts: too optimistic, and SQL refuses.
    clock.advance(s=61)
    assert refusal(service, "b2", {"meal": 1}).source == "sql"

    reconciled(service, engine)
    assert refusal(service, "b2", {"meal": 1}).source == "redis"
    service.create_unpaid_order("b2", holds={"seat": 1})  # 3 seats: 1 sold, 1 held, 1 free
    assert refusal(service, "b3", {"seat": 1}).source == "redis"
    assert sql_problems(engine) == []
    assert index_problems(service.resource_index, engine, RESOURCES, service.clock()) == []


@pytest.mark.timeout(120)
def test_a_sweep_killed_between_its_commit_and_the_redis_release_frees_the_units_at_once(
    service: OrderService, engine: Engine, crash: WorkerCrash
) -> None:
    clock = service.clock
    assert isinstance(clock, ManualClock)
    service.set_capacity("seat", 4)
    service.set_capacity("meal", 2)
    due = [
        service.create_unpaid_order("u1", ttl_s=60, holds={"seat": 2, "meal": 1}),
        service.create_unpaid_order("u2", ttl_s=60, holds={"seat": 1}),
    ]
    kept = service.create_unpaid_order("u3", ttl_s=600, holds={"meal": 1})
    paid = service.create_unpaid_order("u4", ttl_s=60, holds={"seat": 1})
    service.mark_paid(paid.id)
    assert index_problems(service.resource_index, engine, RESOURCES, clock()) == []
    clock.advance(s=61)

    crash.kill_at("sweep-committed", now_ms=clock())

    for order in due:
        assert order_status(engine, order.id) == "closed"
        assert {s for _, s in holds_of(engine, order.id).values()} == {"released"}
        with engine.connect() as conn:
            data = conn.scalar(
                select(events_table.c.data).where(
                    events_table.c.order_id == order.id, events_table.c.kind == "closed"
                )
            )
        assert data == {"released": dict(order.holds)}
    assert order_status(engine, kept.id) == "unpaid"
    assert sql_problems(engine) == []
    # The members of the closed orders expired by their score: the index is right already.
    assert index_problems(service.resource_index, engine, RESOURCES, clock()) == []
    service.create_unpaid_order("b1", holds={"seat": 3, "meal": 1})  # every unit freed
    assert refusal(service, "b2", {"seat": 1}).source == "redis"

    reconciled(service, engine)
