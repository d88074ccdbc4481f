"""Counted resources in SQL: ``oes_resources``, read with what ``oes_holds`` holds of each.

A resource's ``held`` and ``sold`` are columns of its row, kept by the very statements that
write its ``oes_holds`` rows (:mod:`orders.sql.holds`), so reading one costs the row alone
however many orders hold it.

Each method opens and commits its own transaction (a use case of its own:
``service.set_capacity``); a set never touches ``sold`` nor a hold, so lowering a capacity
below what is held and sold takes nothing back.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Float,
    Row,
    Select,
    String,
    bindparam,
    case,
    cast,
    literal_column,
    select,
)
from sqlalchemy.dialects import postgresql, sqlite

from orders.domain import Actor
from orders.errors import InvalidInput
from orders.inventory import Resource
from orders.sql.inventory_tables import HOLD_HELD, holds_table, resources_table
from orders.sql.models import orders_table
from orders.sql.transactions import Transactions
from orders.sql.units import lowest_free, set_units, units_of

RC = resources_table.c
HC = holds_table.c


_HELD_LITERAL_WHERE = HC.status == literal_column(f"'{HOLD_HELD}'")
#: The held holds of ``:rid`` with their orders' expiries (what the index's members are).
_HELD_MEMBERS = (
    select(HC.order_id, HC.quantity, orders_table.c.expires_at_ms)
    .join(orders_table, orders_table.c.id == HC.order_id)
    .where(HC.resource_id == bindparam("rid", type_=String), _HELD_LITERAL_WHERE)
)


#: (capacity, sold, [(order id, units, expiry ms) of each held hold], [(unit, state, order
#: id) of each named unit: none for a counted resource]).
RebuildState = tuple[int, int, list[tuple[str, int, int]], list[tuple[str, str, str | None]]]


def _with_held() -> Select[Any]:
    return select(RC.id, RC.capacity, RC.per_user, RC.sold, RC.updated_at_ms, RC.held, RC.named)


def _to_resource(row: Row[Any]) -> Resource:
    return Resource(
        id=row.id,
        capacity=int(row.capacity),
        held=int(row.held),
        sold=int(row.sold),
        per_user=None if row.per_user is None else int(row.per_user),
        updated_at_ms=row.updated_at_ms,
        named=bool(row.named),
    )


class ResourceRecords:
    """Reads and writes ``oes_resources`` (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def set(
        self, resource_id: str, capacity: int, per_user: int | None, now_ms: int, actor: Actor
    ) -> Resource:
        """Create the resource or change its capacity and ``per_user`` cap, and commit; the
        row as stored, with what is held of it, read in the same transaction."""
        values: dict[str, Any] = {"capacity": capacity, "per_user": per_user}
        with self.tx.write() as conn:
            current = conn.execute(self._lock(RC.named, RC.capacity), {"rid": resource_id}).first()
            if current is not None and current.named and current.capacity != capacity:
                raise InvalidInput(
                    "capacity", f"{resource_id} has named units: its capacity is their count"
                )
            row = self._upsert(conn, resource_id, values, now_ms, actor)
            conn.commit()
        return row

    def set_units(
        self, resource_id: str, names: Sequence[str], now_ms: int, actor: Actor
    ) -> Resource:
        """Make ``names`` the resource's named units (created if new: no ``per_user``) and
        its capacity their count, and commit (:func:`orders.sql.units.set_units`). A counted
        resource with units held or sold by count cannot be given names."""
        with self.tx.write() as conn:
            current = conn.execute(self._lock(RC.named, RC.held, RC.sold), {"rid": resource_id})
            row = current.first()
            if row is not None and not row.named and row.held + row.sold > 0:
                raise InvalidInput(
                    "units", f"{resource_id} has units held or sold by count: it cannot be named"
                )
            if row is None:  # the units' rows need the resource's first
                self._upsert(conn, resource_id, {"capacity": 0, "named": True}, now_ms, actor)
            set_units(conn, resource_id, names)
            values = {"capacity": len(names), "named": True}
            resource = self._upsert(conn, resource_id, values, now_ms, actor)
            conn.commit()
        return resource

    def units(self, resource_id: str) -> builtins.list[tuple[str, str, str | None]]:
        """The resource's named units in order: (name, state, holder or last holder)."""
        with self.tx.read() as conn:
            return units_of(conn, resource_id)

    def first_free(self, resource_id: str, count: int) -> builtins.list[str]:
        """Up to ``count`` free units of a named resource, lowest first (none for a counted
        one): a bounded read whatever the number of its units."""
        with self.tx.read() as conn:
            return lowest_free(conn, resource_id, count)

    def _lock(self, *columns: Any) -> Any:
        query = select(*columns).where(RC.id == bindparam("rid", type_=String))
        return query.with_for_update() if self.tx.dialect == "postgresql" else query

    def _upsert(
        self,
        conn: Connection,
        resource_id: str,
        values: dict[str, Any],
        now_ms: int,
        actor: Actor,
    ) -> Resource:
        """Insert the resource or change ``values`` of it; the row as stored."""
        who = actor.columns()
        values = {
            "id": resource_id,
            **values,
            "updated_at_ms": now_ms,
            "updated_by_kind": who["actor_kind"],
            "updated_by": who["actor"],
        }
        dialect = postgresql if self.tx.dialect == "postgresql" else sqlite
        upsert = dialect.insert(resources_table).values(values)
        upsert = upsert.on_conflict_do_update(
            index_elements=[RC.id],
            set_={name: upsert.excluded[name] for name in values if name != "id"},
        )
        conn.execute(upsert)
        return _to_resource(conn.execute(_with_held().where(RC.id == resource_id)).one())

    def get(self, resource_id: str) -> Resource | None:
        """The resource, or None when SQL has none of that id."""
        with self.tx.read() as conn:
            row = conn.execute(_with_held().where(RC.id == resource_id)).one_or_none()
        return None if row is None else _to_resource(row)

    def list(self, after: str | None, limit: int) -> builtins.list[Resource]:
        """Up to ``limit`` resources by id, those after ``after`` (a page's last id)."""
        query = _with_held().order_by(RC.id).limit(limit)
        if after is not None:
            query = query.where(RC.id > after)
        with self.tx.read() as conn:
            return [_to_resource(row) for row in conn.execute(query)]

    def running_out(self, limit: int, *, among: int | None = None) -> builtins.list[Resource]:
        """The ``limit`` resources (capacity above 0) with the smallest share of their
        capacity still free, sold out first; ties by fewest free units, then by id.

        Without ``among`` it reads every resource. With it, only the first ``among``
        resources by id are ranked: a range of the primary key, so the cost is bounded
        whatever the number of resources (the dashboard's bound; :meth:`more_than` says
        whether some were left out): the share has no index of its own."""
        ranked = _with_held().order_by(RC.id)
        if among is not None:
            ranked = ranked.limit(among)
        rows = ranked.subquery("ranked")
        free = rows.c.capacity - rows.c.sold - rows.c.held
        clamped = case((free < 0, 0), else_=free)
        share = cast(clamped, Float) / cast(rows.c.capacity, Float)
        query = (
            select(rows).where(rows.c.capacity > 0).order_by(share, clamped, rows.c.id).limit(limit)
        )
        with self.tx.read() as conn:
            return [_to_resource(row) for row in conn.execute(query)]

    def more_than(self, count: int) -> bool:
        """Whether SQL has more than ``count`` resources: one step along the primary key
        past the first ``count`` (the bound of :meth:`running_out`'s ``among``)."""
        query = select(RC.id).order_by(RC.id).offset(count).limit(1)
        with self.tx.read() as conn:
            return conn.execute(query).first() is not None

    def for_rebuild(self, resource_id: str) -> RebuildState | None:
        """What the index of one resource is rebuilt from (:data:`RebuildState`); None when
        SQL has no such resource.

        Read in this order, in separate statements: a payment between them moves units from
        held to sold, which the later reads then no longer list as held, so the index counts
        them in neither (too optimistic, which is safe) and never in both; a named unit read
        last is at worst shown sold or free sooner than its count."""
        with self.tx.read() as conn:
            row = conn.execute(
                select(RC.capacity, RC.sold, RC.named).where(RC.id == resource_id)
            ).one_or_none()
            if row is None:
                return None
            held = conn.execute(_HELD_MEMBERS, {"rid": resource_id}).all()
            named = units_of(conn, resource_id) if row.named else []
        members = [(oid, int(units), int(exp)) for oid, units, exp in held]
        return row.capacity, row.sold, members, named

    def still_held(self, resource_id: str, order_ids: Sequence[str]) -> builtins.set[str]:
        """Of ``order_ids``, those whose hold of the resource is still ``held``."""
        if not order_ids:
            return set()
        query = select(HC.order_id).where(
            HC.resource_id == resource_id, HC.order_id.in_(list(order_ids)), _HELD_LITERAL_WHERE
        )
        with self.tx.read() as conn:
            return set(conn.scalars(query))
