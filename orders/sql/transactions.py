"""How a use case opens its one SQL transaction on each engine.

* SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock up front, so a read-then-write
  transaction never fails to upgrade, and it serialises the limit guard. Threads of one
  process queue on a lock of their own first: SQLite's busy handler sleeps and retries,
  which left writers waiting far longer than the lock was held (the bench measured p99
  85 ms, 13.5 ms with the queue).
* PostgreSQL: READ COMMITTED, the server's default. No use case counts then writes: the
  unpaid limit is a unique index (``orders.sql.slots``), every transition a compare-and-set.

Driver errors leave as :class:`~orders.errors.StoreUnavailable` (``failures.sql_errors``).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine

from orders.sql.direct import drives, raise_as_sqlalchemy
from orders.sql.engine import refuse_replaced_sqlite_file
from orders.sql.failures import sql_errors

_SQLITE_WRITERS: weakref.WeakKeyDictionary[Engine, threading.Lock] = weakref.WeakKeyDictionary()
_SQLITE_WRITERS_GUARD = threading.Lock()


def _sqlite_write_lock(engine: Engine) -> threading.Lock:
    """One lock per SQLite engine in this process, shared by every service on it (the
    threads of :mod:`orders.aio` included)."""
    with _SQLITE_WRITERS_GUARD:
        lock = _SQLITE_WRITERS.get(engine)
        if lock is None:
            lock = threading.Lock()
            _SQLITE_WRITERS[engine] = lock
        return lock


def begin_immediate(conn: Connection) -> None:
    """SQLite: begin ``conn``'s transaction with ``BEGIN IMMEDIATE``. SQLAlchemy begins its
    own (pysqlite sends nothing for it); the statement goes straight to sqlite3
    (:mod:`orders.sql.direct`: SQLAlchemy's execution of it cost more than SQLite's)."""
    conn.begin()
    if drives(conn.dialect):
        driver: Any = conn.connection.driver_connection
        try:
            driver.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            raise_as_sqlalchemy(conn, exc)
    else:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


class Transactions:
    """Opens read connections and write transactions on one engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect = engine.dialect.name
        refuse_replaced_sqlite_file(engine)  # a host's own SQLite engine too (issue 46)
        self._autocommit = (
            engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.dialect == "postgresql"
            else None
        )

    @contextmanager
    def read(self, host: Connection | None = None) -> Iterator[Connection]:
        """A connection for reads. At READ COMMITTED every statement reads a snapshot of its
        own anyway, so on PostgreSQL the reads run in autocommit: no BEGIN, no ROLLBACK.
        With ``host``, the host's transaction (it sees the host's own writes)."""
        if host is not None:
            with sql_errors():
                yield host
            return
        with sql_errors(), (self._autocommit or self.engine).connect() as conn:
            yield conn

    @contextmanager
    def write(self, host: Connection | None = None, *, queue: bool = True) -> Iterator[Connection]:
        """A write transaction; the caller commits (:meth:`commit`). Leaving without commit
        rolls back. With ``host``, the host's transaction instead (:meth:`in_host`).

        ``queue=False`` (SQLite): take the write lock without queueing on this process's
        lock first, for a transaction that runs someone else's code: should that code open
        a write of its own on the engine, it waits out the busy timeout and fails, where
        behind our queue it would wait for ever."""
        if host is not None:
            with self.in_host(host) as conn:
                yield conn
            return
        if self.dialect == "sqlite":
            queued = _sqlite_write_lock(self.engine) if queue else contextlib.nullcontext()
            with queued, sql_errors(), self.engine.connect() as conn:
                begin_immediate(conn)
                yield conn
            return
        with sql_errors(), self.engine.connect() as conn:
            yield conn

    @contextmanager
    def statements(self, host: Connection | None = None) -> Iterator[Connection]:
        """For work where each statement is a whole transaction on its own (a compare-and-set
        with its event in one statement, a read): PostgreSQL runs them in autocommit, which
        saves the BEGIN and COMMIT round trips; elsewhere (or with ``host``) this is
        :meth:`write`."""
        if self._autocommit is None or host is not None:
            with self.write(host) as conn:
                yield conn
            return
        with sql_errors(), self._autocommit.connect() as conn:
            yield conn

    @contextmanager
    def in_host(self, host: Connection) -> Iterator[Connection]:
        """Work in the host's transaction, which only the host commits or rolls back.

        On PostgreSQL in a savepoint of it: a statement of ours that fails (a duplicate id)
        would otherwise abort the host's whole transaction. SQLite undoes only the failed
        statement anyway, and its driver's savepoints are unsafe in a transaction it has not
        begun yet (the RELEASE would commit it), so none there. No process lock either:
        the host's transaction is not ours to queue.
        """
        with sql_errors():
            if self.dialect == "postgresql":
                with host.begin_nested():
                    yield host
            else:
                yield host

    @staticmethod
    def commit(conn: Connection, host: Connection | None) -> None:
        """Commit our own transaction; never the host's."""
        if host is None:
            conn.commit()
