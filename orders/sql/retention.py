"""Retention: delete paid, cancelled and closed orders past an age, with their events.

An order may go once it is terminal and its last transition is older than the cutoff, and
only when nothing still needs it:

* no refund of it is still owed (a refusal not yet marked handled);
* no event of it is retrying or parked for a consumer (an operator may still requeue it);
* every consumer still reading has read every event of it: a consumer whose cursor has not
  moved since the cutoff (stopped for the retention period) holds nothing that old, so
  retention never waits on one for longer (:meth:`Retention.behind` names both kinds).

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
CURSOR = cursors_table.c
#: Each terminal status and the column its partial index orders it by.
TERMINAL = (
    (OrderStatus.PAID, ORDER.paid_at_ms),
    (OrderStatus.CANCELLED, ORDER.closed_at_ms),
    (OrderStatus.CLOSED, ORDER.closed_at_ms),
)


def _past_cursor(postgresql: bool) -> ColumnElement[bool]:
    """An event (of the outer query) after a consumer's cursor (of the outer query)."""
    if postgresql:
        return tuple_(EVENT.txid, EVENT.id) > tuple_(CURSOR.txid, CURSOR.event_id)
    return EVENT.id > CURSOR.event_id


def _still_needed(postgresql: bool, cutoff_ms: int) -> ColumnElement[bool]:
    """An order (of the outer query) that a refund, a retry or a reading consumer needs."""
    owed = exists().where(
        refusals_table.c.order_id == ORDER.id, refusals_table.c.handled_at_ms.is_(None)
    )
    retrying = exists().where(retries_table.c.event_id == EVENT.id, EVENT.order_id == ORDER.id)
    reading = CURSOR.updated_at_ms >= cutoff_ms
    unread = exists().where(EVENT.order_id == ORDER.id, _past_cursor(postgresql), reading)
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
        self.postgresql = tx.dialect == "postgresql"

    def behind(self, cutoff_ms: int) -> tuple[list[str], list[str]]:
        """The consumers whose first unread event is older than the cutoff: those still
        reading (they hold its order), and those whose cursor has not moved since the
        cutoff (passed: that event goes without them). One index probe per consumer."""
        first_unread = (
            select(EVENT.at_ms)
            .where(_past_cursor(self.postgresql))
            .order_by(*((EVENT.txid, EVENT.id) if self.postgresql else (EVENT.id,)))
            .limit(1)
            .scalar_subquery()
        )
        query = select(CURSOR.name, CURSOR.updated_at_ms).where(first_unread < cutoff_ms)
        with self.tx.read() as conn:
            found = conn.execute(query.order_by(CURSOR.name)).all()
        return (
            [row.name for row in found if row.updated_at_ms >= cutoff_ms],
            [row.name for row in found if row.updated_at_ms < cutoff_ms],
        )

    def batches(
        self, cutoff_ms: int, size: int, *, dry_run: bool, with_rows: bool = True
    ) -> Iterator[tuple[PruneBatch, list[dict[str, Any]]]]:
        """Each batch of prunable orders, oldest first per status, with their rows and
        events as the archive sees them (none without ``with_rows``: only their events are
        counted, which costs a fraction of reading them); unless ``dry_run``, deleted once
        the caller is back from handling it (the next step of the iterator), in a
        transaction of its own.
        """
        needed = _still_needed(self.postgresql, cutoff_ms)
        for status, at in TERMINAL:
            after: tuple[int, str] | None = None
            while True:
                found = self._next(status, at, cutoff_ms, size, after, needed)
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
                    self._delete(ids, needed)
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
        needed: ColumnElement[bool],
    ) -> Sequence[Any]:
        query = (
            select(ORDER.id, ORDER.user_id, ORDER.status, at.label("at"))
            .where(
                ORDER.status == literal_column(f"'{status.value}'"),
                at < cutoff_ms,
                ~needed,
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

    def _delete(self, ids: list[str], needed: ColumnElement[bool]) -> None:
        terminal = ORDER.status != literal_column(f"'{OrderStatus.UNPAID.value}'")
        with self.tx.write() as conn:
            _delete_in(conn, ids, terminal, ~needed)
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
