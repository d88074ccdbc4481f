"""``upsert``: insert a row or update it on its key, in one statement on both engines."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table
from sqlalchemy.dialects import postgresql, sqlite


def upsert(
    conn: Connection,
    table: Table,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    only_if: Callable[[Any], ColumnElement[bool]] | None = None,
) -> int:
    """Insert the row, or update ``values`` on the row with that ``key`` where
    ``only_if(excluded)`` holds (``excluded``: the row that was refused, as columns).

    One statement (INSERT ... ON CONFLICT DO UPDATE on both engines), so two writers of one
    key never race between an UPDATE that found nothing and an INSERT that then conflicts.
    Returns the rows written: 0 when the row existed and ``only_if`` was false for it.
    """
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table).values(**key, **values)
    statement = statement.on_conflict_do_update(
        index_elements=list(key),
        set_={name: statement.excluded[name] for name in values},
        where=None if only_if is None else only_if(statement.excluded),
    )
    # RETURNING, not the rowcount: psycopg reports -1 for an INSERT ... ON CONFLICT.
    first_key = table.c[next(iter(key))]
    return len(conn.execute(statement.returning(first_key)).all())
