"""A slot number per unpaid order, unique per user: the SQL side of the unpaid limit.

A create takes the lowest free slot from 1 to the user's limit, and a partial unique index
on (user_id, slot) over unpaid orders makes two unpaid orders in one slot impossible. So
the insert of the order is the guard itself: no per-user lock and no count, on either
engine, and the limit holds in SQL whatever Redis lost.

Existing unpaid orders are numbered 1, 2, ... per user in expiry order. Paid, cancelled and
closed orders keep the slot they had (or none): the index ignores them.

On PostgreSQL the backfill and CREATE UNIQUE INDEX block writes to ``orders`` while they
run; on a large table, run the upgrade in a quiet moment.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.migration_steps import drop_columns_in_place
from orders.sql.schema_names import Names

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNPAID = sa.text("status = 'unpaid'")


def upgrade() -> None:
    n = Names.of(op.get_bind())
    with op.batch_alter_table(n("orders")) as batch:
        batch.add_column(sa.Column("slot", sa.Integer(), nullable=True))
    orders = n("orders")
    op.execute(
        f"""
        UPDATE {orders} SET slot = (
            SELECT numbered.n FROM (
                SELECT id, ROW_NUMBER() OVER (
                    PARTITION BY user_id ORDER BY expires_at_ms, id
                ) AS n
                FROM {orders} WHERE status = 'unpaid'
            ) AS numbered
            WHERE numbered.id = {orders}.id
        )
        WHERE status = 'unpaid'
        """  # noqa: S608
    )
    op.create_index(
        n("ix_orders_unpaid_user_id_slot"),
        n("orders"),
        ["user_id", "slot"],
        unique=True,
        postgresql_where=UNPAID,
        sqlite_where=UNPAID,
    )


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.drop_index(n("ix_orders_unpaid_user_id_slot"), table_name=n("orders"))
    drop_columns_in_place(n("orders"), "slot")  # in place: a rebuild would drop every event
