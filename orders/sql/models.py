"""The SQL record: the ``oes_orders`` table and its ``oes_order_events`` outbox.

Timestamps are integer milliseconds since the epoch (BIGINT), the very integers used as
Redis scores, so the two stores never disagree by a rounding.
"""

from __future__ import annotations

from typing import Any, cast

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from orders.domain import ACTOR_MAX_LENGTH, EventKind, OrderStatus
from orders.sql import inventory_tables
from orders.sql.base import (
    CANCELLED_SQL,
    CLOSED_SQL,
    ORDER_ID_COLUMN_LENGTH,
    PAID_SQL,
    PENDING_SQL,
    POLICY_NAME_COLUMN_LENGTH,
    REMINDED_SQL,
    REMINDER_DUE_SQL,
    RETRYING_SQL,
    TEXT_COLUMN_LENGTH,
    UNPAID_SQL,
    USER_ID_COLUMN_LENGTH,
    Base,
    EventId,
    in_values,
    partial_index,
)
from orders.validation import USER_LIMIT_MAX


class OrderRow(Base):
    __tablename__ = "oes_orders"

    id: Mapped[str] = mapped_column(String(ORDER_ID_COLUMN_LENGTH), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    status: Mapped[str] = mapped_column(String(16))
    amount: Mapped[str | None] = mapped_column(String(40))
    currency: Mapped[str | None] = mapped_column(String(3))
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    expires_at_ms: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)
    paid_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    closed_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    close_reason: Mapped[str | None] = mapped_column(String(TEXT_COLUMN_LENGTH))
    payment_ref: Mapped[str | None] = mapped_column(String(TEXT_COLUMN_LENGTH))
    order_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    #: How often the expiry was moved (extend_order, the pre-close check).
    extensions: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    #: While unpaid: which of its user's ``limit`` slots the order holds (the SQL guard).
    slot: Mapped[int | None] = mapped_column(Integer)
    #: The expiry policy it was created under (NULL: the settings' defaults).
    policy: Mapped[str | None] = mapped_column(String(POLICY_NAME_COLUMN_LENGTH))
    #: When the sweep writes its ``expiring`` event (NULL: none due), and when it did.
    remind_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    reminded_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    #: What it holds of counted resources, as the create asked (resource id -> units; NULL:
    #: nothing). The ``oes_holds`` rows say what each unit is now; this names them in the
    #: order's events without a join.
    holds: Mapped[dict[str, int] | None] = mapped_column(JSON(none_as_null=True))

    __table_args__ = (
        CheckConstraint(f"status IN ({in_values(OrderStatus)})", name="status"),
        CheckConstraint("expires_at_ms > created_at_ms", name="expiry_after_creation"),
        # Partial indexes over unpaid orders only: they stay small however many paid and
        # closed orders pile up. The sweep finds due orders in expiry order with the first;
        # the limit guard and list_unpaid find one user's orders with the second.
        partial_index("ix_oes_orders_unpaid_expires_at_ms", "expires_at_ms", where=UNPAID_SQL),
        partial_index(
            "ix_oes_orders_unpaid_user_id_expires_at_ms",
            "user_id",
            "expires_at_ms",
            where=UNPAID_SQL,
        ),
        # The SQL side of the unpaid limit: an unpaid order holds one of its user's slots
        # 1..limit, and no two unpaid orders of a user hold the same one.
        partial_index(
            "ix_oes_orders_unpaid_user_id_slot", "user_id", "slot", where=UNPAID_SQL, unique=True
        ),
        # The reminders still due, in the order the sweep writes them.
        partial_index(
            "ix_oes_orders_reminder_due_remind_at_ms", "remind_at_ms", where=REMINDER_DUE_SQL
        ),
        # The reminders written, by when: the stats count those of a time window.
        partial_index(
            "ix_oes_orders_reminded_reminded_at_ms", "reminded_at_ms", where=REMINDED_SQL
        ),
        # Partial indexes over each terminal status, on the time of its transition: the
        # stats count what happened in a time window (and read the close lags) from these
        # alone. expires_at_ms is a key column of the closed one so that both engines read
        # the lag from the index without visiting the table.
        partial_index("ix_oes_orders_paid_paid_at_ms", "paid_at_ms", where=PAID_SQL),
        partial_index("ix_oes_orders_cancelled_closed_at_ms", "closed_at_ms", where=CANCELLED_SQL),
        partial_index(
            "ix_oes_orders_closed_closed_at_ms_expires_at_ms",
            "closed_at_ms",
            "expires_at_ms",
            where=CLOSED_SQL,
        ),
    )


class OrderEventRow(Base):
    """One row per transition, written in the transaction that made it (an outbox)."""

    __tablename__ = "oes_order_events"

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    order_id: Mapped[str] = mapped_column(
        String(ORDER_ID_COLUMN_LENGTH), ForeignKey("oes_orders.id", ondelete="CASCADE")
    )
    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    kind: Mapped[str] = mapped_column(String(16))
    at_ms: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    #: Who caused it (an ``orders.domain.ActorKind``) and the name they gave; both NULL on
    #: events written before migration 0008.
    actor_kind: Mapped[str | None] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))
    #: PostgreSQL: the writing transaction's id (column default txid_current()), so a
    #: consumer can read only events no running transaction can still precede. SQLite has
    #: one writer at a time: ids are already in commit order, and this stays NULL.
    txid: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint(f"kind IN ({in_values(EventKind)})", name="kind"),
        Index("ix_oes_order_events_order_id", "order_id"),
        Index("ix_oes_order_events_txid_id", "txid", "id"),
        {"sqlite_autoincrement": True},
    )


class PaymentRefusalRow(Base):
    """A payment ``mark_paid`` refused: a refund is owed until someone marks it handled.

    One row per (order, payment reference), written in the transaction that refused the
    payment, beside its ``payment_refused`` event: the same payment refused again finds
    its row and writes nothing. A payment without a reference has ``payment_ref`` ''
    (one row per order: without a reference two payments cannot be told apart).
    No foreign key: a refusal outlives its order (retention deletes only handled ones with
    it), and one for an order SQL does not hold has no user and no event (NULL).
    """

    __tablename__ = "oes_payment_refusals"

    order_id: Mapped[str] = mapped_column(String(ORDER_ID_COLUMN_LENGTH), primary_key=True)
    payment_ref: Mapped[str] = mapped_column(String(TEXT_COLUMN_LENGTH), primary_key=True)
    user_id: Mapped[str | None] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    #: An ``orders.domain.RefusalReason``.
    reason: Mapped[str] = mapped_column(String(32))
    #: What the payment said it was (NULL when it did not say).
    amount: Mapped[str | None] = mapped_column(String(40))
    currency: Mapped[str | None] = mapped_column(String(3))
    refused_at_ms: Mapped[int] = mapped_column(BigInteger)
    #: The ``payment_refused`` event (its position is (event's txid, event_id)).
    event_id: Mapped[int | None] = mapped_column(BigInteger)
    #: Set when a consumer or an operator marked the refund handled, with who did it.
    handled_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    handled_by_kind: Mapped[str | None] = mapped_column(String(16))
    handled_by: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))

    __table_args__ = (
        Index("ix_oes_payment_refusals_refused_at_ms", "refused_at_ms"),
        # Partial, over the refunds still owed: the list an operator works through.
        partial_index(
            "ix_oes_payment_refusals_pending_refused_at_ms", "refused_at_ms", where=PENDING_SQL
        ),
    )


class UserLimitRow(Base):
    """A user whose unpaid limit is not the settings' one (0: may hold no unpaid order)."""

    __tablename__ = "oes_user_limits"

    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH), primary_key=True)
    unpaid_limit: Mapped[int] = mapped_column(Integer)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)
    #: Who set it (an ``orders.domain.ActorKind``) and the name they gave.
    actor_kind: Mapped[str | None] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))

    __table_args__ = (
        CheckConstraint(
            f"unpaid_limit >= 0 AND unpaid_limit <= {USER_LIMIT_MAX}", name="unpaid_limit_range"
        ),
    )


class UserLimitChangeRow(Base):
    """Append-only: each set (``unpaid_limit``) or clear (NULL) of a user's own limit, written
    in the transaction of the change. Kept until the user's erasure deletes it."""

    __tablename__ = "oes_user_limit_history"

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    unpaid_limit: Mapped[int | None] = mapped_column(Integer)
    changed_at_ms: Mapped[int] = mapped_column(BigInteger)
    actor_kind: Mapped[str | None] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))

    __table_args__ = (Index("ix_oes_user_limit_history_user_id_id", "user_id", "id"),)


class PauseRow(Base):
    """An incident pause (``orders pause``): while one is open (``open_marker`` true, unique,
    so at most one row has it), nothing is closed or reminded by expiry. ``resumed_at_ms``
    fixes its length when a resume begins; the resume then moves every unpaid order's expiry
    in batches (``shift_cursor``: the last order id done, ``shifted``: how many), and closes
    the pause (``open_marker`` NULL, ``ended_at_ms``) when all are done.
    """

    __tablename__ = "oes_pauses"

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    reason: Mapped[str] = mapped_column(String(TEXT_COLUMN_LENGTH))
    started_at_ms: Mapped[int] = mapped_column(BigInteger)
    actor_kind: Mapped[str | None] = mapped_column(String(16))
    actor: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))
    open_marker: Mapped[bool | None] = mapped_column(Boolean, unique=True)
    resumed_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    resumed_actor_kind: Mapped[str | None] = mapped_column(String(16))
    resumed_actor: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))
    shift_cursor: Mapped[str | None] = mapped_column(String(ORDER_ID_COLUMN_LENGTH))
    shifted: Mapped[int] = mapped_column(BigInteger, default=0)
    ended_at_ms: Mapped[int | None] = mapped_column(BigInteger)


class EventCursorRow(Base):
    """Where a named consumer of order_events has got to (durable, one row per name)."""

    __tablename__ = "oes_event_cursors"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    txid: Mapped[int] = mapped_column(BigInteger)
    event_id: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)


class EventRetryRow(Base):
    """An event a consumer's handler failed on: *retrying* (due again at ``next_at_ms``) or,
    once ``attempts`` reached the consumer's maximum, *parked* (``parked_at_ms`` set): kept
    with its last error, never retried until an operator requeues it, nor deleted unless an
    operator discards it.
    """

    __tablename__ = "oes_event_retries"

    consumer: Mapped[str] = mapped_column(String(64), primary_key=True)
    event_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    #: Failed tries so far (0 right after a requeue).
    attempts: Mapped[int] = mapped_column(Integer)
    next_at_ms: Mapped[int] = mapped_column(BigInteger)
    last_error: Mapped[str | None] = mapped_column(String(TEXT_COLUMN_LENGTH))
    parked_at_ms: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        # Partial, over retrying rows only: parked ones pile up and are never due.
        partial_index(
            "ix_oes_event_retries_retrying_consumer_next_at_ms",
            "consumer",
            "next_at_ms",
            where=RETRYING_SQL,
        ),
    )


orders_table = cast(Table, OrderRow.__table__)
events_table = cast(Table, OrderEventRow.__table__)
cursors_table = cast(Table, EventCursorRow.__table__)
retries_table = cast(Table, EventRetryRow.__table__)
refusals_table = cast(Table, PaymentRefusalRow.__table__)
user_limits_table = cast(Table, UserLimitRow.__table__)
user_limit_history_table = cast(Table, UserLimitChangeRow.__table__)
pauses_table = cast(Table, PauseRow.__table__)

#: Every table of the schema: the order tables above and the inventory tables
#: (:mod:`orders.sql.inventory_tables`, imported above so that they are in it).
SCHEMA = Base.metadata
assert inventory_tables.resources_table.metadata is SCHEMA
