"""The SQL record: every statement the use cases run, built once, and rows as Order values.

Rules that hold for every method here:

* a transition out of ``unpaid`` is one compare-and-set ``UPDATE ... WHERE status =
  'unpaid'`` (:meth:`OrderRecords.transition`) that writes its ``order_events`` row in the
  same transaction, so an event exists exactly when its transition committed (an outbox);
* methods taking a ``conn`` run inside the caller's transaction and never commit; the
  others open and commit their own (``orders.transactions``);
* the open and due predicates come from :mod:`orders.models`, never written again here.

Statements on the create path are built once at import: building them per call (coercions
and cache keys) cost about as much client CPU as running them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    bindparam,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError

from orders.domain import EventKind, Order, OrderStatus
from orders.errors import OrderNotFound
from orders.models import UNPAID_PREDICATE, due_at, events_table, open_at, orders_table
from orders.record_reads import ReconcileReads
from orders.transactions import Transactions

ORDER = orders_table.c
EXPIRED_REASON = "expired"

_GUARD_COUNT = select(func.count(), func.min(ORDER.expires_at_ms)).where(
    ORDER.user_id == bindparam("uid"),
    open_at(bindparam("now_ms")),
    ORDER.id != bindparam("oid"),  # a retry must not count its own order
)
_INSERT_ORDER = insert(orders_table).returning(*orders_table.c)
_INSERT_EVENT = insert(events_table)
_SELECT_ORDER = select(*orders_table.c).where(ORDER.id == bindparam("oid"))


class InsertConflict(Exception):
    """The database refused a create's insert (a duplicate id, or another constraint)."""


class LimitReachedInSql(Exception):
    """The SQL guard counted ``limit`` open orders for the user (the caller turns this into
    :class:`~orders.errors.UnpaidOrderLimitReached`)."""

    def __init__(self, open_count: int, earliest_ms: int | None) -> None:
        super().__init__(open_count, earliest_ms)
        self.open_count = open_count
        self.earliest_ms = earliest_ms


def to_order(row: Row[Any], read_at_ms: int) -> Order:
    m = row._mapping
    amount = m["amount"]
    return Order(
        id=m["id"],
        user_id=m["user_id"],
        status=OrderStatus(m["status"]),
        created_at_ms=m["created_at_ms"],
        expires_at_ms=m["expires_at_ms"],
        read_at_ms=read_at_ms,
        amount=None if amount is None else Decimal(amount),
        currency=m["currency"],
        paid_at_ms=m["paid_at_ms"],
        closed_at_ms=m["closed_at_ms"],
        close_reason=m["close_reason"],
        payment_ref=m["payment_ref"],
        metadata=dict(m["metadata"] or {}),
        extensions=m["extensions"],
    )


class OrderRecords:
    """The orders table and its event outbox, over one engine."""

    def __init__(self, engine: Engine, *, lock_users: bool = True) -> None:
        self.tx = Transactions(engine, lock_users=lock_users)
        self.dialect = self.tx.dialect
        #: The read-only queries of reconcile.
        self.reads = ReconcileReads(self.tx)

    @property
    def engine(self) -> Engine:
        return self.tx.engine

    # --- reading -----------------------------------------------------------------------

    def find(self, order_id: str, now_ms: int) -> Order | None:
        with self.tx.read() as conn:
            row = conn.execute(_SELECT_ORDER, {"oid": order_id}).one_or_none()
        return None if row is None else to_order(row, now_ms)

    def list_open(self, user_id: str, now_ms: int) -> list[Order]:
        """The user's open orders, soonest expiry first."""
        query = (
            select(*orders_table.c)
            .where(ORDER.user_id == user_id, open_at(now_ms))
            .order_by(ORDER.expires_at_ms, ORDER.id)
        )
        with self.tx.read() as conn:
            return [to_order(row, now_ms) for row in conn.execute(query)]

    def earliest_unpaid_expiry_ms(self) -> int | None:
        """The expiry of the unpaid order due first (overdue ones included), or None."""
        query = select(func.min(ORDER.expires_at_ms)).where(UNPAID_PREDICATE)
        with self.tx.read() as conn:
            value: int | None = conn.scalar(query)
        return value

    def count_due(self, cutoff_ms: int) -> int:
        query = select(func.count()).select_from(orders_table).where(due_at(cutoff_ms))
        with self.tx.read() as conn:
            return int(conn.scalar(query) or 0)

    def any_due(self, cutoff_ms: int) -> bool:
        query = select(ORDER.id).where(due_at(cutoff_ms)).limit(1)
        with self.tx.read() as conn:
            return conn.execute(query).first() is not None

    def due_not_extended(self, cutoff_ms: int, limit: int) -> list[Order]:
        """The next due orders that were never extended (the pre-close check asks about them)."""
        query = (
            select(*orders_table.c)
            .where(due_at(cutoff_ms), ORDER.extensions == 0)
            .order_by(ORDER.expires_at_ms)
            .limit(limit)
        )
        with self.tx.read() as conn:
            return [to_order(row, cutoff_ms) for row in conn.execute(query)]

    # --- writing -----------------------------------------------------------------------

    def record(
        self,
        conn: Connection,
        orders: Sequence[tuple[str, str]],
        kind: EventKind,
        at_ms: int,
        data: dict[str, Any] | None,
    ) -> None:
        """Write one event per (order id, user id), in the caller's transaction."""
        rows = [
            {"order_id": oid, "user_id": uid, "kind": kind.value, "at_ms": at_ms, "data": data}
            for oid, uid in orders
        ]
        if len(rows) == 1:
            conn.execute(_INSERT_EVENT, rows[0])  # one row: no executemany machinery
        elif rows:
            conn.execute(_INSERT_EVENT, rows)

    def transition(
        self,
        conn: Connection,
        *,
        conditions: Sequence[Any],
        kind: EventKind,
        now_ms: int,
        values: Mapping[str, Any],
        event_data: dict[str, Any] | None,
    ) -> Row[Any] | None:
        """One compare-and-set UPDATE; records the event if it won. None if it lost."""
        row = conn.execute(
            update(orders_table)
            .where(*conditions)
            .values(updated_at_ms=now_ms, **values)
            .returning(*orders_table.c)
        ).one_or_none()
        if row is not None:
            self.record(conn, [(row.id, row.user_id)], kind, now_ms, event_data)
        return row

    def transition_or_current(
        self,
        order_id: str,
        now_ms: int,
        attempt: Callable[[Connection], Row[Any] | None],
        *,
        user_lock: str | None = None,
    ) -> tuple[Order, bool]:
        """Run ``attempt`` (compare-and-sets) in one transaction and commit.

        Returns the order after it and whether ``attempt`` won; when it lost, the order as
        it stands, for the caller to decide what the loss means. Raises OrderNotFound.
        """
        with self.tx.write(user_lock=user_lock) as conn:
            row = attempt(conn)
            current = row or conn.execute(_SELECT_ORDER, {"oid": order_id}).one_or_none()
            conn.commit()
        if current is None:
            raise OrderNotFound(order_id)
        return to_order(current, now_ms), row is not None

    def pay(
        self, conn: Connection, order_id: str, now_ms: int, ref: str | None, *, strict: bool
    ) -> Row[Any] | None:
        """Unpaid -> paid; under ``strict``, only while the expiry is still ahead."""
        return self.transition(
            conn,
            conditions=[ORDER.id == order_id, open_at(now_ms) if strict else UNPAID_PREDICATE],
            kind=EventKind.PAID,
            now_ms=now_ms,
            values={"status": OrderStatus.PAID.value, "paid_at_ms": now_ms, "payment_ref": ref},
            event_data={"payment_ref": ref},
        )

    def cancel(
        self, conn: Connection, order_id: str, now_ms: int, reason: str | None
    ) -> Row[Any] | None:
        """Unpaid -> cancelled."""
        return self.transition(
            conn,
            conditions=[ORDER.id == order_id, UNPAID_PREDICATE],
            kind=EventKind.CANCELLED,
            now_ms=now_ms,
            values={
                "status": OrderStatus.CANCELLED.value,
                "closed_at_ms": now_ms,
                "close_reason": reason or "cancelled",
            },
            event_data={"reason": reason} if reason else None,
        )

    def extend_open(
        self, conn: Connection, order_id: str, now_ms: int, extra_ms: int, max_life_ms: int
    ) -> Row[Any] | None:
        """Move an open order's expiry ``extra_ms`` later, within its maximum lifetime."""
        return self.transition(
            conn,
            conditions=[
                ORDER.id == order_id,
                open_at(now_ms),
                ORDER.expires_at_ms + extra_ms - ORDER.created_at_ms <= max_life_ms,
            ],
            kind=EventKind.EXTENDED,
            now_ms=now_ms,
            values={
                "expires_at_ms": ORDER.expires_at_ms + extra_ms,
                "extensions": ORDER.extensions + 1,
            },
            event_data={"extra_ms": extra_ms},
        )

    def reopen_expired(
        self, conn: Connection, order_id: str, expires_at_ms: int, now_ms: int, extra_ms: int
    ) -> Row[Any] | None:
        """Give an unpaid order never extended before a new expiry (the pre-close check)."""
        return self.transition(
            conn,
            conditions=[ORDER.id == order_id, UNPAID_PREDICATE, ORDER.extensions == 0],
            kind=EventKind.EXTENDED,
            now_ms=now_ms,
            values={"expires_at_ms": expires_at_ms, "extensions": ORDER.extensions + 1},
            event_data={"extra_ms": extra_ms, "trigger": "pre_close_check"},
        )

    def close_expired(
        self, conn: Connection, order_id: str, now_ms: int, data: dict[str, Any]
    ) -> Row[Any] | None:
        """Close one expired unpaid order in the caller's transaction (strict expiry)."""
        return self.transition(
            conn,
            conditions=[ORDER.id == order_id, due_at(now_ms)],
            kind=EventKind.CLOSED,
            now_ms=now_ms,
            values={
                "status": OrderStatus.CLOSED.value,
                "closed_at_ms": now_ms,
                "close_reason": EXPIRED_REASON,
            },
            event_data=data,
        )

    # --- the SQL limit guard -------------------------------------------------------------

    def check_room(
        self, conn: Connection, user_id: str, limit: int, now_ms: int, order_id: str
    ) -> None:
        """Raise LimitReachedInSql if the user holds ``limit`` open orders besides this one.

        Exact only inside a transaction opened with ``user_lock=user_id``.
        """
        params = {"uid": user_id, "now_ms": now_ms, "oid": order_id}
        open_count, earliest = conn.execute(_GUARD_COUNT, params).one()
        if open_count >= limit:
            raise LimitReachedInSql(open_count, earliest)

    def insert_guarded(self, values: Mapping[str, Any], limit: int, now_ms: int) -> Order:
        """Insert the order and its ``created`` event unless the SQL guard refuses.

        Raises LimitReachedInSql, or InsertConflict when a constraint refuses the row (the
        caller finds out whether the id exists).
        """
        uid = values["user_id"]
        with self.tx.write(user_lock=uid) as conn:
            self.check_room(conn, uid, limit, now_ms, values["id"])
            try:
                row = conn.execute(_INSERT_ORDER, dict(values)).one()
                self.record(conn, [(values["id"], uid)], EventKind.CREATED, now_ms, None)
                conn.commit()
            except IntegrityError as exc:
                raise InsertConflict(values["id"]) from exc
        return to_order(row, now_ms)

    # --- reconcile (read-only: orders.record_reads) -------------------------------------

    def users_with_open(self, now_ms: int, after: str, limit: int) -> list[str]:
        return self.reads.users_with_open(now_ms, after, limit)

    def open_by_user(self, user_ids: Sequence[str], now_ms: int) -> dict[str, dict[str, int]]:
        return self.reads.open_by_user(user_ids, now_ms)

    def open_owners(self, order_ids: Sequence[str], now_ms: int) -> dict[str, str | None]:
        return self.reads.open_owners(order_ids, now_ms)
