"""Building SQLAlchemy engines with the service's pool, timeout and connection settings.

Which URL to use (the configured one, else the embedded SQLite file) is decided above, in
:func:`orders.bootstrap.build_engine`; Alembic's ``env.py`` builds its engine here too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import parse_qs, unquote, urlsplit

from sqlalchemy import URL, Engine, create_engine, event
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, ConnectionPoolEntry

from orders import metrics
from orders.config import Settings
from orders.config.urls import check_database_url
from orders.errors import InvalidInput, StoreUnavailable

log = logging.getLogger("orders.bootstrap")  # the name it logged under before the move

EngineT = TypeVar("EngineT", Engine, AsyncEngine)


def build_engine(settings: Settings, url: str) -> Engine:
    """An engine for ``url`` with the service's pool settings.

    SQLite files run in WAL mode with foreign keys on and a busy timeout, so readers never
    block the writer and writers queue instead of failing. A URL SQLAlchemy cannot use, or
    whose driver is not installed, is InvalidInput; nothing has connected by then.
    """
    target, kwargs = _engine_plan(settings, url)
    engine = _created(target, lambda: create_engine(target, **kwargs))
    return _prepared(engine, target)


def build_async_engine(settings: Settings, url: str) -> AsyncEngine:
    """:func:`build_engine` for asyncio (:mod:`orders.aio`): the same pool and connection
    settings, on the async driver of the same database (aiosqlite; psycopg's async side)."""
    target, kwargs = _engine_plan(settings, url)
    if target.get_backend_name() == "sqlite":
        target = target.set(drivername="sqlite+aiosqlite")
        if "pool_size" in kwargs:  # a file: SQLAlchemy 2.0 would give aiosqlite a NullPool
            kwargs["poolclass"] = AsyncAdaptedQueuePool
    engine = _created(target, lambda: create_async_engine(target, **kwargs))
    _prepared(engine.sync_engine, target)
    return engine


def _engine_plan(settings: Settings, url: str) -> tuple[URL, dict[str, Any]]:
    target = check_database_url(url)
    if target.drivername == "postgresql":  # a bare URL means psycopg 3, the driver we ship
        target = target.set(drivername="postgresql+psycopg")
    kwargs: dict[str, Any] = {}
    backend = target.get_backend_name()
    if backend == "sqlite":
        kwargs["connect_args"] = {"timeout": settings.sql_busy_timeout_s}
    if backend != "sqlite" or target.database not in (None, "", ":memory:"):
        # A file database gets a queue pool like a server does (memory ones a single one).
        kwargs.update(
            pool_size=settings.sql_pool_size,
            max_overflow=settings.sql_max_overflow,
            pool_timeout=settings.sql_pool_timeout_s,
        )
    if backend == "postgresql" and target.get_driver_name() in ("psycopg", "psycopg2"):
        kwargs["connect_args"] = {"options": _session_options(settings)}
        if settings.sql_connect_timeout_s > 0:
            # Without it, a connect to a server that accepts but never answers (a host
            # stuck in its start-up, a half-open proxy) waits forever: pool_timeout only
            # bounds the wait for a pooled connection, not the opening of a new one.
            timeout_s = math.ceil(settings.sql_connect_timeout_s)
            kwargs["connect_args"]["connect_timeout"] = timeout_s
    return target, kwargs


def _session_options(settings: Settings) -> str:
    """The server settings of each session the engine opens (libpq ``options``).

    Besides the statement timeout, two bound what a frozen process costs the others: a
    session idle inside a transaction is ended (its locks go), and a statement waiting on a
    row lock gives up, as ``StoreUnavailable``, instead of waiting out the statement timeout.
    Unset, they follow the lease: a frozen holder's locks go (half of it) before a waiting
    statement gives up (all of it), and both before a standby takes over.
    """
    idle_s, lock_s, lease_s = (
        settings.sql_idle_in_transaction_timeout_s,
        settings.sql_lock_timeout_s,
        settings.lease_ttl_s,
    )
    timeouts_s = {
        "statement_timeout": settings.sql_statement_timeout_s,
        "lock_timeout": lease_s if lock_s is None else lock_s,
        "idle_in_transaction_session_timeout": lease_s / 2 if idle_s is None else idle_s,
    }
    return " ".join(f"-c {name}={round(s * 1000)}" for name, s in timeouts_s.items())


def _created(target: URL, create: Callable[[], EngineT]) -> EngineT:
    try:
        return create()
    except ImportError as exc:
        raise InvalidInput(
            "database_url", f"the driver of {target.drivername} needs {exc.name}, not installed"
        ) from exc
    except (ArgumentError, ValueError, TypeError) as exc:
        # from None: an option's message may quote the URL's query, password included.
        raise InvalidInput(
            "database_url", f"refused by SQLAlchemy ({type(exc).__name__})"
        ) from None


def _prepared(engine: Engine, target: URL) -> Engine:
    if target.get_backend_name() == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
        refuse_replaced_sqlite_file(engine)
    else:
        ping_idle_connections(engine)
    log.debug("sql engine for %s", target.render_as_string(hide_password=True))
    return engine


#: A pooled connection idle at least this long is pinged at checkout; a busier one is not.
PING_IDLE_S = 5.0


def ping_idle_connections(engine: Engine) -> None:
    """Ping a pooled connection at checkout when it sat idle for ``PING_IDLE_S`` or more.

    A server drops connections that idle (a timeout, a proxy, a restart long past): those
    are pinged and, if dead, replaced before anyone uses them. SQLAlchemy's
    ``pool_pre_ping`` pings every checkout instead: one round trip more on every use case,
    about 15 % of a create on a unix socket. A connection in steady use that finds the
    server gone (a restart under load) fails its statement once; SQLAlchemy then
    invalidates the pool, so the caller gets StoreUnavailable and the next call a new
    connection.
    """

    @event.listens_for(engine, "checkin")
    def idle_from(_dbapi_connection: Any, record: ConnectionPoolEntry) -> None:
        record.info["idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def ping_if_idle(dbapi_connection: Any, record: ConnectionPoolEntry, _proxy: Any) -> None:
        since = record.info.get("idle_since")
        if since is None or time.monotonic() - since < PING_IDLE_S:
            return  # new, or in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            # The pool discards this connection and checks out another (up to 3 times).
            raise DisconnectionError("an idle pooled connection failed its ping") from exc


def sqlite_file(engine: Engine) -> str | None:
    """The absolute path of the file an SQLite engine opens, or None for a memory database
    (``sqlite://``, ``:memory:``, ``mode=memory``): as the driver receives it."""
    cargs, cparams = engine.dialect.create_connect_args(engine.url)
    filename = str(cargs[0]) if cargs else ""
    if cparams.get("uri") and filename.startswith("file:"):
        parts = urlsplit(filename)
        if "memory" in parse_qs(parts.query).get("mode", []):
            return None
        filename = unquote(parts.path)
    if filename in ("", ":memory:"):
        return None
    return os.path.abspath(filename)


MARKER_TEXT = """\
A database of `orders` was opened at {path} on the date above. While this file stays, a
process that finds that file missing refuses to create an empty one there.
`orders db upgrade --new` removes this file and creates an empty database.
"""


def opened_marker(path: str) -> str:
    """The marker of the SQLite file ``path`` (``.orders.db.opened`` beside ``orders.db``):
    the date a process first opened it; named so that ``rm orders.db*`` leaves it."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.opened")


def forget_missing_sqlite_file(engine: Engine) -> None:
    """Remove the marker of ``engine``'s SQLite file when the file is missing, so the next
    connection creates an empty database there (``orders db upgrade --new``)."""
    path = sqlite_file(engine) if engine.dialect.name == "sqlite" else None
    if path is not None and not os.path.exists(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(opened_marker(path))


_GUARDED: weakref.WeakSet[Engine] = weakref.WeakSet()
_GUARDING = threading.Lock()


def refuse_replaced_sqlite_file(engine: Engine) -> None:
    """Refuse every checkout once the file at the path is not the one the engine opened.

    A pooled SQLite connection holds its file open: after ``rm orders.db`` (or a file moved
    over it) it reads and writes the unlinked file, and whatever it commits is lost with it.
    So each checkout (and each connection about to open the path) stats the path, about a
    microsecond, and compares (st_dev, st_ino) with the first file found. A mismatch, or no
    file, is StoreUnavailable naming the path until the process restarts (opening the path
    again would give an empty database as if nothing had happened); the file put back (the
    same inode) serves again, and a transaction begun before is refused at its commit.
    Memory databases have no file. Once per engine: the service guards every engine it is
    given, a host's own too.
    """
    path = sqlite_file(engine) if engine.dialect.name == "sqlite" else None
    with _GUARDING:
        if path is None or engine in _GUARDED:
            return
        _GUARDED.add(engine)
    guard = SqliteFileGuard(path)

    @event.listens_for(engine, "do_connect")
    def before_connect(*_args: Any) -> None:
        guard.check()  # returns None: the driver then connects as usual

    @event.listens_for(engine, "checkout")
    def at_checkout(*_args: Any) -> None:
        guard.check()

    @event.listens_for(engine, "commit")
    def before_commit(*_args: Any) -> None:
        # A transaction that checked out before the file went must not commit into it:
        # refused here, it is rolled back, and its caller undoes what it did in Redis.
        guard.check()


class SqliteFileGuard:
    """The file behind ``path`` as first found, and the check that it is still there."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.opened: tuple[int, int] | None = None  # (st_dev, st_ino), set by the first check
        self._told = threading.Event()

    def check(self) -> None:
        """Raise StoreUnavailable unless the path still leads to the first file found."""
        found = self._identity()
        if self.opened is None:
            if found is None:
                self._refuse_a_deleted_file()
            else:
                self._mark_opened()
            self.opened = found  # None until a connection has created the file
            return
        if found == self.opened:
            return
        metrics.STORE_ERRORS.labels("sql").inc()
        what = "deleted" if found is None else "replaced by another file"
        detail = f"the SQLite file {self.path} was {what} after this process opened it; restart it"
        if not self._told.is_set():
            self._told.set()
            log.error("sql: %s (reads and writes are refused until then)", detail)
        raise StoreUnavailable("sql", detail)

    def _refuse_a_deleted_file(self) -> None:
        """Refused before the driver creates an empty file where a database was: its -wal or
        -shm are there (deleted while a process holds it open: SQLite keeps them until its
        last close), or its marker (:func:`opened_marker`: every process stopped since)."""
        if any(os.path.exists(self.path + end) for end in ("-wal", "-shm")):
            detail = (
                "its -wal and -shm are not: it was deleted while processes had it open (its "
                "rows live until they stop); nothing was created. Restore it, or stop them, "
                "remove the -wal and -shm and run `orders db upgrade --new`"
            )
        else:
            try:
                with open(opened_marker(self.path), encoding="utf-8") as marker:
                    since = marker.readline().strip()
            except FileNotFoundError:
                return  # a first use
            detail = (
                f"where one was first opened on {since}; nothing was created. Restore it, or "
                "run `orders db upgrade --new` for an empty database"
            )
        metrics.STORE_ERRORS.labels("sql").inc()
        raise StoreUnavailable("sql", f"the SQLite file {self.path} is missing {detail}")

    def _mark_opened(self) -> None:
        """Leave the marker beside the file, once: it outlives ``rm orders.db*``."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        try:
            with open(opened_marker(self.path), "x", encoding="utf-8") as marker:
                marker.write(f"{now}\n{MARKER_TEXT.format(path=self.path)}")
        except FileExistsError:
            return
        except OSError as exc:  # a read-only folder: the guard works on without it
            log.warning("sql: no marker beside %s: %s", self.path, exc.strerror)

    def _identity(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            detail = f"the SQLite file {self.path} cannot be checked: {exc.strerror}"
            raise StoreUnavailable("sql", detail) from exc
        return stat.st_dev, stat.st_ino


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()
