"""Event consumers (cursors, retries), the transaction id of events, order extensions.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from orders.sql.migration_steps import drop_columns_in_place
from orders.sql.schema_names import Names

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD_KINDS = "kind IN ('created', 'paid', 'cancelled', 'closed')"
NEW_KINDS = "kind IN ('created', 'paid', 'cancelled', 'closed', 'extended')"


def kind_check(table: str) -> str:
    """The name of the events' check on ``kind``, read from the table: on SQLite a
    constraint keeps the name it was created with when 0007 renames its table."""
    checks = sa.inspect(op.get_bind()).get_check_constraints(table)
    return next(str(c["name"]) for c in checks if str(c["name"]).endswith("order_events_kind"))


def upgrade() -> None:
    n = Names.of(op.get_bind())
    with op.batch_alter_table(n("orders")) as batch:
        batch.add_column(
            sa.Column("extensions", sa.Integer(), server_default=sa.text("0"), nullable=False)
        )
    # On SQLite the table is rebuilt: with AUTOINCREMENT, so event ids never go back, even
    # after the newest events are deleted (consumers' cursors rely on that).
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table(
        n("order_events"),
        recreate="always" if sqlite else "auto",
        table_kwargs={"sqlite_autoincrement": True},
    ) as batch:
        batch.add_column(sa.Column("txid", sa.BigInteger(), nullable=True))
        batch.drop_constraint(op.f(kind_check(n("order_events"))), type_="check")
        batch.create_check_constraint("kind", sa.text(NEW_KINDS))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {n('order_events')} ALTER COLUMN txid SET DEFAULT txid_current()")
    op.create_index(n("ix_order_events_txid_id"), n("order_events"), ["txid", "id"])
    op.create_table(
        n("event_cursors"),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("txid", sa.BigInteger(), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("updated_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f(n("pk_event_cursors"))),
    )
    op.create_table(
        n("event_retries"),
        sa.Column("consumer", sa.String(length=64), nullable=False),
        sa.Column("event_id", sa.BigInteger(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("last_error", sa.String(length=256), nullable=True),
        sa.PrimaryKeyConstraint("consumer", "event_id", name=op.f(n("pk_event_retries"))),
    )
    op.create_index(
        n("ix_event_retries_consumer_next_at_ms"), n("event_retries"), ["consumer", "next_at_ms"]
    )


def downgrade() -> None:
    n = Names.of(op.get_bind())
    op.drop_index(n("ix_event_retries_consumer_next_at_ms"), table_name=n("event_retries"))
    op.drop_table(n("event_retries"))
    op.drop_table(n("event_cursors"))
    op.drop_index(n("ix_order_events_txid_id"), table_name=n("order_events"))
    op.execute(f"DELETE FROM {n('order_events')} WHERE kind = 'extended'")  # noqa: S608
    with op.batch_alter_table(n("order_events")) as batch:
        batch.drop_constraint(op.f(kind_check(n("order_events"))), type_="check")
        batch.create_check_constraint("kind", sa.text(OLD_KINDS))
        batch.drop_column("txid")
    drop_columns_in_place(n("orders"), "extensions")  # in place: a rebuild would drop every event
