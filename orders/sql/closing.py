"""The sweep's SQL: claim a batch of due orders, close them and record their events; and
the same for the reminders due (the ``remind_before_s`` of each order's policy).

One committed transaction per batch: on PostgreSQL a single statement in autocommit, so
no transaction of the sweep outlives the statement; on SQLite (two statements) one
``BEGIN IMMEDIATE`` transaction. The claim is ordered by expiry; on PostgreSQL rows
another sweeper holds are skipped (``SKIP LOCKED``), so several sweepers never wait on or
close the same order, and the compare-and-set (``status = 'unpaid'``) would refuse a second
close anyway.

While an incident pause is open (``oes_pauses``, :mod:`orders.sql.pauses`) both claims
find nothing: the pause is a condition of the statements themselves.

A reminder is a compare-and-set too: an unpaid order whose ``remind_at_ms`` has come and
whose expiry is still ahead gets ``remind_at_ms = NULL, reminded_at_ms = now`` and an
``expiring`` event, so of several sweepers exactly one writes it, and only once. Its
batches follow the partial index over the reminders due.

The statements are built once, with the cutoff, the batch size and the close time bound.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    String,
    any_,
    bindparam,
    case,
    cast,
    func,
    insert,
    literal,
    literal_column,
    null,
    select,
    update,
)

from orders.domain import SWEEPER, Actor, EventKind, OrderStatus
from orders.sql.holds import RELEASE, hold_changes, released_data, sqlite_hold_changes
from orders.sql.models import events_table, orders_table
from orders.sql.predicates import NOT_PAUSED, UNPAID_PREDICATE, closable_at, reminder_due_at
from orders.sql.records import EXPIRED_REASON, OrderRecords
from orders.sql.transitions import ACTOR_PARAMS, EVENT_COLUMNS, with_events

ORDER = orders_table.c


class DueCloser:
    """Closes due orders, and writes due reminders, in batches over the records' engine."""

    def __init__(self, records: OrderRecords) -> None:
        self.records = records
        self._postgresql = records.dialect == "postgresql"
        self._close = _close_statement(postgresql=self._postgresql)
        self._remind = _remind_statement(postgresql=self._postgresql)

    def close_due(
        self, cutoff_ms: int, size: int, closed_at_ms: int, actor: Actor = SWEEPER
    ) -> Sequence[Any]:
        """Close up to ``size`` due orders in one committed transaction; their events name
        ``actor`` (the sweeper, unless an operator's sweep says otherwise).

        Returns a (user_id, expires_at_ms, order id, holds) tuple per closed order (holds:
        what it released, None when nothing).
        """
        params = {"cutoff_ms": cutoff_ms, "size": size, "closed_at_ms": closed_at_ms}
        return self._run(self._close, _SQLITE_RECORD_CLOSED, params, closed_at_ms, actor)

    def remind_due(
        self, cutoff_ms: int, size: int, reminded_at_ms: int, actor: Actor = SWEEPER
    ) -> Sequence[Any]:
        """Write up to ``size`` reminders due at ``cutoff_ms`` (of orders whose expiry is
        after it) in one committed transaction: each order's ``reminded_at_ms`` and its
        ``expiring`` event, whose data holds the order's ``expires_at_ms``.

        Returns a (user_id, expires_at_ms, order id, None) tuple per reminded order.
        """
        params = {"cutoff_ms": cutoff_ms, "size": size, "reminded_at_ms": reminded_at_ms}
        return self._run(self._remind, _SQLITE_RECORD_EXPIRING, params, reminded_at_ms, actor)

    def _run(
        self, statement: Any, record: Any, params: dict[str, Any], at_ms: int, actor: Actor
    ) -> Sequence[Any]:
        """One batch: on PostgreSQL ``statement`` alone (its events included), on SQLite
        ``statement`` and then ``record`` (the events of the rows it changed)."""
        params = {**params, **actor.columns()}
        if self._postgresql:
            # One statement in autocommit: the server commits it as it ends, without a
            # COMMIT from us. A sweeper stopped after sending it (SIGSTOP, a GC pause, a
            # frozen container) therefore holds no row of its batch locked: in a transaction
            # of our own, the claimed rows stayed locked until the process woke to commit,
            # and payments of those orders waited for it.
            with self.records.tx.statements() as conn:
                return conn.execute(statement, params).all()
        with self.records.tx.write() as conn:
            rows = conn.execute(statement, params).all()
            ids = json.dumps([row.id for row in rows])
            conn.execute(record, {"ids": ids, "at_ms": at_ms, **actor.columns()})
            if record is _SQLITE_RECORD_CLOSED:
                holding = [row.id for row in rows if row.holds]
                if holding:
                    sqlite_hold_changes(conn, holding, RELEASE)
            conn.commit()
        return [(row.user_id, row.expires_at_ms, row.id, row.holds) for row in rows]


def _claim(due: Select[Any], *, postgresql: bool) -> ColumnElement[bool]:
    """The UPDATE's condition on the id: one of the rows ``due`` (a SELECT of ids) claims."""
    if postgresql:
        # Rows another sweeper has claimed are skipped, not waited for.
        due = due.with_for_update(skip_locked=True)
    # A CTE, not "id IN (subquery)": PostgreSQL may run such a subquery more than once,
    # and with SKIP LOCKED each run can pick other rows, changing more than a batch.
    claimed = due.cte("due")
    if postgresql:
        # The claimed ids as one array, built once (an InitPlan), so each is found through
        # the primary key: joined to the CTE instead, the planner hashed the whole table
        # (a sequential scan took a third of the statement at 50,000 rows).
        ids = select(func.array_agg(claimed.c.id)).scalar_subquery()
        return ORDER.id == any_(cast(ids, ARRAY(ORDER.id.type)))
    return ORDER.id == claimed.c.id


def _batch(
    statement: Any,
    *,
    postgresql: bool,
    name: str,
    kind: EventKind,
    holds: tuple[str, str] | None = None,
    **events: Any,
) -> Any:
    """SQLite: ``statement`` returning what its caller reads (its events follow, since
    SQLite cannot put an UPDATE in a CTE). PostgreSQL: the events inserted in the same
    statement (``with_events``); row-by-row event inserts (psycopg's executemany) took most
    of a sweep's time there."""
    changed = statement.returning(ORDER.id, ORDER.user_id, ORDER.expires_at_ms, ORDER.holds)
    if not postgresql:
        return changed
    with_recorded = with_events(changed, name, kind, **events)
    if holds is not None:
        with_recorded = hold_changes(with_recorded, with_recorded.get_final_froms()[0], holds)
    columns = with_recorded.selected_columns
    return with_recorded.with_only_columns(
        columns.user_id, columns.expires_at_ms, columns.id, columns.holds
    )


def _close_statement(*, postgresql: bool) -> Any:
    """The claim and the compare-and-set close; on PostgreSQL the events' insert too."""
    cutoff = bindparam("cutoff_ms", type_=BigInteger())
    closed_at = bindparam("closed_at_ms", type_=BigInteger())
    due = (
        select(ORDER.id)
        .where(closable_at(cutoff))
        .order_by(ORDER.expires_at_ms)
        .limit(bindparam("size", type_=Integer()))
    )
    close = (
        update(orders_table)
        .where(_claim(due, postgresql=postgresql), UNPAID_PREDICATE)
        .values(
            status=OrderStatus.CLOSED.value,
            closed_at_ms=closed_at,
            close_reason=EXPIRED_REASON,
            updated_at_ms=closed_at,
        )
    )
    return _batch(
        close,
        postgresql=postgresql,
        name="closed",
        kind=EventKind.CLOSED,
        holds=RELEASE,
        at_ms=closed_at,
        data_from=_released,
    )


def _released(row: Any) -> Any:
    """A close's event data: the units it released (none: no data)."""
    return released_data(row, null())


def _expiring_data(row: Any) -> Any:
    """PostgreSQL: the ``expiring`` event's data, from the reminded row."""
    return func.json_build_object(literal_column("'expires_at_ms'"), row.expires_at_ms)


def _remind_statement(*, postgresql: bool) -> Any:
    """The claim and the compare-and-set reminder; on PostgreSQL the events' insert too."""
    cutoff = bindparam("cutoff_ms", type_=BigInteger())
    reminded_at = bindparam("reminded_at_ms", type_=BigInteger())
    owed = reminder_due_at(cutoff)
    due = (
        select(ORDER.id)
        .where(owed, NOT_PAUSED)
        .order_by(ORDER.remind_at_ms)
        .limit(bindparam("size", type_=Integer()))
    )
    remind = (
        update(orders_table)
        .where(_claim(due, postgresql=postgresql), owed)
        .values(remind_at_ms=None, reminded_at_ms=reminded_at)
    )
    return _batch(
        remind,
        postgresql=postgresql,
        name="reminded",
        kind=EventKind.EXPIRING,
        at_ms=reminded_at,
        data_from=_expiring_data,
    )


def _sqlite_record(kind: EventKind, data: Any = None) -> Any:
    """SQLite: a batch's events in one statement, its ids passed as one JSON array. The
    executemany it replaces cost a bound row (and a JSON 'null' for data) per event."""
    ids = func.json_each(bindparam("ids", type_=String())).table_valued("value")
    columns = [
        ORDER.id,
        ORDER.user_id,
        literal(kind.value),
        bindparam("at_ms", type_=BigInteger()),
        *ACTOR_PARAMS,
    ]
    names = list(EVENT_COLUMNS)
    if data is not None:
        columns.append(data)
        names.append("data")
    source = select(*columns).where(ORDER.id.in_(select(ids.c.value)))
    return insert(events_table).from_select(names, source)


_SQLITE_RECORD_CLOSED = _sqlite_record(
    EventKind.CLOSED,
    case(
        (ORDER.holds.is_(None), null()),
        else_=func.json_object(literal_column("'released'"), func.json(ORDER.holds)),
    ),
)

_SQLITE_RECORD_EXPIRING = _sqlite_record(
    EventKind.EXPIRING, func.json_object(literal_column("'expires_at_ms'"), ORDER.expires_at_ms)
)
