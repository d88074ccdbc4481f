"""What plan the database picks for a statement: the proof that a query is index-served."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event

#: A statement as the driver got it: its SQL and its parameters.
Statement = tuple[str, Any]


@contextmanager
def captured(engine: Engine) -> Iterator[list[Statement]]:
    """Every statement the engine sends to the database while the block runs, as
    (sql, parameters): what :func:`explain_sql` takes."""
    seen: list[Statement] = []

    def record(_conn: Any, _cursor: Any, sql: str, params: Any, *_rest: Any) -> None:
        seen.append((sql, params))

    event.listen(engine, "before_cursor_execute", record)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", record)


def explain(engine: Engine, statement: Any) -> str:
    """The plan for a SQLAlchemy ``statement`` with its parameters bound, as text."""
    compiled = statement.compile(engine)
    if engine.dialect.name == "sqlite":
        params: Any = tuple(compiled.params[name] for name in compiled.positiontup or ())
    else:
        params = compiled.params
    return explain_sql(engine, str(compiled), params)


def _sql_literal(value: Any) -> str:
    value = getattr(value, "obj", value)  # psycopg's Json wrapper around a JSON value
    if value is None:
        return "NULL"
    if isinstance(value, int):
        return str(value)
    text = value if isinstance(value, str) else json.dumps(value)
    return "'" + text.replace("'", "''") + "'"


def explain_sql(engine: Engine, sql: str, params: Any) -> str:
    """The plan the engine picks for the driver-level ``sql`` with ``params``, as text.

    On PostgreSQL the statement is prepared and planned generically, as a statement the
    driver has prepared and reuses is: a partial index then only serves predicates that
    are literals in the SQL, not parameters.
    """
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params).all()
        else:
            names: list[str] = []

            def placeholder(match: re.Match[str]) -> str:
                names.append(match.group(1))
                return f"${len(names)}"

            generic = re.sub(r"%\((\w+)\)s(::\w+)?", placeholder, sql)
            values = ", ".join(_sql_literal(params[name]) for name in names)
            conn.exec_driver_sql("SET enable_seqscan = off")
            conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
            conn.exec_driver_sql(f"PREPARE planned AS {generic}")
            arguments = f"({values})" if names else ""  # EXECUTE takes no empty list
            rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE planned{arguments}").all()
            conn.exec_driver_sql("DEALLOCATE planned")
            conn.rollback()
    return "\n".join(str(row[-1]) for row in rows)
