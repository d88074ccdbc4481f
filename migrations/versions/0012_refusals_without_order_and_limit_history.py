"""Refusals that outlive their order, and the history of per-user limits.

* ``oes_payment_refusals`` loses its foreign key to ``oes_orders`` (a refusal is kept after
  retention deletes its order, and one is recorded for a payment whose order SQL does not
  hold), and its ``user_id`` and ``event_id`` turn nullable (such a refusal has neither).
  SQLite rebuilds the table (a foreign key cannot be dropped there); PostgreSQL changes
  its catalog only.
* ``oes_user_limit_history`` holds one row per set or clear of a user's own limit
  (``unpaid_limit`` NULL: cleared), append-only; a new table, which older code ignores.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ORDERS = "oes_orders"
REFUSALS = "oes_payment_refusals"
HISTORY = "oes_user_limit_history"
FOREIGN_KEY = "fk_oes_payment_refusals_order_id_oes_orders"
PENDING_INDEX = "ix_oes_payment_refusals_pending_refused_at_ms"
PENDING = sa.text("handled_at_ms IS NULL")
HISTORY_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    # The partial index is made again after SQLite's rebuild, which copies plain ones only.
    op.drop_index(PENDING_INDEX, table_name=REFUSALS)
    with op.batch_alter_table(REFUSALS) as batch:
        batch.drop_constraint(FOREIGN_KEY, type_="foreignkey")
        batch.alter_column("user_id", existing_type=sa.String(length=512), nullable=True)
        batch.alter_column("event_id", existing_type=sa.BigInteger(), nullable=True)
    _pending_index()
    op.create_table(
        HISTORY,
        sa.Column("id", HISTORY_ID, autoincrement=True, nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("unpaid_limit", sa.Integer(), nullable=True),
        sa.Column("changed_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_oes_user_limit_history")),
    )
    op.create_index("ix_oes_user_limit_history_user_id_id", HISTORY, ["user_id", "id"])


def downgrade() -> None:
    """Drops the limits' history, and the refusals whose order is gone or was never held
    (their refunds owed with them: export them first)."""
    op.drop_table(HISTORY)
    op.execute(
        f"DELETE FROM {REFUSALS} WHERE event_id IS NULL OR user_id IS NULL"  # noqa: S608
        f" OR order_id NOT IN (SELECT id FROM {ORDERS})"
    )
    op.drop_index(PENDING_INDEX, table_name=REFUSALS)
    with op.batch_alter_table(REFUSALS) as batch:
        batch.alter_column("user_id", existing_type=sa.String(length=512), nullable=False)
        batch.alter_column("event_id", existing_type=sa.BigInteger(), nullable=False)
        batch.create_foreign_key(FOREIGN_KEY, ORDERS, ["order_id"], ["id"], ondelete="CASCADE")
    _pending_index()


def _pending_index() -> None:
    op.create_index(
        PENDING_INDEX,
        REFUSALS,
        ["refused_at_ms"],
        unique=False,
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )
