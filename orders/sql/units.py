"""Named units in SQL (``oes_units``): a resource's seats, numbered spaces, single-place
slots, one row each, so a unit has one holder at most whatever races.

A named resource is a counted one whose capacity is its number of units: every rule of
:mod:`orders.sql.holds` (the resource row locked in id order, ``held`` and ``sold`` on the
row, the per-user cap) holds for it unchanged. On top of it, in the same transaction:

* a create's hold names its units (:func:`take_units`): those asked for by name, or the
  lowest free ones in the resource's order (``position``) when it asks for a count;
* a transition moves its units with its hold (:func:`unit_changes`, :func:`move_units`):
  sold on payment, free again at a close or cancel. A freed unit keeps ``order_id`` (its
  last holder): a late payment takes it again only while nobody else did;
* :func:`set_units` replaces the list: units held or sold cannot be removed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, String, bindparam, delete, func, insert, select, update

from orders.errors import HoldRefused, InvalidInput
from orders.inventory import HoldReason
from orders.sql.inventory_tables import (
    HOLD_HELD,
    HOLD_RELEASED,
    HOLD_SOLD,
    UNIT_FREE,
    UNIT_HELD,
    UNIT_SOLD,
    units_table,
)

UNIT = units_table.c
#: A hold's status -> the state of its units.
UNIT_STATE = {HOLD_HELD: UNIT_HELD, HOLD_SOLD: UNIT_SOLD, HOLD_RELEASED: UNIT_FREE}
#: Rows per statement when a list of units is written (bound parameters have limits).
CHUNK = 5000

_RID = bindparam("rid", type_=String)
_NAMES = bindparam("names", expanding=True, type_=String)
_STATES = select(UNIT.name, UNIT.state).where(UNIT.resource_id == _RID, UNIT.name.in_(_NAMES))
_LOWEST_FREE = (
    select(UNIT.name)
    .where(UNIT.resource_id == _RID, UNIT.state == UNIT_FREE)
    .order_by(UNIT.position)
    .limit(bindparam("n"))
)
_HOLD = (
    update(units_table)
    .where(UNIT.resource_id == _RID, UNIT.name.in_(_NAMES), UNIT.state == UNIT_FREE)
    .values(state=UNIT_HELD, order_id=bindparam("oid", type_=String))
)


def take_units(
    conn: Connection,
    order_id: str,
    named: Sequence[tuple[str, int]],
    asked: Mapping[str, tuple[str, ...]],
) -> dict[str, tuple[str, ...]]:
    """Hold the units of ``named`` (resource id, units) for ``order_id``, in the caller's
    transaction (the resources' rows locked already): the names ``asked`` for, else the
    lowest free. Returns the names held per resource; raises HoldRefused (``taken``) or
    InvalidInput (a name the resource does not have) and the caller rolls back."""
    taken: dict[str, tuple[str, ...]] = {}
    for rid, count in named:
        if rid in asked:
            names = asked[rid]
            states = dict(conn.execute(_STATES, {"rid": rid, "names": list(names)}).all())
            missing = [name for name in names if name not in states]
            if missing:
                raise InvalidInput("holds", f"{rid} has no unit {missing[0]!r}")
            busy = tuple(name for name in names if states[name] != UNIT_FREE)
            if busy:
                raise HoldRefused(rid, HoldReason.TAKEN, count, None, units=busy)
        else:
            names = tuple(conn.scalars(_LOWEST_FREE, {"rid": rid, "n": count}))
            if len(names) < count:  # the counters said free: only a drifted table gets here
                raise HoldRefused(rid, HoldReason.SOLD_OUT, count, len(names))
        held = conn.execute(_HOLD, {"rid": rid, "names": list(names), "oid": order_id})
        if held.rowcount != len(names):  # read free above, under the resource's lock
            raise HoldRefused(rid, HoldReason.TAKEN, count, None, units=names)
        taken[rid] = names
    return taken


def units_free_again(conn: Connection, order_id: str, resource_id: str) -> int:
    """How many units ``order_id`` last held of the resource are free now (a late payment
    takes them again only if all are)."""
    query = select(func.count()).where(
        UNIT.order_id == order_id, UNIT.resource_id == resource_id, UNIT.state == UNIT_FREE
    )
    return int(conn.scalar(query) or 0)


def unit_changes(orders: Any, locked: Any, change: tuple[str, str]) -> Any:
    """PostgreSQL: the CTE moving the units of the orders ``orders`` (a SELECT of ids) from
    a hold's ``change[0]`` to ``change[1]``, once their resources are ``locked`` (a CTE of
    resource ids: reading it makes the lock come first)."""
    source, target = (UNIT_STATE[status] for status in change)
    return (
        update(units_table)
        .where(
            UNIT.order_id.in_(orders),
            UNIT.state == source,
            UNIT.resource_id.in_(select(locked.c.id)),
        )
        .values(state=target)
        .returning(UNIT.name)
        .cte(f"units_{target}")
    )


def move_units(conn: Connection, order_ids: list[str], change: tuple[str, str]) -> None:
    """SQLite: :func:`unit_changes` in the caller's write transaction."""
    source, target = (UNIT_STATE[status] for status in change)
    conn.execute(
        update(units_table)
        .where(UNIT.order_id.in_(order_ids), UNIT.state == source)
        .values(state=target)
    )


def set_units(conn: Connection, resource_id: str, names: Sequence[str]) -> None:
    """Make ``names`` the resource's units, in this order, in the caller's transaction
    (the resource's row locked): new names are added free, those left out removed (unless
    held or sold: InvalidInput, and the caller rolls back), the others keep their state."""
    rid = {"rid": resource_id}
    existing = {
        row.name: (row.position, row.state)
        for row in conn.execute(
            select(UNIT.name, UNIT.position, UNIT.state).where(UNIT.resource_id == _RID), rid
        )
    }
    wanted = {name: position for position, name in enumerate(names)}
    removed = [name for name in existing if name not in wanted]
    busy = [name for name in removed if existing[name][1] != UNIT_FREE]
    if busy:
        shown = ", ".join(busy[:5]) + (" ..." if len(busy) > 5 else "")
        raise InvalidInput("units", f"{len(busy)} held or sold cannot be removed: {shown}")
    for chunk in _chunks(removed):
        conn.execute(
            delete(units_table).where(UNIT.resource_id == _RID, UNIT.name.in_(_NAMES)),
            {**rid, "names": chunk},
        )
    added = [
        {"resource_id": resource_id, "name": name, "position": position, "state": UNIT_FREE}
        for name, position in wanted.items()
        if name not in existing
    ]
    moved = [
        {"rid": resource_id, "unit": name, "pos": position}
        for name, position in wanted.items()
        if name in existing and existing[name][0] != position
    ]
    for chunk in _chunks(added):
        conn.execute(insert(units_table), chunk)
    reposition = (
        update(units_table)
        .where(UNIT.resource_id == _RID, UNIT.name == bindparam("unit"))
        .values(position=bindparam("pos"))
    )
    for chunk in _chunks(moved):
        conn.execute(reposition, chunk)


def units_of(conn: Connection, resource_id: str) -> list[tuple[str, str, str | None]]:
    """The resource's units in its order: (name, state, order id of the holder or the
    last holder)."""
    query = (
        select(UNIT.name, UNIT.state, UNIT.order_id)
        .where(UNIT.resource_id == resource_id)
        .order_by(UNIT.position)
    )
    return [(row.name, row.state, row.order_id) for row in conn.execute(query)]


def lowest_free(conn: Connection, resource_id: str, count: int) -> list[str]:
    """Up to ``count`` free units of the resource, the lowest in its order first: the
    first rows of one range of the units' (resource, state, position) index."""
    return list(conn.scalars(_LOWEST_FREE, {"rid": resource_id, "n": count}))


def _chunks(rows: Sequence[Any]) -> list[list[Any]]:
    return [list(rows[i : i + CHUNK]) for i in range(0, len(rows), CHUNK)]
