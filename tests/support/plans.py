"""What plan the database picks for a statement: the proof that a query is index-served."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Engine, event, text

#: One number per row: a series on PostgreSQL, a recursive CTE on SQLite (``:rows`` of them).
_SERIES = {
    "postgresql": "SELECT n FROM generate_series(0, :rows - 1) AS n",
    "sqlite": "WITH RECURSIVE s(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM s WHERE n < :rows - 1)"
    " SELECT n FROM s",
}


def add_history(engine: Engine, rows: int, users: int, now_ms: int) -> None:
    """``rows`` paid, cancelled and closed orders (in turn) of the users ``user000000000`` to
    ``user{users - 1:09d}``, all over by ``now_ms``, in one INSERT ... SELECT; then ANALYZE.
    10**6 of them take seconds, where the service would take an hour."""
    user = "'user' || substr('00000000' || (n % :users), -9, 9)"
    if engine.dialect.name == "postgresql":
        user = "'user' || lpad((n % :users)::text, 9, '0')"
    insert = f"""
        INSERT INTO oes_orders (id, user_id, status, created_at_ms, expires_at_ms,
            updated_at_ms, paid_at_ms, closed_at_ms, extensions)
        SELECT 'h' || n, {user}, CASE n % 3 WHEN 0 THEN 'paid' WHEN 1 THEN 'cancelled'
                ELSE 'closed' END,
            :now - 86400000 - n, :now - 3600000 - n, :now - n,
            CASE WHEN n % 3 = 0 THEN :now - n END, CASE WHEN n % 3 <> 0 THEN :now - n END, 0
        FROM ({_SERIES[engine.dialect.name]}) AS series"""
    if rows:  # the CTE's first row comes whatever its bound
        with engine.begin() as conn:
            conn.execute(text(insert), {"rows": rows, "users": users, "now": now_ms})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("ANALYZE"))


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
    if isinstance(value, list):  # an array (a JSON value comes wrapped)
        return "'{" + ",".join(json.dumps(item) for item in value).replace("'", "''") + "}'"
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

            # Scalar casts go (PREPARE infers the types); an array's stays.
            generic = re.sub(r"%\((\w+)\)s(::\w+\b(?!\[))?", placeholder, sql)
            values = ", ".join(_sql_literal(params[name]) for name in names)
            conn.exec_driver_sql("SET enable_seqscan = off")
            conn.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
            conn.exec_driver_sql(f"PREPARE planned AS {generic}")
            arguments = f"({values})" if names else ""  # EXECUTE takes no empty list
            rows = conn.exec_driver_sql(f"EXPLAIN EXECUTE planned{arguments}").all()
            conn.exec_driver_sql("DEALLOCATE planned")
            conn.rollback()
    return "\n".join(str(row[-1]) for row in rows)
