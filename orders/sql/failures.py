"""How a driver's failure leaves the SQL layer: as the service's typed errors, never as
SQLAlchemy's or the driver's own (one place for the translation)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from orders import metrics
from orders.errors import SchemaNotReady, StoreUnavailable


@contextmanager
def sql_errors() -> Iterator[None]:
    """Translate SQLAlchemy errors into StoreUnavailable, a missing table or column into
    SchemaNotReady. A constraint that refuses a write is a store failure too: the one place
    that expects a conflict (a create's insert) catches it inside its own transaction.

    The detail is the driver's own first line, never the statement or its parameters.
    """
    try:
        yield
    except SQLAlchemyError as exc:
        metrics.STORE_ERRORS.labels("sql").inc()
        orig = getattr(exc, "orig", None)
        reason = str(orig).strip().splitlines()[0][:160] if orig is not None and str(orig) else ""
        sqlstate = getattr(orig, "sqlstate", None)
        if "no such table" in reason or sqlstate == "42P01":
            raise SchemaNotReady("the orders tables are missing") from exc
        if "no such column" in reason or sqlstate == "42703":
            raise SchemaNotReady("the orders tables are older than this code") from exc
        if sqlstate == "55P03":  # lock_timeout: another transaction held a row or table
            raise StoreUnavailable(
                "sql", "a lock stayed held past lock_timeout; nothing changed, retry"
            ) from exc
        if isinstance(exc, IntegrityError):
            raise StoreUnavailable("sql", "a constraint refused the write") from exc
        detail = f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__
        raise StoreUnavailable("sql", detail) from exc


def driver_error(conn: Connection, exc: BaseException) -> BaseException | None:
    """What to raise for ``exc``, raised by a statement sent straight to ``conn``'s driver
    (:mod:`orders.sql.direct`), as SQLAlchemy would: a driver error becomes a DBAPIError
    of the matching kind (the driver's error its ``orig``), for :func:`sql_errors`; the
    connection is invalidated when the driver lost the server, or when an interrupt cut
    the statement off. None: raise ``exc`` as it is."""
    dialect = conn.dialect
    error: Any = dialect.loaded_dbapi.Error
    if isinstance(exc, error):
        gone = dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)
        if gone:
            conn.invalidate(exc)
        wrapped: BaseException = DBAPIError.instance(
            None, None, exc, error, connection_invalidated=gone, dialect=dialect
        )
        return wrapped
    if not isinstance(exc, Exception):  # cut off mid-statement: its state is unknown
        conn.invalidate()
    return None
