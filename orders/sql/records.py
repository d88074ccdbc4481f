"""The SQL record: every statement the use cases run, built once, and rows as Order values.

Rules that hold for every method here:

* a transition out of ``unpaid`` is one compare-and-set ``UPDATE ... WHERE status =
  'unpaid'`` (:mod:`orders.sql.transitions`) that writes its ``order_events`` row in the
  same transaction, so an event exists exactly when its transition committed (an outbox);
* methods taking a ``conn`` run inside the caller's transaction and never commit; the
  others open and commit their own (``orders.sql.transactions``);
* the open and due predicates come from :mod:`orders.sql.models`, never written again here.

Statements on the create path are built once at import: building them per call (coercions
and cache keys) cost about as much client CPU as running them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    bindparam,
    func,
    select,
)

from orders.domain import Actor, NewOrder, Order, OrderStatus, Payment
from orders.errors import OrderNotFound
from orders.sql.inflight import CreatesInFlight
from orders.sql.models import orders_table
from orders.sql.predicates import (
    REMINDER_DUE_PREDICATE,
    UNPAID_PREDICATE,
    due_at,
    open_at,
    reminder_due_at,
)
from orders.sql.reconcile_reads import ReconcileReads
from orders.sql.slots import InsertConflict, LimitReachedInSql, SlotGuard
from orders.sql.transactions import Transactions
from orders.sql.transitions import (
    CANCEL,
    CLOSE_EXPIRED,
    EXPIRED_REASON,
    EXTEND_OPEN,
    PAY,
    PAY_LATE,
    PAY_STRICT,
    REOPEN_EXPIRED,
    Changed,
)
from orders.validation import amount_to_text

__all__ = [
    "EXPIRED_REASON",
    "BatchCommit",
    "InsertConflict",
    "LimitReachedInSql",
    "OrderRecords",
    "to_order",
]

ORDER = orders_table.c
#: Creates that find their slot taken by a racing create try again, a few times at most.
SLOT_RACE_RETRIES = 3


@dataclass(slots=True)
class BatchCommit:
    """What :meth:`OrderRecords.transition_all` did: the outcome of each attempt, and
    whether their transaction committed (None: cut off too close to the commit to tell)."""

    outcomes: list[tuple[Changed | None, bool]] = field(default_factory=list)
    committed: bool | None = False


def _driver_committed(driver: object) -> bool | None:
    """Whether the driver's connection has left its transaction (SQLite's sqlite3: its
    ``in_transaction``); None for a driver this cannot tell."""
    if isinstance(driver, sqlite3.Connection):
        return not driver.in_transaction
    return None


_SELECT_ORDER = select(*orders_table.c).where(ORDER.id == bindparam("oid"))
_SELECT_ORDER_FOR_UPDATE = _SELECT_ORDER.with_for_update()


def _current(conn: Connection, order_id: str) -> Changed | None:
    """The order's row as ``conn``'s transaction sees it (a transition lost), or None."""
    return conn.execute(_SELECT_ORDER, {"oid": order_id}).mappings().one_or_none()


def payment_data(payment: Payment) -> dict[str, Any]:
    """What a payment's event records of it: the reference, and the amount and currency
    when the payment stated them."""
    data: dict[str, Any] = {"payment_ref": payment.ref}
    if payment.amount is not None:
        data["amount"] = amount_to_text(payment.amount)
    if payment.currency is not None:
        data["currency"] = payment.currency
    return data


def to_order(row: Row[Any] | Mapping[Any, Any], read_at_ms: int) -> Order:
    """The order a row of ``oes_orders`` describes (a Row, or a mapping of its columns)."""
    m: Any = row if isinstance(row, Mapping) else _Columns(row)
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
        remind_at_ms=m["remind_at_ms"],
        reminded_at_ms=m["reminded_at_ms"],
        policy=m["policy"],
        holds={
            rid: tuple(h) if isinstance(h, list) else h for rid, h in (m["holds"] or {}).items()
        },
    )


class _Columns:
    """A Row's columns by name, read as its attributes (the Row's public access)."""

    __slots__ = ("row",)

    def __init__(self, row: Row[Any]) -> None:
        self.row = row

    def __getitem__(self, name: str) -> Any:
        return getattr(self.row, name)


class OrderRecords:
    """The orders table and its event outbox, over one engine."""

    def __init__(self, engine: Engine) -> None:
        self.tx = Transactions(engine)
        self.dialect = self.tx.dialect
        #: The read-only queries of reconcile.
        self.reads = ReconcileReads(self.tx)
        #: The SQL limit guard.
        self.slots = SlotGuard(self.tx)
        #: Whether a create with no row is over (a refusal's suspects, reconcile's extras).
        self.in_flight = CreatesInFlight(self.tx)

    @property
    def engine(self) -> Engine:
        return self.tx.engine

    # --- reading -----------------------------------------------------------------------

    def find(self, order_id: str, now_ms: int, host: Connection | None = None) -> Order | None:
        with self.tx.read(host) as conn:
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

    def earliest_reminder_ms(self) -> int | None:
        """When the first reminder still to be written is due (past ones included), or None."""
        query = select(func.min(ORDER.remind_at_ms)).where(REMINDER_DUE_PREDICATE)
        with self.tx.read() as conn:
            value: int | None = conn.scalar(query)
        return value

    def any_reminder_due(self, cutoff_ms: int) -> bool:
        query = select(ORDER.id).where(reminder_due_at(cutoff_ms)).limit(1)
        with self.tx.read() as conn:
            return conn.execute(query).first() is not None

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

    def transition_or_current(
        self,
        order_id: str,
        now_ms: int,
        attempt: Callable[[Connection], Changed | None],
        host: Connection | None = None,
    ) -> tuple[Order, bool]:
        """Run ``attempt`` (compare-and-sets) in one transaction and commit (with ``host``:
        in the host's transaction, left to the host to commit).

        Returns the order after it and whether ``attempt`` won; when it lost, the order as
        it stands, for the caller to decide what the loss means. Raises OrderNotFound.
        """
        with self.tx.statements(host) as conn:
            row = attempt(conn)
            current = row if row is not None else _current(conn, order_id)
            self.tx.commit(conn, host)
        if current is None:
            raise OrderNotFound(order_id)
        return to_order(current, now_ms), row is not None

    def transition_all(
        self,
        attempts: Sequence[tuple[str, Callable[[Connection], Changed | None]]],
        into: BatchCommit,
    ) -> None:
        """:meth:`transition_or_current` of several orders (order id, attempt), one after
        the other in one write transaction and one commit, into ``into``: for each, the row
        after its attempt (None: no such order) and whether it won. Two attempts at one
        order see each other, as two transactions one after the other would. Anything that
        fails rolls the whole transaction back.

        ``into.committed`` says whether the commit happened, even when this raises: an
        interrupt that lands just after the driver's commit (a KeyboardInterrupt raised
        when the C call returns) leaves it True, and the outcomes stand."""
        with self.tx.write() as conn:
            for order_id, attempt in attempts:
                row = attempt(conn)
                current = row if row is not None else _current(conn, order_id)
                into.outcomes.append((current, row is not None))
            driver = conn.connection.dbapi_connection
            into.committed = None  # from here until the driver answers: not known
            try:
                conn.commit()
            finally:
                # Read from the driver, not from SQLAlchemy's state, which an interrupt
                # between the two may have left behind.
                into.committed = _driver_committed(driver)

    def pay(
        self,
        conn: Connection,
        order_id: str,
        now_ms: int,
        payment: Payment,
        actor: Actor,
        *,
        strict: bool = False,
        late_window_ms: int | None = None,
    ) -> Changed | None:
        """Unpaid -> paid; under ``strict``, only while the expiry is still ahead. With
        ``late_window_ms``: closed by expiry at most that long before ``now_ms`` -> paid
        (late)."""
        params: dict[str, Any] = {"oid": order_id, "now_ms": now_ms, "ref": payment.ref}
        data = payment_data(payment)
        if late_window_ms is None:
            return (PAY_STRICT if strict else PAY).run(conn, params, data, actor)
        params["window_ms"] = late_window_ms
        return PAY_LATE.run(conn, params, {**data, "late": True}, actor)

    def cancel(
        self,
        conn: Connection,
        order_id: str,
        now_ms: int,
        reason: str | None,
        actor: Actor,
        *,
        replaced_by: str | None = None,
    ) -> Changed | None:
        """Unpaid -> cancelled; ``replaced_by``: the new order it made room for (its event
        names it)."""
        params = {"oid": order_id, "now_ms": now_ms, "reason": reason or "cancelled"}
        data = {"reason": reason} if reason else {}
        if replaced_by is not None:
            data["replaced_by"] = replaced_by
        return CANCEL.run(conn, params, data or None, actor)

    def extend_open(
        self,
        conn: Connection,
        order_id: str,
        now_ms: int,
        extra_ms: int,
        max_life_ms: int,
        actor: Actor,
    ) -> Changed | None:
        """Move an open order's expiry ``extra_ms`` later, within its maximum lifetime."""
        params = {
            "oid": order_id,
            "now_ms": now_ms,
            "extra_ms": extra_ms,
            "max_life_ms": max_life_ms,
        }
        return EXTEND_OPEN.run(conn, params, {"extra_ms": extra_ms}, actor)

    def reopen_expired(
        self,
        conn: Connection,
        order_id: str,
        expires_at_ms: int,
        now_ms: int,
        extra_ms: int,
        actor: Actor,
    ) -> Changed | None:
        """Give an unpaid order never extended before a new expiry (the pre-close check)."""
        params = {"oid": order_id, "now_ms": now_ms, "expires_at_ms": expires_at_ms}
        data = {"extra_ms": extra_ms, "trigger": "pre_close_check"}
        return REOPEN_EXPIRED.run(conn, params, data, actor)

    def close_expired(
        self, conn: Connection, order_id: str, now_ms: int, data: dict[str, Any], actor: Actor
    ) -> Changed | None:
        """Close one expired unpaid order in the caller's transaction (strict expiry)."""
        return CLOSE_EXPIRED.run(conn, {"oid": order_id, "now_ms": now_ms}, data, actor)

    def current(
        self, conn: Connection, order_id: str, now_ms: int, *, lock: bool = False
    ) -> Order | None:
        """The order as ``conn``'s transaction sees it; ``lock``: and hold its row until
        the transaction ends (PostgreSQL's FOR UPDATE; SQLite's write transaction holds
        the whole database already)."""
        query = _SELECT_ORDER_FOR_UPDATE if lock and self.dialect == "postgresql" else _SELECT_ORDER
        row = conn.execute(query, {"oid": order_id}).one_or_none()
        return None if row is None else to_order(row, now_ms)

    # --- the SQL limit guard (orders.sql.slots) --------------------------------------------

    def insert_guarded(self, new: NewOrder, host: Connection | None = None) -> Order:
        """Insert the order and its ``created`` event into a free slot of its user (with
        ``host``: in the host's transaction).

        Raises LimitReachedInSql when live orders hold all ``new.limit`` slots, or
        InsertConflict when a constraint refuses the row (the caller finds out whether the
        id exists).
        """
        live: dict[str, int] = {}
        # Each retry follows a slot freed or taken by someone else meanwhile: a few suffice.
        for _attempt in range(new.limit + SLOT_RACE_RETRIES):
            row = self.slots.insert(new, host)
            if row is not None:
                return to_order(row, new.created_at_ms)
            live = self.slots.make_room(new, host)
        raise LimitReachedInSql(live, new.limit, None)
