"""Counted resources and what each order holds of them (issue 43).

* ``oes_resources``: one row per resource (capacity, ``per_user`` cap, units sold);
* ``oes_holds``: one row per order and resource (units, and whether they are held, sold or
  released), deleted with its order;
* ``oes_orders.holds``: the cart as the create asked it (NULL: nothing held), so that the
  order's events name its units without a join.

New tables and a nullable column: older code ignores them.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ORDERS = "oes_orders"
RESOURCES = "oes_resources"
HOLDS = "oes_holds"
HELD = sa.text("status = 'held'")


def upgrade() -> None:
    op.create_table(
        RESOURCES,
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("capacity", sa.BigInteger(), nullable=False),
        sa.Column("per_user", sa.BigInteger(), nullable=True),
        sa.Column("held", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("sold", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("updated_by_kind", sa.String(length=16), nullable=True),
        sa.Column("updated_by", sa.String(length=128), nullable=True),
        sa.CheckConstraint("capacity >= 0", name=op.f("ck_oes_resources_capacity")),
        sa.CheckConstraint("held >= 0", name=op.f("ck_oes_resources_held")),
        sa.CheckConstraint("sold >= 0", name=op.f("ck_oes_resources_sold")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oes_resources")),
    )
    op.create_table(
        HOLDS,
        sa.Column("order_id", sa.String(length=128), nullable=False),
        sa.Column("resource_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.CheckConstraint(
            "status IN ('held', 'sold', 'released')", name=op.f("ck_oes_holds_status")
        ),
        sa.CheckConstraint("quantity > 0", name=op.f("ck_oes_holds_quantity")),
        sa.ForeignKeyConstraint(
            ["order_id"],
            [f"{ORDERS}.id"],
            name=op.f("fk_oes_holds_order_id_oes_orders"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["resource_id"],
            [f"{RESOURCES}.id"],
            name=op.f("fk_oes_holds_resource_id_oes_resources"),
        ),
        sa.PrimaryKeyConstraint("order_id", "resource_id", name=op.f("pk_oes_holds")),
    )
    op.create_index(
        "ix_oes_holds_held_resource_id",
        HOLDS,
        ["resource_id", "quantity"],
        unique=False,
        postgresql_where=HELD,
        sqlite_where=HELD,
    )
    op.create_index("ix_oes_holds_resource_id_user_id", HOLDS, ["resource_id", "user_id"])
    # A plain ALTER on both engines: a batch rebuild on SQLite would drop the partial indexes.
    op.add_column(ORDERS, sa.Column("holds", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drops every resource and hold: export them first."""
    op.execute(f"ALTER TABLE {ORDERS} DROP COLUMN holds")
    op.drop_table(HOLDS)
    op.drop_table(RESOURCES)
