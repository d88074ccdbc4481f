"""Partial indexes over unpaid orders replace the (status, ...) indexes.

Paid, cancelled and closed orders accumulate forever; the sweep, the limit guard and
list_unpaid only ever look at unpaid ones. Indexes restricted to those stay small and
cheap to keep up to date however large the table grows.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.schema_names import Names

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNPAID = sa.text("status = 'unpaid'")


def upgrade() -> None:
    n = Names.of(op.get_bind())
    op.create_index(
        n("ix_orders_unpaid_expires_at_ms"),
        n("orders"),
        ["expires_at_ms"],
        postgresql_where=UNPAID,
        sqlite_where=UNPAID,
    )
    op.create_index(
        n("ix_orders_unpaid_user_id_expires_at_ms"),
        n("orders"),
        ["user_id", "expires_at_ms"],
        postgresql_where=UNPAID,
        sqlite_where=UNPAID,
    )
    op.drop_index(n("ix_orders_user_id_status_expires_at_ms"), table_name=n("orders"))
    op.drop_index(n("ix_orders_status_expires_at_ms"), table_name=n("orders"))


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.create_index(n("ix_orders_status_expires_at_ms"), n("orders"), ["status", "expires_at_ms"])
    op.create_index(
        n("ix_orders_user_id_status_expires_at_ms"),
        n("orders"),
        ["user_id", "status", "expires_at_ms"],
    )
    op.drop_index(n("ix_orders_unpaid_user_id_expires_at_ms"), table_name=n("orders"))
    op.drop_index(n("ix_orders_unpaid_expires_at_ms"), table_name=n("orders"))
