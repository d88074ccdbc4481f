"""The sweep's SQL: claim a batch of due orders, close them and record their events.

One committed transaction per batch. The claim is ordered by expiry; on PostgreSQL rows
another sweeper holds are skipped (``SKIP LOCKED``), so several sweepers never wait on or
close the same order, and the compare-and-set (``status = 'unpaid'``) would refuse a second
close anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, insert, literal, select, update

from orders.domain import EventKind, OrderStatus
from orders.models import UNPAID_PREDICATE, due_at, events_table, orders_table
from orders.records import EXPIRED_REASON, OrderRecords

ORDER = orders_table.c


class DueCloser:
    """Closes due orders in batches over the records' engine."""

    def __init__(self, records: OrderRecords) -> None:
        self.records = records

    def close_due(self, cutoff_ms: int, size: int, closed_at_ms: int) -> Sequence[Any]:
        """Close up to ``size`` due orders in one committed transaction.

        Returns their (id, user_id, expires_at_ms) rows.
        """
        due = select(ORDER.id).where(due_at(cutoff_ms)).order_by(ORDER.expires_at_ms).limit(size)
        if self.records.dialect == "postgresql":
            # Rows another sweeper has claimed are skipped, not waited for.
            due = due.with_for_update(skip_locked=True)
        # A CTE, not "id IN (subquery)": PostgreSQL may run such a subquery more than once,
        # and with SKIP LOCKED each run can pick other rows, closing more than a batch.
        claimed = due.cte("due")
        close = (
            update(orders_table)
            .where(ORDER.id == claimed.c.id, UNPAID_PREDICATE)
            .values(
                status=OrderStatus.CLOSED.value,
                closed_at_ms=closed_at_ms,
                close_reason=EXPIRED_REASON,
                updated_at_ms=closed_at_ms,
            )
            .returning(ORDER.id, ORDER.user_id, ORDER.expires_at_ms)
        )
        with self.records.tx.write() as conn:
            if self.records.dialect == "postgresql":
                rows = conn.execute(_closed_with_events(close, closed_at_ms)).all()
            else:
                rows = conn.execute(close).all()
                pairs = [(r.id, r.user_id) for r in rows]
                self.records.record(conn, pairs, EventKind.CLOSED, closed_at_ms, None)
            conn.commit()
        return rows


def _closed_with_events(close: Any, closed_at_ms: int) -> Any:
    """PostgreSQL: claim, close and write the events in one statement.

    Row-by-row event inserts (psycopg's executemany) took most of a sweep's time there.
    """
    closed = close.cte("closed")
    record = (
        insert(events_table)
        .from_select(
            ["order_id", "user_id", "kind", "at_ms"],
            select(
                closed.c.id,
                closed.c.user_id,
                literal(EventKind.CLOSED.value),
                literal(closed_at_ms, BigInteger()),
            ),
        )
        .cte("recorded")
    )
    return select(closed.c.id, closed.c.user_id, closed.c.expires_at_ms).add_cte(record)
