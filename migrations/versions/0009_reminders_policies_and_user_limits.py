"""Reminders before expiry, the order's expiry policy, and per-user limits.

* ``oes_orders`` gains ``policy`` (the name of the expiry policy the order was created
  under; NULL: the settings' defaults, as every order before), ``remind_at_ms`` (when the
  sweep writes the order's ``expiring`` event; NULL: no reminder is due) and
  ``reminded_at_ms`` (when it did), with a partial index over the reminders still due of
  unpaid orders and one over the reminders written, by when (for the stats);
* ``oes_order_events`` admits the kind ``expiring``;
* ``oes_user_limits`` holds the users whose limit differs from the settings' one, with who
  set it and when.

The new columns are nullable without a default: on PostgreSQL a change of the catalog
only. The events' check is replaced as in 0008 (SQLite rebuilds the events table).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.migration_steps import drop_columns_in_place, replace_events_kind_check

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

ORDERS = "oes_orders"
EVENTS = "oes_order_events"
LIMITS = "oes_user_limits"
OLD_KINDS = (
    "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',"
    " 'payment_refused', 'requeued', 'discarded')"
)
NEW_KINDS = (
    "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended',"
    " 'payment_refused', 'requeued', 'discarded', 'expiring')"
)
REMINDER_DUE = sa.text("status = 'unpaid' AND remind_at_ms IS NOT NULL")
REMINDED = sa.text("reminded_at_ms IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table(ORDERS) as batch:
        batch.add_column(sa.Column("policy", sa.String(length=64), nullable=True))
        batch.add_column(sa.Column("remind_at_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("reminded_at_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_oes_orders_reminder_due_remind_at_ms",
        ORDERS,
        ["remind_at_ms"],
        unique=False,
        postgresql_where=REMINDER_DUE,
        sqlite_where=REMINDER_DUE,
    )
    op.create_index(
        "ix_oes_orders_reminded_reminded_at_ms",
        ORDERS,
        ["reminded_at_ms"],
        unique=False,
        postgresql_where=REMINDED,
        sqlite_where=REMINDED,
    )
    replace_events_kind_check(NEW_KINDS)
    op.create_table(
        LIMITS,
        sa.Column("user_id", sa.String(length=512), nullable=False),
        sa.Column("unpaid_limit", sa.Integer(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("actor_kind", sa.String(length=16), nullable=True),
        sa.Column("actor", sa.String(length=128), nullable=True),
        sa.CheckConstraint(
            "unpaid_limit >= 0 AND unpaid_limit <= 1000000",
            name=op.f("ck_oes_user_limits_unpaid_limit_range"),
        ),
        sa.PrimaryKeyConstraint("user_id", name=op.f("pk_oes_user_limits")),
    )


def downgrade() -> None:
    """Drops the per-user limits (every user is back on the settings' limit), the
    ``expiring`` events, and the orders' policy and reminder columns."""
    op.drop_table(LIMITS)
    op.execute(f"DELETE FROM {EVENTS} WHERE kind = 'expiring'")  # noqa: S608
    replace_events_kind_check(OLD_KINDS)
    op.drop_index("ix_oes_orders_reminded_reminded_at_ms", table_name=ORDERS)
    op.drop_index("ix_oes_orders_reminder_due_remind_at_ms", table_name=ORDERS)
    drop_columns_in_place(ORDERS, "reminded_at_ms", "remind_at_ms", "policy")
