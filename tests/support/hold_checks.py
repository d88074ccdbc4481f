"""What the tests of holds (issue 43) check in both stores, read straight from the tables
(never through the code under test's own reads, which a bug would share).

* :func:`sql_problems`: in SQL, no resource oversold (held + sold <= capacity), every
  hold's status follows its order's (unpaid: held; paid: sold; cancelled or closed:
  released), and each resource's ``held`` and ``sold`` are the sums of its held and sold
  holds (nothing sold twice, nothing released twice, no counter drifted from its rows).
* :func:`index_problems`: the Redis index of each resource equal to SQL at ``now_ms``:
  capacity, sold, and the live held members with their units and expiry.
"""

from __future__ import annotations

from collections import defaultdict

from sqlalchemy import Engine, select

from orders.index.resources import ResourceIndex
from orders.sql.models import holds_table, orders_table, resources_table

HOLD = holds_table.c
ORDER = orders_table.c
RESOURCE = resources_table.c

#: The status of a hold, by the status of its order.
FOLLOWS = {"unpaid": "held", "paid": "sold", "cancelled": "released", "closed": "released"}

#: What the index must hold of a resource: (cap, sold, held, {order id: (units, expiry)}).
IndexState = tuple[int, int, int, dict[str, tuple[int, int]]]


def sql_problems(engine: Engine) -> list[str]:
    """Every breach of the SQL rules of holds (module docstring); [] when none."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(HOLD.order_id, HOLD.resource_id, HOLD.quantity, HOLD.status, ORDER.status).join(
                orders_table, ORDER.id == HOLD.order_id
            )
        ).all()
        resources = conn.execute(
            select(RESOURCE.id, RESOURCE.capacity, RESOURCE.held, RESOURCE.sold)
        ).all()
    problems: list[str] = []
    taken: defaultdict[str, int] = defaultdict(int)
    sold: defaultdict[str, int] = defaultdict(int)
    held: defaultdict[str, int] = defaultdict(int)
    for order_id, resource_id, units, status, order_status in rows:
        if FOLLOWS[order_status] != status:
            problems.append(f"{order_id} is {order_status} but its {resource_id} is {status}")
        if status in ("held", "sold"):
            taken[resource_id] += units
        if status == "sold":
            sold[resource_id] += units
        if status == "held":
            held[resource_id] += units
    for resource_id, capacity, held_count, sold_count in resources:
        if taken[resource_id] > capacity:
            problems.append(f"{resource_id} oversold: {taken[resource_id]} of {capacity}")
        if sold_count != sold[resource_id]:
            problems.append(f"{resource_id} sold {sold_count}, sold holds {sold[resource_id]}")
        if held_count != held[resource_id]:
            problems.append(f"{resource_id} held {held_count}, held holds {held[resource_id]}")
    return problems


def sql_state(engine: Engine, resource_id: str, now_ms: int) -> IndexState:
    """What the index must hold of ``resource_id`` at ``now_ms``, read from SQL: the held
    holds of unpaid orders whose expiry is ahead are its members."""
    with engine.connect() as conn:
        capacity, sold = conn.execute(
            select(RESOURCE.capacity, RESOURCE.sold).where(RESOURCE.id == resource_id)
        ).one()
        held = conn.execute(
            select(HOLD.order_id, HOLD.quantity, ORDER.expires_at_ms)
            .join(orders_table, ORDER.id == HOLD.order_id)
            .where(
                HOLD.resource_id == resource_id,
                HOLD.status == "held",
                ORDER.status == "unpaid",
                ORDER.expires_at_ms > now_ms,
            )
        ).all()
    members = {order_id: (int(units), int(expiry)) for order_id, units, expiry in held}
    return int(capacity), int(sold), sum(u for u, _ in members.values()), members


def index_state(index: ResourceIndex, resource_id: str, now_ms: int) -> IndexState | None:
    """The resource as the Redis index counts it at ``now_ms`` (None: unknown)."""
    snap = index.snapshot(resource_id, now_ms)
    return None if snap is None else (snap.cap, snap.sold, snap.held, snap.members)


def index_problems(
    index: ResourceIndex, engine: Engine, resource_ids: list[str], now_ms: int
) -> list[str]:
    """Each resource whose index differs from SQL at ``now_ms``; [] when all agree."""
    problems = []
    for resource_id in resource_ids:
        want, got = sql_state(engine, resource_id, now_ms), index_state(index, resource_id, now_ms)
        if got != want:
            problems.append(f"{resource_id}: redis {got}, sql {want}")
    return problems
