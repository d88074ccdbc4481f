"""Partial indexes on the terminal transitions' timestamps, for ``orders stats``.

The stats count the orders paid, cancelled and closed in a recent time window and read the
close lag (closed_at_ms - expires_at_ms) of the closed ones. Without these indexes both are
full scans of a table that only grows. Each index holds one terminal status only, keyed on
the time of that transition; the closed one carries expires_at_ms as a second key column,
so the lag is read from the index alone.

On PostgreSQL, CREATE INDEX blocks writes to ``orders`` while it reads the table. On a large
table an operator may build the indexes beforehand with CREATE INDEX CONCURRENTLY, under
these names and definitions: the upgrade creates only those that do not exist yet.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.schema_names import Names

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

PAID = sa.text("status = 'paid'")
CANCELLED = sa.text("status = 'cancelled'")
CLOSED = sa.text("status = 'closed'")


def upgrade() -> None:
    n = Names.of(op.get_bind())
    op.create_index(
        n("ix_orders_paid_paid_at_ms"),
        n("orders"),
        ["paid_at_ms"],
        if_not_exists=True,
        postgresql_where=PAID,
        sqlite_where=PAID,
    )
    op.create_index(
        n("ix_orders_cancelled_closed_at_ms"),
        n("orders"),
        ["closed_at_ms"],
        if_not_exists=True,
        postgresql_where=CANCELLED,
        sqlite_where=CANCELLED,
    )
    op.create_index(
        n("ix_orders_closed_closed_at_ms_expires_at_ms"),
        n("orders"),
        ["closed_at_ms", "expires_at_ms"],
        if_not_exists=True,
        postgresql_where=CLOSED,
        sqlite_where=CLOSED,
    )


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.drop_index(n("ix_orders_closed_closed_at_ms_expires_at_ms"), table_name=n("orders"))
    op.drop_index(n("ix_orders_cancelled_closed_at_ms"), table_name=n("orders"))
    op.drop_index(n("ix_orders_paid_paid_at_ms"), table_name=n("orders"))
