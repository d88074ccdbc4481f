"""Create orders and order_events.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The order_events key: BIGINT, except that SQLite only auto-increments an INTEGER key.
EVENT_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("amount", sa.String(length=40), nullable=True),
        sa.Column("currency", sa.String(length=3), nullable=True),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("paid_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("closed_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("close_reason", sa.String(length=256), nullable=True),
        sa.Column("payment_ref", sa.String(length=256), nullable=True),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "status IN ('unpaid', 'paid', 'cancelled', 'closed')", name=op.f("ck_orders_status")
        ),
        sa.CheckConstraint(
            "expires_at_ms > created_at_ms", name=op.f("ck_orders_expiry_after_creation")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_orders")),
    )
    op.create_index("ix_orders_status_expires_at_ms", "orders", ["status", "expires_at_ms"])
    op.create_index(
        "ix_orders_user_id_status_expires_at_ms", "orders", ["user_id", "status", "expires_at_ms"]
    )
    op.create_table(
        "order_events",
        sa.Column("id", EVENT_ID, autoincrement=True, nullable=False),
        sa.Column("order_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "kind IN ('created', 'paid', 'cancelled', 'closed')",
            name=op.f("ck_order_events_kind"),
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["orders.id"],
            name=op.f("fk_order_events_order_id_orders"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_order_events")),
    )
    op.create_index("ix_order_events_order_id", "order_events", ["order_id"])


def downgrade() -> None:
    op.drop_index("ix_order_events_order_id", table_name="order_events")
    op.drop_table("order_events")
    op.drop_index("ix_orders_user_id_status_expires_at_ms", table_name="orders")
    op.drop_index("ix_orders_status_expires_at_ms", table_name="orders")
    op.drop_table("orders")
