"""Retention: delete paid, cancelled and closed orders past an age, with their events.

An order may go once it is terminal and its last transition is older than the cutoff, and
only when nothing still needs it:

* no refund of it is still owed (a refusal not yet marked handled);
* no event of it is retrying or parked for a consumer (an operator may still requeue it);
* every registered consumer has read every event of it (its cursor is past them).

Its events go with it (``ON DELETE CASCADE``), and its refusals, all handled, in the same
transaction (a refusal has no foreign key: one still owed outlives its order).
The candidates are read along the partial indexes over each terminal status (paid by
``paid_at_ms``, cancelled and closed by ``closed_at_ms``), oldest first, in batches with a
keyset cursor, so an order kept for one of the reasons above is stepped over, not read
again by every batch. The conditions are checked again in the DELETE itself, so an order
that turned needed in between (a cursor reset, a refund recorded) stays.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    delete,
    exists,
    func,
    literal_column,
    or_,
    select,
    tuple_,
)

from orders.domain import OrderStatus
from orders.sql.models import (
    cursors_table,
    events_table,
    orders_table,
    refusals_table,
    retries_table,
)
from orders.sql.transactions import Transactions

ORDER = orders_table.c
EVENT = events_table.c
#: Each terminal status and the column its partial index orders it by.
TERMINAL = (
    (OrderStatus.PAID, ORDER.paid_at_ms),
    (OrderStatus.CANCELLED, ORDER.closed_at_ms),
    (OrderStatus.CLOSED, ORDER.closed_at_ms),
)


def _still_needed(postgresql: bool) -> ColumnElement[bool]:
    """An order (of the outer query) that a refund, a retry or a consumer still needs."""
    owed = exists().where(
        refusals_table.c.order_id == ORDER.id, refusals_table.c.handled_at_ms.is_(None)
    )
    retrying = exists().where(retries_table.c.event_id == EVENT.id, EVENT.order_id == ORDER.id)
    if postgresql:
        past_cursor = tuple_(EVENT.txid, EVENT.id) > tuple_(
            cursors_table.c.txid, cursors_table.c.event_id
        )
    else:
        past_cursor = EVENT.id > cursors_table.c.event_id
    unread = exists().where(EVENT.order_id == ORDER.id, past_cursor)
    return or_(owed, retrying, unread)


@dataclass(frozen=True, slots=True)
class PruneBatch:
    """One batch's orders (id, user id, status) and how many events went with them."""

    orders: list[tuple[str, str, str]]
    events: int


class Retention:
    """Finds and deletes prunable orders over one engine (module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx
        self.needed = _still_needed(tx.dialect == "postgresql")

    def batches(
        self, cutoff_ms: int, size: int, *, dry_run: bool, with_rows: bool = True
    ) -> Iterator[tuple[PruneBatch, list[dict[str, Any]]]]:
        """Each batch of prunable orders, oldest first per status, with their rows and
        events as the archive sees them (none without ``with_rows``: only their events are
        counted, which costs a fraction of reading them); unless ``dry_run``, deleted once
        the caller is back from handling it (the next step of the iterator), in a
        transaction of its own.
        """
        for status, at in TERMINAL:
            after: tuple[int, str] | None = None
            while True:
                found = self._next(status, at, cutoff_ms, size, after)
                if not found:
                    break
                ids = [row.id for row in found]
                if with_rows:
                    rows = self._rows_with_events(ids)
                    events = sum(len(r["events"]) for r in rows)
                else:
                    rows, events = [], self._count_events(ids)
                batch = PruneBatch([(r.id, r.user_id, r.status) for r in found], events)
                yield batch, rows
                if not dry_run:
                    self._delete(ids)
                last = found[-1]
                after = (last.at, last.id)
                if len(found) < size:
                    break

    def _next(
        self,
        status: OrderStatus,
        at: Any,
        cutoff_ms: int,
        size: int,
        after: tuple[int, str] | None,
    ) -> Sequence[Any]:
        query = (
            select(ORDER.id, ORDER.user_id, ORDER.status, at.label("at"))
            .where(
                ORDER.status == literal_column(f"'{status.value}'"),
                at < cutoff_ms,
                ~self.needed,
            )
            .order_by(at, ORDER.id)
            .limit(size)
        )
        if after is not None:
            # A row comparison, not "at > a OR (at = a AND id > b)": with the OR, PostgreSQL
            # scans the index from its start past every order of the earlier batches, so a
            # prune's batches cost more and more (n^2 over a large table); this starts the
            # index scan at the cursor. The plain bound lets SQLite's planner do the same.
            query = query.where(at >= after[0], tuple_(at, ORDER.id) > tuple_(*after))
        with self.tx.read() as conn:
            return conn.execute(query).all()

    def _count_events(self, ids: list[str]) -> int:
        with self.tx.read() as conn:
            query = select(func.count()).select_from(events_table).where(EVENT.order_id.in_(ids))
            return int(conn.scalar(query) or 0)

    def _rows_with_events(self, ids: list[str]) -> list[dict[str, Any]]:
        with self.tx.read() as conn:
            orders = conn.execute(select(orders_table).where(ORDER.id.in_(ids))).mappings().all()
            events = (
                conn.execute(select(events_table).where(EVENT.order_id.in_(ids)).order_by(EVENT.id))
                .mappings()
                .all()
            )
        by_order: dict[str, list[dict[str, Any]]] = {oid: [] for oid in ids}
        for event in events:
            by_order[event["order_id"]].append(dict(event))
        return [dict(row) | {"events": by_order[row["id"]]} for row in orders]

    def _delete(self, ids: list[str]) -> None:
        terminal = ORDER.status != literal_column(f"'{OrderStatus.UNPAID.value}'")
        with self.tx.write() as conn:
            _delete_in(conn, ids, terminal, ~self.needed)
            conn.commit()


def _delete_in(conn: Connection, ids: list[str], *conditions: ColumnElement[bool]) -> None:
    deleted = conn.scalars(
        delete(orders_table).where(ORDER.id.in_(ids), *conditions).returning(ORDER.id)
    ).all()
    if deleted:
        refusal = refusals_table.c
        conn.execute(
            delete(refusals_table).where(
                refusal.order_id.in_(deleted), refusal.handled_at_ms.is_not(None)
            )
        )
