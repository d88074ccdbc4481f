"""Refused payments: the refunds owed, in SQL alone.

When ``mark_paid`` refuses a payment (the order closed, cancelled, paid under another
reference, or the amount is not the order's), the transaction that decides it writes a
``payment_refused`` event and a row of ``oes_payment_refusals`` naming the order, the
payment reference, what the payment said it was and why it was refused. Both commit
before the caller hears of the refusal, so a payment callback that dies right after
leaves the refund findable; :func:`list_refusals` is that list (``orders payments
refused``), :func:`refunds_owed` the dashboard's bounded summary of the pending ones, and
:func:`mark_handled` is how a refund consumer or an operator says a refund was dealt with.

One row per (order, reference): the same payment refused twice finds its row, under the
order's row lock (PostgreSQL) or the write lock (SQLite), and writes nothing more. A
payment for an order SQL does not hold (:func:`record_unknown_order`) has no lock to take:
its row is inserted unless one with its key exists, in one statement. It names no user and
has no event (an event belongs to an order), so only this list and the dashboard show it,
not the ``payment_refused`` consumers.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, Engine, Row, bindparam, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite

from orders.domain import Actor, EventKind, Order, Payment, RefusalReason
from orders.errors import InvalidInput, RefusalPosition
from orders.sql.failures import sql_errors
from orders.sql.models import events_table, refusals_table
from orders.sql.records import payment_data
from orders.validation import amount_to_text, check_count

RC = refusals_table.c
EC = events_table.c
#: The refunds nobody has marked handled yet: the predicate of the pending partial index,
#: as the column test itself (no bound parameter), so every plan can use that index.
PENDING = RC.handled_at_ms.is_(None)

_FIND = (
    select(RC.event_id, EC.txid)
    .select_from(refusals_table)
    .outerjoin(events_table, EC.id == RC.event_id)
    .where(RC.order_id == bindparam("oid"), RC.payment_ref == bindparam("ref"))
)
_INSERT_EVENT = insert(events_table).returning(EC.id, EC.txid)
_INSERT_REFUSAL = insert(refusals_table)


@dataclass(frozen=True, slots=True)
class PaymentRefusal:
    """A refused payment: the refund owed for it, and whether someone handled it."""

    order_id: str
    #: None for an order SQL did not hold (``unknown_order``).
    user_id: str | None
    #: The payment's reference; None when the payment gave none.
    payment_ref: str | None
    reason: RefusalReason
    amount: Decimal | None
    currency: str | None
    refused_at_ms: int
    #: Where its ``payment_refused`` event stands: (transaction id, event id); None when
    #: it has none (``unknown_order``).
    position: RefusalPosition | None
    handled_at_ms: int | None = None
    handled_by: Actor | None = None

    @property
    def handled(self) -> bool:
        return self.handled_at_ms is not None


def record_refusal(
    conn: Connection,
    order: Order,
    payment: Payment,
    reason: RefusalReason,
    now_ms: int,
    actor: Actor,
) -> RefusalPosition:
    """Record that ``payment`` was refused for ``order``, in ``conn``'s transaction (the one
    that decided it, holding the order's lock); the position of its ``payment_refused``
    event. A payment already recorded keeps its first record: its position is returned."""
    ref = payment.ref or ""
    found = conn.execute(_FIND, {"oid": order.id, "ref": ref}).one_or_none()
    if found is not None:
        return (found.txid or 0, found.event_id)
    data = {**payment_data(payment), "reason": reason.value}
    event = conn.execute(
        _INSERT_EVENT,
        {
            "order_id": order.id,
            "user_id": order.user_id,
            "kind": EventKind.PAYMENT_REFUSED.value,
            "at_ms": now_ms,
            "data": data,
            **actor.columns(),
        },
    ).one()
    values = _refusal_values(order.id, payment, reason, now_ms)
    conn.execute(_INSERT_REFUSAL, {**values, "user_id": order.user_id, "event_id": event.id})
    return (event.txid or 0, event.id)


def record_unknown_order(conn: Connection, order_id: str, payment: Payment, now_ms: int) -> None:
    """Record that ``payment`` was refused because no order ``order_id`` is held, in
    ``conn``'s transaction; a payment already recorded keeps its first record."""
    values = _refusal_values(order_id, payment, RefusalReason.UNKNOWN_ORDER, now_ms)
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    conn.execute(dialect.insert(refusals_table).values(values).on_conflict_do_nothing())


def _refusal_values(
    order_id: str, payment: Payment, reason: RefusalReason, now_ms: int
) -> dict[str, Any]:
    return {
        "order_id": order_id,
        "payment_ref": payment.ref or "",
        "reason": reason.value,
        "amount": amount_to_text(payment.amount),
        "currency": payment.currency,
        "refused_at_ms": now_ms,
    }


def list_refusals(
    engine: Engine,
    *,
    since_ms: int | None = None,
    pending_only: bool = False,
    limit: int = 100,
) -> list[PaymentRefusal]:
    """Refused payments, oldest first: those refused at or after ``since_ms`` (all when
    None); ``pending_only``: only the refunds nobody has marked handled."""
    check_count("limit", limit, 1, 10_000)
    query = (
        select(refusals_table, EC.txid)
        .outerjoin(events_table, EC.id == RC.event_id)
        .order_by(RC.refused_at_ms, RC.order_id, RC.payment_ref)
        .limit(limit)
    )
    if since_ms is not None:
        query = query.where(RC.refused_at_ms >= check_count("since_ms", since_ms, 0))
    if pending_only:
        query = query.where(PENDING)
    with sql_errors(), engine.connect() as conn:
        return [_refusal(row) for row in conn.execute(query)]


@dataclass(frozen=True, slots=True)
class RefundsOwed:
    """The refunds still owed, as an overview shows them: bounded reads of the pending
    partial index, whatever the table's size."""

    #: How many are pending, counted up to the cap (``capped``: at least that many).
    count: int
    capped: bool
    #: When the oldest pending one was refused; None when none is pending.
    oldest_refused_at_ms: int | None
    #: The latest pending ones, newest first.
    newest: list[PaymentRefusal]


def refunds_owed(engine: Engine, *, cap: int, newest: int) -> RefundsOwed:
    """The refunds owed: their count up to ``cap``, the oldest's refusal time, and the
    ``newest`` latest (ties in ``refused_at_ms`` at the edge of that list fall either way).

    Two statements, each a range of the pending partial index under a limit: the count and
    the oldest come from its first ``cap`` entries in refusal order (the first is the
    oldest), the newest from its last ``newest`` entries, each then joined to its event by key.
    """
    check_count("cap", cap, 1)
    check_count("newest", newest, 1, 10_000)
    first = select(RC.refused_at_ms).where(PENDING).order_by(RC.refused_at_ms).limit(cap)
    counted = first.subquery()
    summary = select(func.count(), func.min(counted.c.refused_at_ms)).select_from(counted)
    last = (
        select(refusals_table)
        .where(PENDING)
        .order_by(RC.refused_at_ms.desc())
        .limit(newest)
        .subquery()
    )
    latest = (
        select(last, EC.txid)
        .outerjoin(events_table, EC.id == last.c.event_id)
        .order_by(last.c.refused_at_ms.desc(), last.c.order_id, last.c.payment_ref)
    )
    with sql_errors(), engine.connect() as conn:
        count, oldest_ms = conn.execute(summary).one()
        rows = conn.execute(latest).all()
    return RefundsOwed(
        count=int(count),
        capped=count >= cap,
        oldest_refused_at_ms=oldest_ms,
        newest=[_refusal(row) for row in rows],
    )


def mark_handled(
    engine: Engine, order_id: str, payment_ref: str | None, actor: Actor, now_ms: int
) -> PaymentRefusal:
    """Mark the refund of this refused payment handled, by ``actor``; the record as it
    stands after. Marking it again changes nothing (the first handler is kept).
    InvalidInput when no refused payment has that order and reference."""
    key = (RC.order_id == order_id) & (RC.payment_ref == (payment_ref or ""))
    handle = (
        update(refusals_table)
        .where(key, PENDING)
        .values(handled_at_ms=now_ms, handled_by_kind=actor.kind.value, handled_by=actor.name)
    )
    read = select(refusals_table, EC.txid).outerjoin(events_table, EC.id == RC.event_id)
    with sql_errors(), engine.begin() as conn:
        conn.execute(handle)
        row = conn.execute(read.where(key)).one_or_none()
    if row is None:
        raise InvalidInput("payment_ref", "no refused payment of that order has this reference")
    return _refusal(row)


def _refusal(row: Row[Any]) -> PaymentRefusal:
    return PaymentRefusal(
        order_id=row.order_id,
        user_id=row.user_id,
        payment_ref=row.payment_ref or None,
        reason=RefusalReason(row.reason),
        amount=None if row.amount is None else Decimal(row.amount),
        currency=row.currency,
        refused_at_ms=row.refused_at_ms,
        position=None if row.event_id is None else (row.txid or 0, row.event_id),
        handled_at_ms=row.handled_at_ms,
        handled_by=Actor.from_columns(row.handled_by_kind, row.handled_by),
    )
