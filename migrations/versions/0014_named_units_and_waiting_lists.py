"""Named units of a resource and waiting lists (issue 44).

* ``oes_resources.named``: its units are named; its capacity is their count;
* ``oes_units``: one row per named unit (its place, state, and the order that holds it or
  last held it);
* ``oes_waiting``: users waiting for units of a resource, first come first served.

New tables and a column with a default: older code ignores them.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RESOURCES = "oes_resources"
UNITS = "oes_units"
WAITING = "oes_waiting"
QUEUED = sa.text("status = 'waiting'")


def upgrade() -> None:
    # A plain ALTER on both engines (a batch rebuild on SQLite would copy the table).
    op.add_column(
        RESOURCES,
        sa.Column("named", sa.Boolean(), server_default=sa.text("false"), nullable=False),
    )
    op.create_table(
        UNITS,
        sa.Column("resource_id", sa.String(length=128), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(length=8), nullable=False),
        sa.Column("order_id", sa.String(length=128), nullable=True),
        sa.CheckConstraint("state IN ('free', 'held', 'sold')", name=op.f("ck_oes_units_state")),
        sa.ForeignKeyConstraint(
            ["resource_id"],
            [f"{RESOURCES}.id"],
            name=op.f("fk_oes_units_resource_id_oes_resources"),
        ),
        sa.PrimaryKeyConstraint("resource_id", "name", name=op.f("pk_oes_units")),
    )
    op.create_index(
        "ix_oes_units_resource_id_state_position", UNITS, ["resource_id", "state", "position"]
    )
    op.create_index("ix_oes_units_order_id", UNITS, ["order_id"])
    op.create_table(
        WAITING,
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            autoincrement=True,
            nullable=False,
        ),
        sa.Column("resource_id", sa.String(length=128), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("quantity", sa.BigInteger(), nullable=False),
        sa.Column("until_ms", sa.BigInteger(), nullable=True),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("order_id", sa.String(length=128), nullable=True),
        sa.Column("ended_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("added_by_kind", sa.String(length=16), nullable=True),
        sa.Column("added_by", sa.String(length=128), nullable=True),
        sa.CheckConstraint(
            "status IN ('waiting', 'served', 'left', 'expired')", name=op.f("ck_oes_waiting_status")
        ),
        sa.CheckConstraint("quantity > 0", name=op.f("ck_oes_waiting_quantity")),
        sa.ForeignKeyConstraint(
            ["resource_id"],
            [f"{RESOURCES}.id"],
            name=op.f("fk_oes_waiting_resource_id_oes_resources"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oes_waiting")),
        sqlite_autoincrement=True,
    )
    op.create_index(
        "ix_oes_waiting_resource_id_user_id",
        WAITING,
        ["resource_id", "user_id"],
        unique=True,
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )
    op.create_index(
        "ix_oes_waiting_queue",
        WAITING,
        ["resource_id", "id"],
        postgresql_where=QUEUED,
        sqlite_where=QUEUED,
    )
    op.create_index("ix_oes_waiting_user_id", WAITING, ["user_id"])


def downgrade() -> None:
    """Drops every named unit and waiting entry: export them first."""
    op.drop_table(WAITING)
    op.drop_table(UNITS)
    op.execute(f"ALTER TABLE {RESOURCES} DROP COLUMN named")
