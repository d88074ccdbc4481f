"""The SQL record of holds: what each order holds of each counted resource, and the one
guard that makes an oversell impossible whatever Redis lost.

A create with holds (``NewOrder.holds``) takes them in its own transaction, after its
order's insert, with :meth:`HoldLedger.take`:

1. it locks the cart's ``oes_resources`` rows in id order (PostgreSQL: ``FOR UPDATE``;
   SQLite's write transaction holds the whole database already), so two creates of one
   resource take turns and two carts never wait on each other in a circle;
2. then, in a statement of its own (at READ COMMITTED each statement reads a snapshot taken
   when it starts: one taken before the lock was granted would miss the holds of the create
   that had it), it sums the units held now (``held`` rows, through a partial index) and,
   for a resource with ``per_user``, what the user holds and bought of it;
3. it refuses the whole cart (:class:`~orders.errors.HoldRefused`, the first resource short
   in id order) or inserts one ``held`` row per resource. The caller rolls back on refusal:
   neither the order nor any hold is written.

Every later change of a hold rides on its order's compare-and-set (:func:`hold_changes`),
in the same statement on PostgreSQL: paid -> ``sold``; cancelled or closed -> ``released``;
the resources' ``held`` and ``sold`` move with them, their rows locked in id order like a
create's. One transaction moves holds in one statement at most (the slot reuse of a create
closes all its due orders in one, ``CLOSE_ALL_EXPIRED``): two statements would lock two
sorted sets one after the other, which is no order at all, and a sweep or a payment could
wait on them in a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    String,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB

from orders.domain import NewOrder
from orders.errors import HoldRefused, InvalidInput
from orders.inventory import HoldReason
from orders.sql.inventory_tables import (
    HOLD_HELD,
    HOLD_RELEASED,
    HOLD_SOLD,
    holds_table,
    resources_table,
)
from orders.sql.units import move_units, take_units, unit_changes, units_free_again

HOLD = holds_table.c
RESOURCE = resources_table.c

_IDS = bindparam("ids", expanding=True, type_=String)
_LOCK = select(
    RESOURCE.id,
    RESOURCE.capacity,
    RESOURCE.held,
    RESOURCE.sold,
    RESOURCE.per_user,
    RESOURCE.named,
).where(RESOURCE.id.in_(_IDS))
_LOCK_FOR_UPDATE = _LOCK.order_by(RESOURCE.id).with_for_update()
_LOCK_PLAIN = _LOCK.order_by(RESOURCE.id)
_TAKEN_BY_USER = (
    select(HOLD.resource_id, func.sum(HOLD.quantity))
    .where(
        HOLD.resource_id.in_(_IDS),
        HOLD.user_id == bindparam("user_id", type_=String),
        HOLD.status.in_([HOLD_HELD, HOLD_SOLD]),
    )
    .group_by(HOLD.resource_id)
)
_INSERT = insert(holds_table)
_ADD_HELD = (
    update(resources_table)
    .where(RESOURCE.id == bindparam("rid", type_=String))
    .values(held=RESOURCE.held + bindparam("units", type_=BigInteger))
)


def take(conn: Connection, new: NewOrder) -> dict[str, tuple[str, ...]]:
    """Take every hold of ``new`` in ``conn``'s transaction, or raise HoldRefused and write
    nothing (the caller rolls the transaction back; see the module docstring). Returns the
    named units held, per named resource (:mod:`orders.sql.units`)."""
    named = check(conn, new.user_id, new.holds, dict(new.names))
    conn.execute(
        _INSERT,
        [
            {
                "order_id": new.id,
                "resource_id": resource_id,
                "user_id": new.user_id,
                "quantity": units,
                "status": HOLD_HELD,
            }
            for resource_id, units in new.holds
        ],
    )
    conn.execute(_ADD_HELD, [{"rid": rid, "units": units} for rid, units in new.holds])
    if not named:
        return {}
    return take_units(conn, new.id, [h for h in new.holds if h[0] in named], dict(new.names))


def check_retake(conn: Connection, user_id: str, order_id: str) -> None:
    """Before a late payment turns the closed ``order_id`` paid, in its transaction: raise
    HoldRefused unless every unit it released is free again (its resources stay locked
    until the payment commits; a named unit must be free and not held by anyone since)."""
    released = [
        (rid, units)
        for rid, (units, status) in holds_of(conn, order_id).items()
        if status == HOLD_RELEASED
    ]
    if not released:
        return
    named = check(conn, user_id, tuple(sorted(released)), {})
    for rid, units in released:
        if rid in named and units_free_again(conn, order_id, rid) < units:
            raise HoldRefused(rid, HoldReason.TAKEN, units, None)


def check(
    conn: Connection,
    user_id: str,
    holds: tuple[tuple[str, int], ...],
    names: dict[str, tuple[str, ...]],
) -> set[str]:
    """Lock the resources of ``holds`` (id order) and raise HoldRefused unless all fit
    (InvalidInput: units asked for by name of a resource that has none). Returns the
    named resources among them."""
    wanted = dict(holds)
    ids = list(wanted)
    lock = _LOCK_FOR_UPDATE if conn.dialect.name == "postgresql" else _LOCK_PLAIN
    rows = {row.id: row for row in conn.execute(lock, {"ids": ids})}
    for resource_id in ids:
        if resource_id not in rows:
            raise HoldRefused(resource_id, HoldReason.UNKNOWN_RESOURCE, wanted[resource_id], None)
    for resource_id in names:
        if not rows[resource_id].named:
            raise InvalidInput("holds", f"{resource_id} has no named units")
    capped = [rid for rid in ids if rows[rid].per_user is not None]
    taken = _sums(conn, _TAKEN_BY_USER, {"ids": capped, "user_id": user_id}) if capped else {}
    for resource_id, units in holds:
        row = rows[resource_id]
        free = row.capacity - row.sold - row.held
        if units > free:
            raise HoldRefused(resource_id, HoldReason.SOLD_OUT, units, free)
        if row.per_user is not None:
            left = row.per_user - taken.get(resource_id, 0)
            if units > left:
                raise HoldRefused(resource_id, HoldReason.USER_CAP, units, min(left, free))
    return {rid for rid, row in rows.items() if row.named}


def _sums(conn: Connection, query: Any, params: Mapping[str, Any]) -> dict[str, int]:
    return {rid: int(total) for rid, total in conn.execute(query, params)}


def holds_of(conn: Connection, order_id: str) -> dict[str, tuple[int, str]]:
    """An order's holds: resource id -> (units, status)."""
    query = select(HOLD.resource_id, HOLD.quantity, HOLD.status).where(HOLD.order_id == order_id)
    return {row.resource_id: (row.quantity, row.status) for row in conn.execute(query)}


#: The statuses a hold moves between, by the order transition that moves it.
RELEASE = (HOLD_HELD, HOLD_RELEASED)
SELL = (HOLD_HELD, HOLD_SOLD)
#: A late payment takes its released units again (once it found them free).
RETAKE = (HOLD_RELEASED, HOLD_SOLD)


def _counts(source: str, target: str, units: Any) -> dict[str, Any]:
    """What moving ``units`` from ``source`` to ``target`` does to a resource's counters."""
    values: dict[str, Any] = {}
    if source == HOLD_HELD:
        values["held"] = RESOURCE.held - units
    if target == HOLD_SOLD:
        values["sold"] = RESOURCE.sold + units
    return values


def hold_changes(statement: Any, changed: Any, change: tuple[str, str]) -> Any:
    """PostgreSQL: ``statement`` (a SELECT over the CTE ``changed``, the order rows a
    transition returned) with the holds of those orders moved from ``change[0]`` to
    ``change[1]`` in the same statement, and their resources' ``held`` and ``sold`` moved
    with them, the resource rows locked in id order first (as a create locks them), so a
    sweep's batch, a payment and a create never wait on each other in a circle."""
    source, target = change
    moved = (
        update(holds_table)
        .where(
            HOLD.order_id.in_(select(changed.c.id)), HOLD.status == literal_column(f"'{source}'")
        )
        .values(status=literal_column(f"'{target}'"))
        .returning(HOLD.resource_id, HOLD.quantity)
        .cte(f"holds_{target}")
    )
    # Several orders of a batch may hold one resource: one row (and one update) each.
    per_resource = (
        select(moved.c.resource_id, func.sum(moved.c.quantity).label("units"))
        .group_by(moved.c.resource_id)
        .cte("units_moved")
    )
    locked = (
        select(RESOURCE.id)
        .where(RESOURCE.id.in_(select(per_resource.c.resource_id)))
        .order_by(RESOURCE.id)
        .with_for_update()
        .cte("resources_locked")
    )
    counted = (
        update(resources_table)
        .where(RESOURCE.id == per_resource.c.resource_id, RESOURCE.id == locked.c.id)
        .values(_counts(source, target, per_resource.c.units))
        .returning(RESOURCE.id)
        .cte("resources_counted")
    )
    units = unit_changes(select(changed.c.id), locked, change)
    return statement.add_cte(moved).add_cte(counted).add_cte(units)


def released_data(row: Any, data: Any) -> Any:
    """PostgreSQL: a release's event data, ``data`` with ``released`` (the order's holds)
    added when the order held something."""
    # No data arrives as JSON null, not SQL NULL: either is an empty object here.
    nothing = cast(text("'null'"), JSONB)
    given = func.coalesce(func.nullif(cast(data, JSONB), nothing), cast(text("'{}'"), JSONB))
    released = func.jsonb_build_object(literal_column("'released'"), row.holds)
    return case((row.holds.is_(None), data), else_=cast(given.op("||")(released), JSON))


def sqlite_hold_changes(conn: Connection, order_ids: list[str], change: tuple[str, str]) -> None:
    """SQLite: :func:`hold_changes` of some orders, in ``conn``'s write transaction."""
    source, target = change
    move_units(conn, order_ids, change)
    moved = conn.execute(
        update(holds_table)
        .where(HOLD.order_id.in_(order_ids), HOLD.status == source)
        .values(status=target)
        .returning(HOLD.resource_id, HOLD.quantity)
    ).all()
    units: dict[str, int] = {}
    for resource_id, quantity in moved:
        units[resource_id] = units.get(resource_id, 0) + quantity
    for resource_id, total in sorted(units.items()):
        conn.execute(
            update(resources_table)
            .where(RESOURCE.id == resource_id)
            .values(_counts(source, target, total))
        )
