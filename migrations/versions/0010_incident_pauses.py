"""Incident pauses: ``oes_pauses``.

One row per pause (``orders pause``): why, when and by whom it began, when its resume began
and by whom, how far the resume has moved the unpaid orders' expiries (``shift_cursor``,
``shifted``) and when it ended. ``open_marker`` is true on the open pause only, NULL on the
others: its unique constraint allows one open pause at a time. A new table: nothing else
changes, and older code ignores it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PAUSES = "oes_pauses"
PAUSE_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        PAUSES,
        sa.Column("id", PAUSE_ID, autoincrement=True, nullable=False),
        sa.Column("reason", sa.String(length=256), nullable=False),
        sa.Column("started_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=True),
        sa.Column("open_marker", sa.Boolean(), nullable=True),
        sa.Column("resumed_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("resumed_actor_kind", sa.String(length=16), nullable=True),
        sa.Column("resumed_actor", sa.String(length=128), nullable=True),
        sa.Column("shift_cursor", sa.String(length=128), nullable=True),
        sa.Column("shifted", sa.BigInteger(), nullable=False),
        sa.Column("ended_at_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oes_pauses")),
        sa.UniqueConstraint("open_marker", name=op.f("uq_oes_pauses_open_marker")),
    )


def downgrade() -> None:
    """Drops the pauses: an open one ends with it (the sweep runs again, nothing moved)."""
    op.drop_table(PAUSES)
