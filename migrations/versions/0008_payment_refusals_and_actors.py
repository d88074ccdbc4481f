"""Refused payments (``oes_payment_refusals``), the new event kinds, and who caused each event.

* ``oes_order_events`` gains ``actor_kind`` and ``actor`` (NULL on the rows written
  before: they stay readable, their actor unknown), and its check on ``kind`` admits
  ``payment_refused``, ``requeued`` and ``discarded``;
* ``oes_payment_refusals`` holds one row per refused payment: the refund owed, and whether
  someone has handled it.

On SQLite the events table is rebuilt (a check constraint cannot be altered there): the
upgrade copies every event once, holding the write lock while it does. On PostgreSQL the
new check is added NOT VALID and then validated, which reads the table without blocking
writes; the columns are nullable without a default, a change of the catalog only.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.migration_steps import replace_events_kind_check

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

EVENTS = "oes_order_events"
REFUSALS = "oes_payment_refusals"
OLD_KINDS = "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended')"
NEW_KINDS = (
    "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',"
    " 'payment_refused', 'requeued', 'discarded')"
)
PENDING = sa.text("handled_at_ms IS NULL")


def upgrade() -> None:
    with op.batch_alter_table(EVENTS) as batch:
        batch.add_column(sa.Column("actor_kind", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("actor", sa.String(length=128), nullable=True))
    replace_events_kind_check(NEW_KINDS)
    op.create_table(
        REFUSALS,
        sa.Column("order_id", sa.String(length=128), nullable=False),
        sa.Column("payment_ref", sa.String(length=256), nullable=False),
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("amount", sa.String(length=40), nullable=True),
        sa.Column("currency", sa.String(length=3), nullable=True),
        sa.Column("refused_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("handled_at_ms", sa.BigInteger(), nullable=True),
        sa.Column("handled_by_kind", sa.String(length=16), nullable=True),
        sa.Column("handled_by", sa.String(length=128), nullable=True),
        sa.ForeignKeyConstraint(
            ["order_id"],
            ["oes_orders.id"],
            name=op.f("fk_oes_payment_refusals_order_id_oes_orders"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("order_id", "payment_ref", name=op.f("pk_oes_payment_refusals")),
    )
    op.create_index(
        "ix_oes_payment_refusals_refused_at_ms", REFUSALS, ["refused_at_ms"], unique=False
    )
    op.create_index(
        "ix_oes_payment_refusals_pending_refused_at_ms",
        REFUSALS,
        ["refused_at_ms"],
        unique=False,
        postgresql_where=PENDING,
        sqlite_where=PENDING,
    )


def downgrade() -> None:
    """Drops the refusals (their refunds owed with them: export them first) and the events
    of the new kinds, then the actor columns."""
    op.drop_index("ix_oes_payment_refusals_pending_refused_at_ms", table_name=REFUSALS)
    op.drop_index("ix_oes_payment_refusals_refused_at_ms", table_name=REFUSALS)
    op.drop_table(REFUSALS)
    op.execute(
        f"DELETE FROM {EVENTS} WHERE kind IN ('payment_refused', 'requeued', 'discarded')"  # noqa: S608
    )
    replace_events_kind_check(OLD_KINDS)
    with op.batch_alter_table(EVENTS, table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("actor")
        batch.drop_column("actor_kind")
