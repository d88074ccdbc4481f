"""Steps more than one migration takes, written once (only migrations import this).

Each runs inside a migration, on Alembic's ``op`` and the connection it holds.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

EVENTS = "oes_order_events"


def events_kind_check() -> str:
    """The name of the events' check on ``kind`` as the database has it (on SQLite it
    keeps the name it was created with when 0007 renamed its table)."""
    checks = sa.inspect(op.get_bind()).get_check_constraints(EVENTS)
    return next(str(c["name"]) for c in checks if str(c["name"]).endswith("order_events_kind"))


def replace_events_kind_check(kinds: str) -> None:
    """Replace the events' check on ``kind`` by ``kinds`` (an SQL condition).

    PostgreSQL adds the new check NOT VALID and then validates it, which reads the table
    without blocking writes. SQLite cannot alter a check: the events table is rebuilt (its
    rows copied once, under the write lock), with AUTOINCREMENT kept so that event ids never
    go back (0003 says why).
    """
    old = events_kind_check()
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {EVENTS} DROP CONSTRAINT {old}")
        op.execute(
            f"ALTER TABLE {EVENTS} ADD CONSTRAINT ck_{EVENTS}_kind CHECK ({kinds}) NOT VALID"
        )
        op.execute(f"ALTER TABLE {EVENTS} VALIDATE CONSTRAINT ck_{EVENTS}_kind")
        return
    with op.batch_alter_table(
        EVENTS, recreate="always", table_kwargs={"sqlite_autoincrement": True}
    ) as batch:
        batch.drop_constraint(op.f(old), type_="check")
        batch.create_check_constraint("kind", sa.text(kinds))


def drop_columns_in_place(table: str, *columns: str) -> None:
    """``ALTER TABLE ... DROP COLUMN`` for each column, on both engines (SQLite 3.35 and
    later), never a batch rebuild of ``table``: SQLite rebuilds a table by dropping the old
    one, and with foreign keys on, dropping the orders table deletes every event, refusal
    and retry that refers to it (ON DELETE CASCADE). A column must not be in an index or a
    constraint when dropped: drop those first."""
    for column in columns:
        op.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
