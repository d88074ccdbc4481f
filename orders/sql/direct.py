"""Hot statements sent straight to the DBAPI driver, each compiled once per dialect.

SQLAlchemy's execution of one statement (the execution context, its events, the result
object) cost as much client CPU as the driver's own work: for a payment, whose SQL is an
``UPDATE ... RETURNING`` and its event's ``INSERT``, about a third of the call. So the
transitions of one order (:mod:`orders.sql.transitions`), a single create's free-slot
insert (:mod:`orders.sql.slots`) and SQLite's ``BEGIN IMMEDIATE``
(:mod:`orders.sql.transactions`) run on the driver connection that SQLAlchemy checked out,
inside the transaction SQLAlchemy began: SQLAlchemy keeps the pool, the transaction (its
commit, rollback and events) and every other statement. Each statement is still defined
once, as a SQLAlchemy construct: it is compiled for the connection's dialect on first
use, and its parameters and returned columns go through the same bind and result
processing SQLAlchemy would apply (SQLite's JSON as text, for one).

What differs: SQLAlchemy's cursor events (``before_cursor_execute``...) do not see these
statements; the service's own span covers the call. Driver errors leave as SQLAlchemy's
would (:func:`orders.sql.failures.driver_error`), so ``sql_errors()`` translates them
as before. Only sqlite3 and psycopg's synchronous connections are driven so; any other driver (an
async one: a host's AsyncConnection), and a statement with an expanding ``IN`` list, go
through SQLAlchemy as usual.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from sqlalchemy import Connection
from sqlalchemy.engine import Dialect

from orders.sql.failures import driver_error

#: The drivers whose connections take the statements here, by dialect.
DRIVERS = {"sqlite": "pysqlite", "postgresql": "psycopg"}


def drives(dialect: Dialect) -> bool:
    """Whether statements on ``dialect`` go straight to its driver (module docstring):
    not on an async driver's (a host's AsyncConnection), whose calls are awaitables."""
    return DRIVERS.get(dialect.name) == dialect.driver and not dialect.is_async


class Compiled:
    """One statement compiled for one dialect, with what SQLAlchemy would do to its
    parameters and returned columns."""

    def __init__(self, statement: Any, dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.compiled = compiled
        self.sql = str(compiled)
        #: sqlite3 takes its parameters in the statement's order (qmark style).
        self.positions: tuple[str, ...] | None = (
            tuple(compiled.positiontup) if compiled.positional else None
        )
        self.processors: dict[str, Callable[[Any], Any]] = {
            key: process
            for key, bind in compiled.binds.items()
            if (process := bind.type.dialect_impl(dialect).bind_processor(dialect))
        }
        returned = list(getattr(statement, "exported_columns", ()))
        #: The returned columns' names, in their order (read once: psycopg builds its
        #: description anew on each read).
        self.names = tuple(column.name for column in returned)
        self.results: tuple[tuple[int, Callable[[Any], Any]], ...] = tuple(
            (i, process)
            for i, column in enumerate(returned)
            if (process := column.type.dialect_impl(dialect).result_processor(dialect, None))
        )

    def parameters(self, params: Mapping[str, Any]) -> Any:
        """``params`` as the driver takes them (SQLAlchemy's bind processing)."""
        bound = self.compiled.construct_params(params)
        for key, process in self.processors.items():
            bound[key] = process(bound[key])
        if self.positions is None:
            return bound
        return [bound[name] for name in self.positions]

    def run(self, conn: Connection, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Execute in ``conn``'s transaction (or autocommit); the rows returned, each a dict
        of its columns by name."""
        driver = _begun(conn)
        try:
            values = driver.execute(self.sql, self.parameters(params)).fetchall()
        except BaseException as exc:
            raise_as_sqlalchemy(conn, exc)
        rows = []
        for returned in values:
            row = list(returned)
            for i, process in self.results:
                row[i] = process(row[i])
            rows.append(dict(zip(self.names, row, strict=True)))
        return rows

    def execute(self, conn: Connection, params: Mapping[str, Any]) -> None:
        """Execute a statement that returns nothing, in ``conn``'s transaction."""
        driver = _begun(conn)
        try:
            driver.execute(self.sql, self.parameters(params))
        except BaseException as exc:
            raise_as_sqlalchemy(conn, exc)


def raise_as_sqlalchemy(conn: Connection, exc: BaseException) -> NoReturn:
    """Raise ``exc``, from a statement on ``conn``'s driver, as SQLAlchemy would
    (:func:`orders.sql.failures.driver_error`)."""
    wrapped = driver_error(conn, exc)
    if wrapped is None:
        raise exc
    raise wrapped from exc


def _begun(conn: Connection) -> Any:
    """``conn``'s driver connection, once SQLAlchemy's transaction has begun: as
    SQLAlchemy's own execution begins it (in a host's connection, the first statement may
    be ours), so that ``conn.commit()`` commits what the driver began."""
    if not conn.in_transaction():
        conn.begin()
    return conn.connection.driver_connection


class PerDialect:
    """A statement compiled once for each dialect it runs on, or None where it does not
    go straight to the driver (another driver; an expanding ``IN``)."""

    def __init__(self, statement: Any) -> None:
        self.statement = statement
        self._compiled: weakref.WeakKeyDictionary[Dialect, Compiled | None] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def on(self, conn: Connection) -> Compiled | None:
        dialect = conn.dialect
        try:
            return self._compiled[dialect]
        except KeyError:
            pass
        compiled = Compiled(self.statement, dialect) if drives(dialect) else None
        if compiled is not None and any(
            bind.expanding for bind in compiled.compiled.binds.values()
        ):
            compiled = None
        with self._lock:
            return self._compiled.setdefault(dialect, compiled)

    def rows(self, conn: Connection, params: Mapping[str, Any]) -> Sequence[Mapping[Any, Any]]:
        """Run the statement in ``conn``'s transaction: the rows it returns, each a mapping
        of its columns by name; by the driver where it takes it, else by SQLAlchemy."""
        direct = self.on(conn)
        if direct is not None:
            return direct.run(conn, params)
        return conn.execute(self.statement, params).mappings().all()
