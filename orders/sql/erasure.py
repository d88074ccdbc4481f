"""The SQL of a user's erasure (:mod:`orders.rules.erasure`): what it reads first, and the
one transaction that puts the pseudonym in place of the user id.

Every statement runs in the caller's connection or transaction. The user's orders are found
by ``user_id`` (no index serves every status: a scan of ``oes_orders``, as fits an
operator's rare action), their events and refused payments by order id (indexed). Orders
still unpaid are left alone: the rule cancels them first, and one a create added since
stays under the user id (see the rule's docstring).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    JSON,
    Connection,
    Select,
    String,
    case,
    cast,
    delete,
    func,
    insert,
    literal,
    literal_column,
    null,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB

from orders.domain import ERASED_REASON, Actor, EventKind, OrderStatus
from orders.errors import RefundOwed
from orders.sql.inventory_tables import holds_table
from orders.sql.models import (
    events_table,
    orders_table,
    refusals_table,
    user_limit_history_table,
    user_limits_table,
)
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.refusals import PENDING
from orders.sql.waiting import forget_user, has_entries

ORDER = orders_table.c
EVENT = events_table.c
REFUSAL = refusals_table.c
LIMIT = user_limits_table.c
HISTORY = user_limit_history_table.c
#: The key of event data that names a payment (paid, payment_refused, a strict close).
PAYMENT_REF_KEY = "payment_ref"


@dataclass(frozen=True)
class ErasedRows:
    """What one erasure changed in SQL (or, read back from its ``erased`` event, what the
    erasure on record changed)."""

    #: Orders now under the pseudonym, their metadata and payment reference cleared.
    orders: int
    #: Of those, unpaid orders the erasure cancelled (close reason ``erased``).
    cancelled: int
    #: Events (and refused payments) moved to the pseudonym.
    events: int
    refusals: int
    #: Whether the user's own limit was deleted.
    limit_removed: bool

    def data(self, pseudonym: str) -> dict[str, Any]:
        """The ``erased`` event's data."""
        return {
            "pseudonym": pseudonym,
            "orders": self.orders,
            "cancelled": self.cancelled,
            "events": self.events,
            "refusals": self.refusals,
            "limit_removed": self.limit_removed,
        }

    @classmethod
    def of_data(cls, data: dict[str, Any]) -> ErasedRows:
        return cls(
            orders=int(data["orders"]),
            cancelled=int(data["cancelled"]),
            events=int(data["events"]),
            refusals=int(data["refusals"]),
            limit_removed=bool(data["limit_removed"]),
        )


def pending_refunds(conn: Connection, user_id: str) -> int:
    """How many refused payments of the user's orders nobody has marked handled."""
    query = select(func.count()).where(PENDING, REFUSAL.user_id == user_id)
    return int(conn.scalar(query) or 0)


def holds_rows(conn: Connection, user_id: str) -> bool:
    """Whether any order, an own limit or its history, or a waiting-list entry is still
    under ``user_id``."""
    for key in (ORDER.user_id, LIMIT.user_id, HISTORY.user_id):
        if conn.execute(select(key).where(key == user_id).limit(1)).first() is not None:
            return True
    return has_entries(conn, user_id)


def erasure_on_record(conn: Connection, pseudonym: str) -> ErasedRows | None:
    """The latest ``erased`` event under ``pseudonym``, as the counts it carries."""
    query = (
        select(EVENT.data)
        .where(EVENT.order_id.in_(_orders_of(pseudonym)), EVENT.kind == EventKind.ERASED.value)
        .order_by(EVENT.id.desc())
        .limit(1)
    )
    data = conn.scalar(query)
    return None if data is None else ErasedRows.of_data(data)


def erase_rows(
    conn: Connection, user_id: str, pseudonym: str, now_ms: int, actor: Actor
) -> ErasedRows:
    """Put ``pseudonym`` in place of ``user_id`` in the user's orders (but unpaid ones), their
    events and refused payments; clear the orders' metadata and payment references and the
    references in event data and refusals; delete the user's own limit and its history and
    waiting-list entries; write one ``erased`` event. In the caller's transaction, which
    commits it all or nothing.

    Raises RefundOwed when a refused payment of the user's is pending once the orders'
    rows are taken (on PostgreSQL they are then held, so a refusal that committed since the
    caller's first check is seen, and none can follow before the commit); the caller's
    transaction then rolls back.
    """
    moved = conn.execute(
        update(orders_table)
        .where(ORDER.user_id == user_id, ~UNPAID_PREDICATE)
        .values({ORDER.user_id: pseudonym, ORDER.metadata: null(), ORDER.payment_ref: null()})
    ).rowcount
    owed = pending_refunds(conn, user_id)
    if owed:
        raise RefundOwed(user_id, owed)
    ours = _orders_of(pseudonym)
    events = conn.execute(
        update(events_table)
        .where(EVENT.order_id.in_(ours), EVENT.user_id == user_id)
        .values(user_id=pseudonym)
    ).rowcount
    conn.execute(
        update(events_table)
        .where(EVENT.order_id.in_(ours), _names_payment(conn))
        .values(data=_without_payment_ref(conn))
    )
    refusals = conn.execute(
        update(refusals_table)
        .where(REFUSAL.order_id.in_(ours), REFUSAL.user_id == user_id)
        .values(
            user_id=pseudonym,
            # Part of the key: each keeps one of its own, naming nothing outside.
            payment_ref=case(
                (REFUSAL.payment_ref == "", ""),
                else_=literal("erased-") + cast(REFUSAL.event_id, String),
            ),
        )
    ).rowcount
    # What its orders held or bought goes under the pseudonym with them.
    conn.execute(
        update(holds_table)
        .where(holds_table.c.order_id.in_(ours), holds_table.c.user_id == user_id)
        .values(user_id=pseudonym)
    )
    limit_removed = conn.execute(delete(user_limits_table).where(LIMIT.user_id == user_id))
    conn.execute(delete(user_limit_history_table).where(HISTORY.user_id == user_id))
    forget_user(conn, user_id)  # waiting-list entries: they name the user, nothing more
    cancelled = conn.scalar(
        select(func.count()).where(
            ORDER.user_id == pseudonym,
            ORDER.status == OrderStatus.CANCELLED.value,
            ORDER.close_reason == ERASED_REASON,
        )
    )
    rows = ErasedRows(
        orders=moved,
        cancelled=int(cancelled or 0),
        events=events,
        refusals=refusals,
        limit_removed=limit_removed.rowcount > 0,
    )
    _record_erasure(conn, pseudonym, rows, now_ms, actor)
    return rows


def _orders_of(user_id: str) -> Select[tuple[str]]:
    """The ids of the user's orders, for ``IN``."""
    return select(ORDER.id).where(ORDER.user_id == user_id)


def _record_erasure(
    conn: Connection, pseudonym: str, rows: ErasedRows, now_ms: int, actor: Actor
) -> None:
    """The ``erased`` event, on the user's latest order (an event belongs to an order): none
    when no order is left to carry it (a user who had only an own limit)."""
    carrier = conn.scalar(
        select(ORDER.id)
        .where(ORDER.user_id == pseudonym)
        .order_by(ORDER.created_at_ms.desc(), ORDER.id.desc())
        .limit(1)
    )
    if carrier is None:
        return
    conn.execute(
        insert(events_table).values(
            order_id=carrier,
            user_id=pseudonym,
            kind=EventKind.ERASED.value,
            at_ms=now_ms,
            data=rows.data(pseudonym),
            **actor.columns(),
        )
    )


def _names_payment(conn: Connection) -> Any:
    """Event data holding a payment reference (as an object key)."""
    if conn.dialect.name == "postgresql":
        return cast(EVENT.data, JSONB).has_key(PAYMENT_REF_KEY)
    return func.json_type(EVENT.data, f"$.{PAYMENT_REF_KEY}").is_not(None)


def _without_payment_ref(conn: Connection) -> Any:
    """The event's data with its payment reference set to null (the key stays, as for a
    payment that gave none)."""
    if conn.dialect.name == "postgresql":
        path: Any = literal_column(f"ARRAY['{PAYMENT_REF_KEY}']")
        replaced = func.jsonb_set(
            cast(EVENT.data, JSONB), path, literal_column("'null'::jsonb"), False
        )
        return cast(replaced, JSON)
    return func.json_replace(EVENT.data, f"$.{PAYMENT_REF_KEY}", null())
