"""Databases shared with others: the state an older release of orders left, and a host
application with its own Alembic history and its own ``orders`` table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, inspect, text

from orders.sql import migrate
from orders.sql.schema_names import LEGACY_VERSION_TABLE, VERSION_TABLE

#: The last revision before the prefixed names and our own version table (0007).
PREVIOUS_HEAD = "0006"

#: Rows of every table of ours, as the release before 0007 named the tables.
PREVIOUS_ROWS = {
    "orders": (
        "INSERT INTO orders (id, user_id, status, created_at_ms, expires_at_ms, updated_at_ms,"
        " slot) VALUES ('o-1', 'u-1', 'unpaid', 1000, 61000, 1000, 1)"
    ),
    "order_events": (
        "INSERT INTO order_events (order_id, user_id, kind, at_ms)"
        " VALUES ('o-1', 'u-1', 'created', 1000)"
    ),
    "event_cursors": (
        "INSERT INTO event_cursors (name, txid, event_id, updated_at_ms)"
        " VALUES ('stock', 0, 1, 1000)"
    ),
    "event_retries": (
        "INSERT INTO event_retries (consumer, event_id, attempts, next_at_ms)"
        " VALUES ('stock', 1, 2, 5000)"
    ),
}


def as_previous_release(engine: Engine) -> None:
    """Turn a database at head into what the release before 0007 left, with a row in each
    table: the tables under their bare names (this release's own downgrade of 0007, which
    renames them back) and revision 0006 in Alembic's default ``alembic_version``, where
    that release recorded it."""
    migrate.downgrade(engine, PREVIOUS_HEAD)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {VERSION_TABLE}"))
        conn.execute(
            text(
                f"CREATE TABLE {LEGACY_VERSION_TABLE} (version_num VARCHAR(32) NOT NULL,"
                f" CONSTRAINT {LEGACY_VERSION_TABLE}_pkc PRIMARY KEY (version_num))"
            )
        )
        conn.execute(text(f"INSERT INTO {LEGACY_VERSION_TABLE} VALUES ('{PREVIOUS_HEAD}')"))
        for insert in PREVIOUS_ROWS.values():
            conn.execute(text(insert))


def rows_of(engine: Engine, tables: list[str]) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of each of ``tables`` (those that exist), sorted."""
    present = set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        return {
            name: sorted(tuple(row) for row in conn.execute(text(f"SELECT * FROM {name}")))
            for name in tables
            if name in present
        }


def as_rows_were(
    after: dict[str, list[tuple[Any, ...]]], before: dict[str, list[tuple[Any, ...]]]
) -> dict[str, list[tuple[Any, ...]]]:
    """``after``'s rows cut to the columns each table had ``before``; later migrations add
    columns at the end (0008: who caused an event), and those must be NULL on old rows
    (an AssertionError says which are not)."""
    cut: dict[str, list[tuple[Any, ...]]] = {}
    for name, rows in after.items():
        width = len(before[name][0]) if before.get(name) else len(rows[0]) if rows else 0
        added = [row[width:] for row in rows if any(v is not None for v in row[width:])]
        assert added == [], f"{name}: old rows got values in new columns: {added}"
        cut[name] = [row[:width] for row in rows]
    return cut


# --- a host application -----------------------------------------------------------------------

HOST_ENV = """
from alembic import context
from sqlalchemy import create_engine

url = context.config.get_main_option("sqlalchemy.url")
engine = create_engine(url)
with engine.begin() as connection:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
engine.dispose()
"""

HOST_REVISION = "hostrev0001"

HOST_SCRIPT = f'''
"""The host's own orders table: other columns, one row."""
import sqlalchemy as sa
from alembic import op

revision = "{HOST_REVISION}"
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table(
        "orders",
        sa.Column("number", sa.Integer(), primary_key=True),
        sa.Column("customer", sa.String(80), nullable=False),
        sa.Column("total_cents", sa.Integer(), nullable=False),
    )
    op.create_index("ix_orders_customer", "orders", ["customer"])
    op.execute("INSERT INTO orders (number, customer, total_cents) VALUES (7, 'ada', 1250)")


def downgrade():
    op.drop_index("ix_orders_customer", table_name="orders")
    op.drop_table("orders")
'''

#: The host's table, its row and its revision after its upgrade.
HOST_STATE = {"orders": [(7, "ada", 1250)], LEGACY_VERSION_TABLE: [(HOST_REVISION,)]}


class HostApplication:
    """A small Alembic project of a host's own, written to ``folder``: its env.py, the
    default ``alembic_version``, and one revision creating a table named ``orders``."""

    def __init__(self, folder: Path, database_url: str) -> None:
        (folder / "versions").mkdir(parents=True)
        (folder / "env.py").write_text(HOST_ENV)
        (folder / "versions" / f"{HOST_REVISION}_orders.py").write_text(HOST_SCRIPT)
        self.config = Config()
        self.config.set_main_option("script_location", str(folder))
        self.config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))

    def upgrade(self) -> None:
        command.upgrade(self.config, "head")

    def downgrade(self) -> None:
        command.downgrade(self.config, "base")

    @staticmethod
    def state(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
        return rows_of(engine, list(HOST_STATE))
