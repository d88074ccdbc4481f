"""The tables of inventory: resources, what each order holds of them, their named units and
their waiting lists (issues 43 and 44). ``models`` imports this module, so the schema's
metadata always holds them.
"""

from __future__ import annotations

from typing import cast

from sqlalchemy import BigInteger, Boolean, CheckConstraint, ForeignKey, Index, String, Table, text
from sqlalchemy.orm import Mapped, mapped_column

from orders.domain import ACTOR_MAX_LENGTH
from orders.sql.base import (
    ORDER_ID_COLUMN_LENGTH,
    RESOURCE_ID_COLUMN_LENGTH,
    USER_ID_COLUMN_LENGTH,
    Base,
    EventId,
    partial_index,
)
from orders.validation import UNIT_NAME_MAX_LENGTH

#: A hold's units still kept for an unpaid order; ``sold``: bought; ``released``: free again.
HOLD_HELD = "held"
HOLD_SOLD = "sold"
HOLD_RELEASED = "released"
HELD_SQL = f"status = '{HOLD_HELD}'"


class ResourceRow(Base):
    """A counted resource (``service.set_capacity``). ``sold`` counts the units of paid
    orders; what unpaid orders hold is the sum of its ``held`` rows in ``oes_holds`` (a
    partial index keeps that sum to the open holds). Every create holding it locks this row
    first, in id order, so two creates never both take the last unit."""

    __tablename__ = "oes_resources"

    id: Mapped[str] = mapped_column(String(RESOURCE_ID_COLUMN_LENGTH), primary_key=True)
    capacity: Mapped[int] = mapped_column(BigInteger)
    per_user: Mapped[int | None] = mapped_column(BigInteger)
    #: Units of unpaid orders: the sum of its ``held`` rows in ``oes_holds``, kept by the
    #: same statements that write those rows.
    held: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    sold: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)
    # Not named actor_kind/actor: a transition's statement binds parameters of those names,
    # which SQLAlchemy would take as values for the columns of an UPDATE in it.
    updated_by_kind: Mapped[str | None] = mapped_column(String(16))
    updated_by: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))
    #: Its units are named (``oes_units``, ``service.set_units``); its capacity is their count.
    named: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))

    __table_args__ = (
        CheckConstraint("capacity >= 0", name="capacity"),
        CheckConstraint("held >= 0", name="held"),
        CheckConstraint("sold >= 0", name="sold"),
    )


class HoldRow(Base):
    """What one order holds of one resource: ``held`` while the order is unpaid, ``sold``
    once paid, ``released`` once closed or cancelled; changed in the transaction (on
    PostgreSQL the statement) of the order's own transition."""

    __tablename__ = "oes_holds"

    order_id: Mapped[str] = mapped_column(
        String(ORDER_ID_COLUMN_LENGTH),
        ForeignKey("oes_orders.id", ondelete="CASCADE"),
        primary_key=True,
    )
    resource_id: Mapped[str] = mapped_column(
        String(RESOURCE_ID_COLUMN_LENGTH), ForeignKey("oes_resources.id"), primary_key=True
    )
    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    quantity: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))

    __table_args__ = (
        CheckConstraint(
            f"status IN ('{HOLD_HELD}', '{HOLD_SOLD}', '{HOLD_RELEASED}')", name="status"
        ),
        CheckConstraint("quantity > 0", name="quantity"),
        # The units held now, per resource: the guard sums them from this index alone.
        partial_index("ix_oes_holds_held_resource_id", "resource_id", "quantity", where=HELD_SQL),
        # A user's holds and purchases of one resource (the per-user cap).
        Index("ix_oes_holds_resource_id_user_id", "resource_id", "user_id"),
    )


#: A named unit nobody holds; ``held`` by an unpaid order; ``sold`` to a paid one.
UNIT_FREE = "free"
UNIT_HELD = "held"
UNIT_SOLD = "sold"
UNIT_NAME_COLUMN_LENGTH = UNIT_NAME_MAX_LENGTH


class UnitRow(Base):
    """A named unit of a resource (a seat, a numbered space): one row, so one holder at
    most. ``order_id`` is its holder, kept after a release (the order that last held it: a
    late payment takes it again only while nobody else did). Its state moves in the
    statement that moves its order's hold."""

    __tablename__ = "oes_units"

    resource_id: Mapped[str] = mapped_column(
        String(RESOURCE_ID_COLUMN_LENGTH), ForeignKey("oes_resources.id"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(UNIT_NAME_COLUMN_LENGTH), primary_key=True)
    #: Its place in the resource's order: a create asking for a count gets the lowest.
    position: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(8))
    order_id: Mapped[str | None] = mapped_column(String(ORDER_ID_COLUMN_LENGTH))

    __table_args__ = (
        CheckConstraint(f"state IN ('{UNIT_FREE}', '{UNIT_HELD}', '{UNIT_SOLD}')", name="state"),
        Index("ix_oes_units_resource_id_state_position", "resource_id", "state", "position"),
        Index("ix_oes_units_order_id", "order_id"),
    )


#: A waiting-list entry still in the queue; then served (an order made for it), left, or
#: expired (past its ``until``).
WAITING = "waiting"
WAITING_STATES = (WAITING, "served", "left", "expired")
WAITING_SQL = f"status = '{WAITING}'"


class WaitingRow(Base):
    """One user waiting for units of one resource, first come first served (``id``)."""

    __tablename__ = "oes_waiting"

    id: Mapped[int] = mapped_column(EventId, primary_key=True, autoincrement=True)
    resource_id: Mapped[str] = mapped_column(
        String(RESOURCE_ID_COLUMN_LENGTH), ForeignKey("oes_resources.id")
    )
    user_id: Mapped[str] = mapped_column(String(USER_ID_COLUMN_LENGTH))
    quantity: Mapped[int] = mapped_column(BigInteger)
    until_ms: Mapped[int | None] = mapped_column(BigInteger)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16))
    #: The order made for it (status ``served``).
    order_id: Mapped[str | None] = mapped_column(String(ORDER_ID_COLUMN_LENGTH))
    ended_at_ms: Mapped[int | None] = mapped_column(BigInteger)
    added_by_kind: Mapped[str | None] = mapped_column(String(16))
    added_by: Mapped[str | None] = mapped_column(String(ACTOR_MAX_LENGTH))

    __table_args__ = (
        CheckConstraint(
            "status IN (" + ", ".join(f"'{s}'" for s in WAITING_STATES) + ")", name="status"
        ),
        CheckConstraint("quantity > 0", name="quantity"),
        # One place in a queue per user; the queue in order.
        partial_index(
            "ix_oes_waiting_resource_id_user_id",
            "resource_id",
            "user_id",
            where=WAITING_SQL,
            unique=True,
        ),
        partial_index("ix_oes_waiting_queue", "resource_id", "id", where=WAITING_SQL),
        Index("ix_oes_waiting_user_id", "user_id"),
        {"sqlite_autoincrement": True},
    )


resources_table = cast(Table, ResourceRow.__table__)
holds_table = cast(Table, HoldRow.__table__)
units_table = cast(Table, UnitRow.__table__)
waiting_table = cast(Table, WaitingRow.__table__)
