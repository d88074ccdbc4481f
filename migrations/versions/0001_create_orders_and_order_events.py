"""Create orders and order_events.

On a database migrated from scratch the tables get the names migration 0007 gives them
(``oes_orders``...: see orders.sql.schema_names), so they never meet a host's ``orders``;
a name of ours that is already taken refuses the upgrade before anything is written.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.migrate import refuse_conflicts
from orders.sql.schema_names import Names

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The order_events key: BIGINT, except that SQLite only auto-increments an INTEGER key.
EVENT_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    refuse_conflicts(op.get_bind(), "the upgrade changed nothing")
    n = Names(prefixed=True)
    op.create_table(
        n("orders"),
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
            "status IN ('unpaid', 'paid', 'cancelled', 'closed')", name=op.f(n("ck_orders_status"))
        ),
        sa.CheckConstraint(
            "expires_at_ms > created_at_ms", name=op.f(n("ck_orders_expiry_after_creation"))
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(n("pk_orders"))),
    )
    op.create_index(n("ix_orders_status_expires_at_ms"), n("orders"), ["status", "expires_at_ms"])
    op.create_index(
        n("ix_orders_user_id_status_expires_at_ms"),
        n("orders"),
        ["user_id", "status", "expires_at_ms"],
    )
    op.create_table(
        n("order_events"),
        sa.Column("id", EVENT_ID, autoincrement=True, nullable=False),
        sa.Column("order_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=True),
        sa.CheckConstraint(
            "kind IN ('created', 'paid', 'cancelled', 'closed')",
            name=op.f(n("ck_order_events_kind")),
        ),
        sa.ForeignKeyConstraint(
            ["order_id"],
            [n("orders") + ".id"],
            name=op.f(n("fk_order_events_order_id_orders")),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f(n("pk_order_events"))),
    )
    op.create_index(n("ix_order_events_order_id"), n("order_events"), ["order_id"])


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.drop_index(n("ix_order_events_order_id"), table_name=n("order_events"))
    op.drop_table(n("order_events"))
    op.drop_index(n("ix_orders_user_id_status_expires_at_ms"), table_name=n("orders"))
    op.drop_index(n("ix_orders_status_expires_at_ms"), table_name=n("orders"))
    op.drop_table(n("orders"))
