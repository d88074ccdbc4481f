"""Event retries that give up: a parked state, and a due-retries index without parked rows.

A retry row whose ``attempts`` reached the consumer's maximum gets ``parked_at_ms`` and is
no longer retried; it stays, with its last error, until an operator requeues or discards
it. The index that finds due retries becomes partial over the rows still retrying.

Downgrade keeps parked rows: without the column they are ordinary retries again (the old
code retries them forever, as it did before), rather than being deleted silently.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.schema_names import Names

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RETRYING = sa.text("parked_at_ms IS NULL")


def upgrade() -> None:
    n = Names.of(op.get_bind())
    with op.batch_alter_table(n("event_retries")) as batch:
        batch.add_column(sa.Column("parked_at_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        n("ix_event_retries_retrying_consumer_next_at_ms"),
        n("event_retries"),
        ["consumer", "next_at_ms"],
        postgresql_where=RETRYING,
        sqlite_where=RETRYING,
    )
    op.drop_index(n("ix_event_retries_consumer_next_at_ms"), table_name=n("event_retries"))


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.create_index(
        n("ix_event_retries_consumer_next_at_ms"), n("event_retries"), ["consumer", "next_at_ms"]
    )
    op.drop_index(n("ix_event_retries_retrying_consumer_next_at_ms"), table_name=n("event_retries"))
    with op.batch_alter_table(n("event_retries")) as batch:
        batch.drop_column("parked_at_ms")
