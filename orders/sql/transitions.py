"""The transitions out of ``unpaid``, each one compare-and-set statement built once.

A transition is ``UPDATE oes_orders SET ... WHERE id = :oid AND <the state it leaves> RETURNING
*``: of a payment, a cancel, a sweep and an extension racing for one order, exactly one
matches the row. When it wins, its ``order_events`` row is written in the same transaction
(the outbox). On PostgreSQL both are one statement (the event inserted from the UPDATE's
RETURNING in a CTE): one round trip, and in autocommit one transaction on its own.

The statements are built at import with bind parameters for everything a call varies:
building them per call (SQLAlchemy's coercions and cache keys) cost about as much client
CPU as running them. A transition of one order, and its event's INSERT on SQLite, go
straight to the driver (:mod:`orders.sql.direct`: compiled once per dialect from these
constructs), so SQLAlchemy's cursor events do not see them; the service's span covers the
call. A transition of several orders (``:oids``) goes through SQLAlchemy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    String,
    bindparam,
    insert,
    literal,
    literal_column,
    or_,
    select,
    update,
)

from orders.domain import Actor, EventKind, OrderStatus
from orders.sql.direct import PerDialect
from orders.sql.holds import (
    RELEASE,
    RETAKE,
    SELL,
    hold_changes,
    released_data,
    sqlite_hold_changes,
)
from orders.sql.models import events_table, orders_table
from orders.sql.predicates import PAUSED, UNPAID_PREDICATE, closable_at, open_at

ORDER = orders_table.c
#: An order's row after a transition: its columns by name (a dict from the driver, or
#: SQLAlchemy's RowMapping).
Changed = Mapping[Any, Any]
EXPIRED_REASON = "expired"

_NOW = bindparam("now_ms", type_=BigInteger)
_OID = bindparam("oid", type_=String)
_OIDS = bindparam("oids", expanding=True, type_=String)
_EXTRA = bindparam("extra_ms", type_=BigInteger)
_NEW_EXPIRY = bindparam("expires_at_ms", type_=BigInteger)
#: The columns an event takes from its order and its cause, in the order the INSERT ...
#: SELECTs name them.
EVENT_COLUMNS = ("order_id", "user_id", "kind", "at_ms", "actor_kind", "actor")
_INSERT_EVENT = insert(events_table).values(
    {name: bindparam(name, type_=events_table.c[name].type) for name in (*EVENT_COLUMNS, "data")}
)
_INSERT_EVENT_DIRECT = PerDialect(_INSERT_EVENT)
#: Who caused a transition, as bind parameters of the statements that record its event.
ACTOR_PARAMS = (
    bindparam("actor_kind", type_=String),
    bindparam("actor", type_=String),
)


def _update(
    where: list[ColumnElement[bool]],
    values: Mapping[str, Any],
    which: ColumnElement[bool] = ORDER.id == _OID,
) -> Any:
    return (
        update(orders_table)
        .where(which, *where)
        .values(updated_at_ms=_NOW, **values)
        .returning(*orders_table.c)
    )


def with_events(
    dml: Any,
    name: str,
    kind: EventKind,
    at_ms: Any,
    data: Any = None,
    actor: tuple[Any, Any] = ACTOR_PARAMS,
    data_from: Callable[[Any], Any] | None = None,
) -> Any:
    """PostgreSQL: ``dml`` (an INSERT or UPDATE ... RETURNING the order rows) and one
    ``kind`` event per returned row, in one statement: ``WITH name AS (dml), recorded AS
    (INSERT INTO oes_order_events SELECT ... FROM name) SELECT * FROM name``. ``actor``:
    the actor's kind and name as SQL expressions (by default the ``actor_kind`` and
    ``actor`` bind parameters). ``data_from``: instead of ``data``, the event's data built
    from the returned row's columns (given the CTE's column collection)."""
    changed = dml.cte(name)
    if data_from is not None:
        data = data_from(changed.c)
    columns = [changed.c.id, changed.c.user_id, literal(kind.value), at_ms, *actor]
    names = list(EVENT_COLUMNS)
    if data is not None:
        columns.append(data)
        names.append("data")
    record = insert(events_table).from_select(names, select(*columns)).cte("recorded")
    return select(changed).add_cte(record)


def _with_event(change: Any, kind: EventKind, holds: tuple[str, str] | None) -> Any:
    data: Any = bindparam("event_data", type_=events_table.c.data.type)
    names_released = holds == RELEASE
    statement = with_events(
        change,
        "changed",
        kind,
        _NOW,
        data_from=(lambda row: released_data(row, data)) if names_released else None,
        data=None if names_released else data,
    )
    if holds is None:
        return statement
    changed = statement.get_final_froms()[0]
    return hold_changes(statement, changed, holds)


def record_events(
    conn: Connection,
    orders: Sequence[tuple[str, str]],
    kind: EventKind,
    at_ms: int,
    data: dict[str, Any] | None,
    actor: Actor,
) -> None:
    """Write one event per (order id, user id), in the caller's transaction: for the
    transitions that SQLite cannot return from one statement with their event."""
    insert_events(conn, [(oid, uid, data) for oid, uid in orders], kind, at_ms, actor)


def insert_events(
    conn: Connection,
    events: Sequence[tuple[str, str, dict[str, Any] | None]],
    kind: EventKind,
    at_ms: int,
    actor: Actor,
) -> None:
    """Write one event per (order id, user id, data), in the caller's transaction."""
    rows = [event_row(oid, uid, kind, at_ms, data, actor) for oid, uid, data in events]
    insert_event_rows(conn, rows)


def event_row(
    order_id: str, user_id: str, kind: EventKind, at_ms: int, data: Any, actor: Actor
) -> dict[str, Any]:
    """One ``order_events`` row as :func:`insert_event_rows` takes it."""
    return {
        "order_id": order_id,
        "user_id": user_id,
        "kind": kind.value,
        "at_ms": at_ms,
        "data": data,
        **actor.columns(),
    }


def insert_event_rows(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> None:
    """Write events given whole (every column of :data:`EVENT_COLUMNS` and ``data``), in
    the caller's transaction."""
    if len(rows) == 1:  # one row: no executemany machinery
        direct = _INSERT_EVENT_DIRECT.on(conn)
        if direct is not None:
            direct.execute(conn, rows[0])
        else:
            conn.execute(_INSERT_EVENT, rows[0])
    elif rows:
        conn.execute(_INSERT_EVENT, list(rows))


@dataclass(frozen=True)
class CompareAndSet:
    """One transition: its UPDATE, the kind of event it records when it wins, and what it
    does to the order's holds (:mod:`orders.sql.holds`: from one status to another; a
    release names the units in the event's ``released``)."""

    kind: EventKind
    change: Any
    holds: tuple[str, str] | None = None
    in_one_statement: Any = field(init=False)
    #: Both, straight to the driver (module docstring).
    direct_change: PerDialect = field(init=False)
    direct_in_one_statement: PerDialect = field(init=False)

    def __post_init__(self) -> None:
        statement = _with_event(self.change, self.kind, self.holds)
        object.__setattr__(self, "in_one_statement", statement)
        object.__setattr__(self, "direct_change", PerDialect(self.change))
        object.__setattr__(self, "direct_in_one_statement", PerDialect(statement))

    def run(
        self,
        conn: Connection,
        params: Mapping[str, Any],
        data: dict[str, Any] | None,
        actor: Actor,
    ) -> Changed | None:
        """Run it in ``conn``'s transaction; the row after it if it won, else None.
        ``actor``: who caused it, recorded in its event."""
        rows = self.run_all(conn, params, data, actor)
        return rows[0] if rows else None

    def run_all(
        self,
        conn: Connection,
        params: Mapping[str, Any],
        data: dict[str, Any] | None,
        actor: Actor,
    ) -> Sequence[Changed]:
        """:meth:`run` for a transition whose UPDATE may match several orders (``:oids``):
        the rows it changed."""
        if conn.dialect.name == "postgresql":
            statement_params = {**params, "event_data": data, **actor.columns()}
            return self.direct_in_one_statement.rows(conn, statement_params)
        rows = self.direct_change.rows(conn, params)
        holding = [row["id"] for row in rows if row["holds"]]
        if self.holds is not None and holding:
            sqlite_hold_changes(conn, holding, self.holds)
        events = []
        for row in rows:
            row_data = data
            if self.holds == RELEASE and row["holds"]:
                row_data = {**(data or {}), "released": row["holds"]}
            at_ms = params["now_ms"]
            events.append(event_row(row["id"], row["user_id"], self.kind, at_ms, row_data, actor))
        insert_event_rows(conn, events)
        return rows


_PAID = {
    "status": OrderStatus.PAID.value,
    "paid_at_ms": _NOW,
    "payment_ref": bindparam("ref", type_=String),
}

#: Unpaid -> paid, whatever the expiry (a payment that beats the sweep wins).
PAY = CompareAndSet(EventKind.PAID, _update([UNPAID_PREDICATE], _PAID), SELL)
#: Unpaid -> paid while the expiry is still ahead, or a pause holds every expiry
#: (``strict_expiry``).
PAY_STRICT = CompareAndSet(
    EventKind.PAID, _update([UNPAID_PREDICATE, or_(open_at(_NOW), PAUSED)], _PAID), SELL
)
#: Closed by expiry, at most ``:window_ms`` after the expiry -> paid (a late payment the
#: host accepted; its policy's ``late_payment_window_s``).
PAY_LATE = CompareAndSet(
    EventKind.PAID,
    _update(
        [
            ORDER.status == literal_column(f"'{OrderStatus.CLOSED.value}'"),
            ORDER.close_reason == EXPIRED_REASON,
            ORDER.expires_at_ms + bindparam("window_ms", type_=BigInteger) >= _NOW,
        ],
        _PAID,
    ),
    RETAKE,
)
#: Unpaid -> cancelled.
CANCEL = CompareAndSet(
    EventKind.CANCELLED,
    _update(
        [UNPAID_PREDICATE],
        {
            "status": OrderStatus.CANCELLED.value,
            "closed_at_ms": _NOW,
            "close_reason": bindparam("reason", type_=String),
        },
    ),
    RELEASE,
)
_CLOSED = {
    "status": OrderStatus.CLOSED.value,
    "closed_at_ms": _NOW,
    "close_reason": EXPIRED_REASON,
}
#: Unpaid and due, no pause open -> closed (the sweep's rule, for one order).
CLOSE_EXPIRED = CompareAndSet(EventKind.CLOSED, _update([closable_at(_NOW)], _CLOSED), RELEASE)
#: The same for several orders (``:oids``) in one statement, so that their resources are
#: locked in id order at once: closed one statement at a time in one transaction, the
#: locks of the first close were held while the next waited for an order the sweep had
#: claimed, and the sweep waited for those locks (a deadlock, seen on PostgreSQL).
CLOSE_ALL_EXPIRED = CompareAndSet(
    EventKind.CLOSED, _update([closable_at(_NOW)], _CLOSED, ORDER.id.in_(_OIDS)), RELEASE
)
#: An unreminded order's reminder keeps its distance to the expiry when the expiry moves
#: (the SET sees the row before the update). NULL stays NULL: a reminder already written is
#: not written again, and an order created inside the reminder's window still gets none.
_REMIND_OFFSET = ORDER.remind_at_ms - ORDER.expires_at_ms

#: An open order's expiry ``:extra_ms`` later, within ``:max_life_ms`` of its creation.
EXTEND_OPEN = CompareAndSet(
    EventKind.EXTENDED,
    _update(
        [
            open_at(_NOW),
            ORDER.expires_at_ms + _EXTRA - ORDER.created_at_ms
            <= bindparam("max_life_ms", type_=BigInteger),
        ],
        {
            "expires_at_ms": ORDER.expires_at_ms + _EXTRA,
            "remind_at_ms": ORDER.remind_at_ms + _EXTRA,
            "extensions": ORDER.extensions + 1,
        },
    ),
)
#: An unpaid order never extended gets the expiry ``:expires_at_ms`` (the pre-close check).
REOPEN_EXPIRED = CompareAndSet(
    EventKind.EXTENDED,
    _update(
        [UNPAID_PREDICATE, ORDER.extensions == 0],
        {
            "expires_at_ms": _NEW_EXPIRY,
            "remind_at_ms": _NEW_EXPIRY + _REMIND_OFFSET,
            "extensions": ORDER.extensions + 1,
        },
    ),
)
