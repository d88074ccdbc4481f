"""The SQL of waiting lists: ``oes_waiting``, one row per user queued for a resource.

A queue is a resource's ``waiting`` rows in ``id`` order (first come, first served), read
through a partial index that holds those rows only, so an empty queue costs nothing and a
service with no waiting list at all pays one look into an empty index.

Every change of an entry's status is a compare-and-set from ``waiting`` (to ``served``,
``left`` or ``expired``): two servers of one entry, or a serve racing a leave, change it
once. A user has one place at most in a resource's queue (a unique partial index); adding
a second returns the first, also when two adds race (the loser's insert does nothing and it
reads the winner's row).

Each method opens its own short transaction (a statement, on PostgreSQL in autocommit);
:func:`forget_user` runs in the caller's, an erasure's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    Select,
    String,
    case,
    cast,
    delete,
    exists,
    func,
    literal,
    literal_column,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from orders.domain import Actor
from orders.errors import StoreUnavailable
from orders.inventory import WAITING_ORDER_PREFIX, WaitingEntry, WaitingStatus
from orders.sql.inventory_tables import WAITING, resources_table, waiting_table
from orders.sql.models import orders_table
from orders.sql.transactions import Transactions

W = waiting_table.c
RC = resources_table.c

_ENTRY: Select[Any] = select(
    W.id,
    W.resource_id,
    W.user_id,
    W.quantity,
    W.until_ms,
    W.created_at_ms,
    W.status,
    W.order_id,
    W.ended_at_ms,
)
#: The status as a literal, never a bound parameter: a statement the driver has prepared
#: runs on a generic plan, where PostgreSQL matches a partial index (the queue's, and the
#: ON CONFLICT target of :meth:`WaitingRecords.add`) only to a WHERE that spells the
#: index's own predicate. With a parameter, the add failed after a few runs on one
#: connection ("no unique or exclusion constraint matching the ON CONFLICT").
_WAITING = W.status == literal_column(f"'{WAITING}'")
#: A read after an insert that did nothing may miss the winner when it has already left
#: the queue again: the add then tries once more (and once more only).
ADD_ATTEMPTS = 3


def _to_entry(row: Row[Any]) -> WaitingEntry:
    return WaitingEntry(
        id=int(row.id),
        resource_id=row.resource_id,
        user_id=row.user_id,
        quantity=int(row.quantity),
        created_at_ms=int(row.created_at_ms),
        status=WaitingStatus(row.status),
        until_ms=None if row.until_ms is None else int(row.until_ms),
        order_id=row.order_id,
        ended_at_ms=None if row.ended_at_ms is None else int(row.ended_at_ms),
    )


@dataclass(frozen=True, slots=True)
class Queue:
    """One resource's waiting list in short (:meth:`WaitingRecords.longest_queues`)."""

    resource_id: str
    #: Entries waiting.
    entries: int
    #: The units they ask for, in all.
    units: int
    #: When the oldest of them was queued.
    oldest_created_at_ms: int
    #: The resource's units free now (held and sold taken off; never below 0).
    free: int


@dataclass(frozen=True, slots=True)
class LongestQueues:
    queues: list[Queue]
    #: More entries wait than were read: the queues are ranked among the first ones only.
    capped: bool


class WaitingRecords:
    """Reads and writes ``oes_waiting`` (see the module docstring)."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def add(
        self,
        resource_id: str,
        user_id: str,
        quantity: int,
        until_ms: int | None,
        now_ms: int,
        actor: Actor,
    ) -> tuple[WaitingEntry, bool]:
        """Queue the user for the resource; the entry and True, or the user's entry already
        waiting there and False (nothing written)."""
        who = actor.columns()
        values = {
            "resource_id": resource_id,
            "user_id": user_id,
            "quantity": quantity,
            "until_ms": until_ms,
            "created_at_ms": now_ms,
            "status": WAITING,
            "added_by_kind": who["actor_kind"],
            "added_by": who["actor"],
        }
        dialect = postgresql if self.tx.dialect == "postgresql" else sqlite
        insert = (
            dialect.insert(waiting_table)
            .values(values)
            .on_conflict_do_nothing(index_elements=[W.resource_id, W.user_id], index_where=_WAITING)
            .returning(W.id)
        )
        mine = _ENTRY.where(W.resource_id == resource_id, W.user_id == user_id, _WAITING)
        for _ in range(ADD_ATTEMPTS):
            with self.tx.write() as conn:
                existing = conn.execute(mine).one_or_none()
                if existing is not None:
                    return _to_entry(existing), False
                added = conn.execute(insert).scalar_one_or_none()
                if added is None:  # a concurrent add won the unique index: read its row
                    existing = conn.execute(mine).one_or_none()
                    conn.rollback()
                    if existing is not None:
                        return _to_entry(existing), False
                    continue
                row = conn.execute(_ENTRY.where(W.id == added)).one()
                conn.commit()
                return _to_entry(row), True
        # Each attempt's entry left the queue between its insert and its read: give up.
        raise StoreUnavailable("sql", "the user's waiting entry kept changing; retry")

    def get(self, entry_id: int) -> WaitingEntry | None:
        with self.tx.read() as conn:
            row = conn.execute(_ENTRY.where(W.id == entry_id)).one_or_none()
        return None if row is None else _to_entry(row)

    def queue(self, resource_id: str, *, after_id: int = 0, limit: int) -> list[WaitingEntry]:
        """Up to ``limit`` entries waiting for the resource, first come first, those after
        the entry ``after_id`` (a page's last)."""
        query = (
            _ENTRY.where(W.resource_id == resource_id, _WAITING, W.id > after_id)
            .order_by(W.id)
            .limit(limit)
        )
        with self.tx.read() as conn:
            return [_to_entry(row) for row in conn.execute(query)]

    def with_waiting(self, resource_ids: Iterable[str]) -> list[str]:
        """Of ``resource_ids``, those with an entry waiting, in id order (one query)."""
        ids = sorted(set(resource_ids))
        if not ids:
            return []
        query = select(W.resource_id).where(W.resource_id.in_(ids), _WAITING).distinct()
        with self.tx.read() as conn:
            return sorted(conn.scalars(query))

    def to_serve(self, now_ms: int, limit: int) -> list[str]:
        """Up to ``limit`` resources with an entry waiting and either a unit free now, an
        entry past its ``until``, or an entry whose order exists already: what a crash
        between a release and its serve, or between an entry's order and its mark, left
        behind (the recovery pass; the last case is usual for a sold-out resource, whose
        last units the unmarked order took), in one query driven by the queues' partial
        index (and the orders' primary key)."""
        free = RC.capacity - RC.held - RC.sold
        offered = exists().where(
            orders_table.c.id == literal(WAITING_ORDER_PREFIX) + cast(W.id, String)
        )
        query = (
            select(W.resource_id)
            .join(resources_table, RC.id == W.resource_id)
            .where(_WAITING, (free > 0) | (W.until_ms <= now_ms) | offered)
            .distinct()
            .order_by(W.resource_id)
            .limit(limit)
        )
        with self.tx.read() as conn:
            return list(conn.scalars(query))

    def longest_queues(self, limit: int, *, among: int) -> LongestQueues:
        """The ``limit`` resources with the most entries waiting, most first (ties by id),
        with the units asked, the oldest entry's time and the units free now.

        Bounded by ``among``, not by the queues' size: one statement reads the first
        ``among`` waiting entries along the queues' partial index (resource, then arrival),
        one more step along it to tell whether any were left out (``capped``), and the
        resource rows of the ``limit`` shown by primary key. Past the bound, the resources
        after the first ``among`` entries are not ranked and the last one read is counted
        in part."""
        read = (
            select(W.resource_id, W.quantity, W.created_at_ms)
            .where(_WAITING)
            .order_by(W.resource_id, W.id)
            .limit(among)
            .subquery("read")
        )
        entries = func.count().label("entries")
        ranked = (
            select(
                read.c.resource_id,
                entries,
                func.sum(read.c.quantity).label("units"),
                func.min(read.c.created_at_ms).label("oldest_ms"),
            )
            .group_by(read.c.resource_id)
            .order_by(entries.desc(), read.c.resource_id)
            .limit(limit)
            .subquery("ranked")
        )
        left_out = select(W.id).where(_WAITING).order_by(W.resource_id, W.id).offset(among)
        free = RC.capacity - RC.held - RC.sold
        query = (
            select(
                ranked,
                case((free < 0, 0), else_=free).label("free"),
                left_out.limit(1).exists().label("capped"),
            )
            .join(resources_table, RC.id == ranked.c.resource_id)
            .order_by(ranked.c.entries.desc(), ranked.c.resource_id)
        )
        with self.tx.read() as conn:
            rows = conn.execute(query).all()
        queues = [
            Queue(
                resource_id=row.resource_id,
                entries=int(row.entries),
                units=int(row.units),
                oldest_created_at_ms=int(row.oldest_ms),
                free=int(row.free),
            )
            for row in rows
        ]
        return LongestQueues(queues, capped=any(bool(row.capped) for row in rows))

    def orders_present(self, order_ids: Sequence[str]) -> set[str]:
        """Of ``order_ids``, those SQL has an order of (whatever its status)."""
        if not order_ids:
            return set()
        query = select(orders_table.c.id).where(orders_table.c.id.in_(list(order_ids)))
        with self.tx.read() as conn:
            return set(conn.scalars(query))

    def leave(self, entry_id: int, now_ms: int) -> tuple[WaitingEntry | None, bool]:
        """Take the entry out of its queue (if it still waits): the entry as it then stands
        (None: no such entry), and whether this call took it out."""
        return self._end(entry_id, WaitingStatus.LEFT, now_ms, None)

    def mark_served(self, entry_id: int, order_id: str, now_ms: int) -> bool:
        """Record the order made for the entry; False when it no longer waited (served by
        another, left or expired meanwhile): nothing changed then."""
        return self._end(entry_id, WaitingStatus.SERVED, now_ms, order_id)[1]

    def _end(
        self, entry_id: int, status: WaitingStatus, now_ms: int, order_id: str | None
    ) -> tuple[WaitingEntry | None, bool]:
        """The compare-and-set out of ``waiting``: the entry after it, and whether it won."""
        cas = (
            update(waiting_table)
            .where(W.id == entry_id, _WAITING)
            .values(status=status.value, ended_at_ms=now_ms, order_id=order_id)
        )
        with self.tx.statements() as conn:
            won = conn.execute(cas).rowcount == 1
            row = conn.execute(_ENTRY.where(W.id == entry_id)).one_or_none()
            conn.commit()
        return (None if row is None else _to_entry(row)), won

    def expire(self, resource_id: str, now_ms: int) -> list[WaitingEntry]:
        """Drop the resource's entries whose ``until`` has passed (compare-and-set, so each
        once); the entries dropped."""
        cas = (
            update(waiting_table)
            .where(W.resource_id == resource_id, _WAITING, W.until_ms <= now_ms)
            .values(status=WaitingStatus.EXPIRED.value, ended_at_ms=now_ms)
            .returning(*_ENTRY.selected_columns)
        )
        with self.tx.statements() as conn:
            rows = conn.execute(cas).all()
            conn.commit()
        return sorted((_to_entry(row) for row in rows), key=lambda e: e.id)


def has_entries(conn: Connection, user_id: str) -> bool:
    """Whether any waiting-list entry is under ``user_id`` (an erasure's "seen" check)."""
    return bool(conn.scalar(select(exists().where(W.user_id == user_id))))


def forget_user(conn: Connection, user_id: str) -> int:
    """Delete every entry of the user (waiting or not), in the caller's transaction; how
    many. An entry names the user and nothing else worth keeping: its order, if served,
    keeps the record under the erasure's pseudonym."""
    return int(conn.execute(delete(waiting_table).where(W.user_id == user_id)).rowcount)
