"""The sweep's SQL: claim a batch of due orders, close them and record their events.

One committed transaction per batch: on PostgreSQL a single statement in autocommit, so
no transaction of the sweep outlives the statement; on SQLite (two statements) one
``BEGIN IMMEDIATE`` transaction. The claim is ordered by expiry; on PostgreSQL rows
another sweeper holds are skipped (``SKIP LOCKED``), so several sweepers never wait on or
close the same order, and the compare-and-set (``status = 'unpaid'``) would refuse a second
close anyway.

The statements are built once, with the cutoff, the batch size and the close time bound.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ARRAY,
    BigInteger,
    Integer,
    String,
    any_,
    bindparam,
    cast,
    func,
    insert,
    literal,
    select,
    update,
)

from orders.domain import SWEEPER, Actor, EventKind, OrderStatus
from orders.sql.models import UNPAID_PREDICATE, due_at, events_table, orders_table
from orders.sql.records import EXPIRED_REASON, OrderRecords
from orders.sql.transitions import ACTOR_PARAMS, EVENT_COLUMNS, with_events

ORDER = orders_table.c


class DueCloser:
    """Closes due orders in batches over the records' engine."""

    def __init__(self, records: OrderRecords) -> None:
        self.records = records
        self._postgresql = records.dialect == "postgresql"
        self._close = _close_statement(postgresql=self._postgresql)

    def close_due(
        self, cutoff_ms: int, size: int, closed_at_ms: int, actor: Actor = SWEEPER
    ) -> Sequence[Any]:
        """Close up to ``size`` due orders in one committed transaction; their events name
        ``actor`` (the sweeper, unless an operator's sweep says otherwise).

        Returns a (user_id, expires_at_ms) tuple per closed order.
        """
        params = {
            "cutoff_ms": cutoff_ms,
            "size": size,
            "closed_at_ms": closed_at_ms,
            **actor.columns(),
        }
        if self._postgresql:
            # One statement in autocommit: the server commits it as it ends, without a
            # COMMIT from us. A sweeper stopped after sending it (SIGSTOP, a GC pause, a
            # frozen container) therefore holds no row of its batch locked: in a transaction
            # of our own, the claimed rows stayed locked until the process woke to commit,
            # and payments of those orders waited for it.
            with self.records.tx.statements() as conn:
                return conn.execute(self._close, params).all()
        with self.records.tx.write() as conn:
            rows = conn.execute(self._close, params).all()
            ids = json.dumps([row.id for row in rows])
            recorded = {"ids": ids, "closed_at_ms": closed_at_ms, **actor.columns()}
            conn.execute(_SQLITE_RECORD_CLOSED, recorded)
            conn.commit()
        return [(row.user_id, row.expires_at_ms) for row in rows]


def _close_statement(*, postgresql: bool) -> Any:
    """The claim and the compare-and-set close; on PostgreSQL the events' insert too."""
    cutoff = bindparam("cutoff_ms", type_=BigInteger())
    closed_at = bindparam("closed_at_ms", type_=BigInteger())
    due = (
        select(ORDER.id)
        .where(due_at(cutoff))
        .order_by(ORDER.expires_at_ms)
        .limit(bindparam("size", type_=Integer()))
    )
    if postgresql:
        # Rows another sweeper has claimed are skipped, not waited for.
        due = due.with_for_update(skip_locked=True)
    # A CTE, not "id IN (subquery)": PostgreSQL may run such a subquery more than once,
    # and with SKIP LOCKED each run can pick other rows, closing more than a batch.
    claimed = due.cte("due")
    if postgresql:
        # The claimed ids as one array, built once (an InitPlan), so each is found through
        # the primary key: joined to the CTE instead, the planner hashed the whole table
        # (a sequential scan took a third of the statement at 50,000 rows).
        ids = select(func.array_agg(claimed.c.id)).scalar_subquery()
        claim = ORDER.id == any_(cast(ids, ARRAY(ORDER.id.type)))
    else:
        claim = ORDER.id == claimed.c.id
    close = (
        update(orders_table)
        .where(claim, UNPAID_PREDICATE)
        .values(
            status=OrderStatus.CLOSED.value,
            closed_at_ms=closed_at,
            close_reason=EXPIRED_REASON,
            updated_at_ms=closed_at,
        )
    )
    if not postgresql:  # SQLite cannot put an UPDATE in a CTE: its events follow
        return close.returning(ORDER.id, ORDER.user_id, ORDER.expires_at_ms)
    # PostgreSQL: claim, close and write the events in one statement. Row-by-row event
    # inserts (psycopg's executemany) took most of a sweep's time there.
    closed = close.returning(ORDER.id, ORDER.user_id, ORDER.expires_at_ms)
    statement = with_events(closed, "closed", EventKind.CLOSED, closed_at)
    columns = statement.selected_columns
    return statement.with_only_columns(columns.user_id, columns.expires_at_ms)


# SQLite: the batch's events in one statement, its ids passed as one JSON array. The
# executemany it replaces cost a bound row (and a JSON 'null' for data) per event.
_closed_ids = func.json_each(bindparam("ids", type_=String())).table_valued("value")
_SQLITE_RECORD_CLOSED = insert(events_table).from_select(
    EVENT_COLUMNS,
    select(
        ORDER.id,
        ORDER.user_id,
        literal(EventKind.CLOSED.value),
        bindparam("closed_at_ms", type_=BigInteger()),
        *ACTOR_PARAMS,
    ).where(ORDER.id.in_(select(_closed_ids.c.value))),
)
