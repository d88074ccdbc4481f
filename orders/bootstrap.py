"""Turn Settings into a running service: the one place that connects to anything."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from sqlalchemy import URL, Engine, create_engine, event
from sqlalchemy.exc import ArgumentError, DisconnectionError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import AsyncAdaptedQueuePool, ConnectionPoolEntry

from orders.config import SecretUrl, Settings, check_database_url
from orders.domain import Clock
from orders.errors import InvalidInput, SchemaNotReady, StoreUnavailable
from orders.redis_nodes import RedisClient
from orders.service import OrderService

log = logging.getLogger(__name__)

EngineT = TypeVar("EngineT", Engine, AsyncEngine)


def database_url(settings: Settings) -> str:
    """The configured URL (revealed: for the driver), or the embedded SQLite file."""
    if settings.database_url is not None:
        return settings.database_url.reveal()
    from orders.embedded import sqlite_url  # noqa: PLC0415

    settings.home.mkdir(parents=True, exist_ok=True)
    return sqlite_url(settings.home)


def build_engine(settings: Settings, url: str | None = None) -> Engine:
    """An engine for ``url`` (default: the configured one) with the service's pool settings.

    SQLite files run in WAL mode with foreign keys on and a busy timeout, so readers never
    block the writer and writers queue instead of failing. A URL SQLAlchemy cannot use, or
    whose driver is not installed, is InvalidInput; nothing has connected by then.
    """
    target, kwargs = _engine_plan(settings, url)
    engine = _created(target, lambda: create_engine(target, **kwargs))
    return _prepared(engine, target)


def build_async_engine(settings: Settings, url: str | None = None) -> AsyncEngine:
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


def _engine_plan(settings: Settings, url: str | None) -> tuple[URL, dict[str, Any]]:
    target = check_database_url(url or database_url(settings))
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
        timeout_ms = round(settings.sql_statement_timeout_s * 1000)
        kwargs["connect_args"] = {"options": f"-c statement_timeout={timeout_ms}"}
        if settings.sql_connect_timeout_s > 0:
            # Without it, a connect to a server that accepts but never answers (a host
            # stuck in its start-up, a half-open proxy) waits forever: pool_timeout only
            # bounds the wait for a pooled connection, not the opening of a new one.
            timeout_s = math.ceil(settings.sql_connect_timeout_s)
            kwargs["connect_args"]["connect_timeout"] = timeout_s
    return target, kwargs


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


def _sqlite_pragmas(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def redis_retry(*, cluster: bool, kind: type[Retry] = Retry) -> Retry:
    """The service's Redis retry policy (``kind``: the Retry class that sleeps).

    On one server, one quick retry covers a connection the server dropped (for the
    embedded server, the retry's reconnect is what starts it again); more would only
    stretch an outage past the socket timeout the caller chose. The cluster client retries
    longer: after a failed node it reloads the slot map and tries again, long enough to
    ride out a replica's promotion.
    """
    if cluster:
        return kind(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 3)
    return kind(ExponentialWithJitterBackoff(base=0.01, cap=0.1), 1)


def build_redis(settings: Settings) -> RedisClient:
    """A redis-py client for the configured URL, or for the embedded server of ``home``.

    The embedded one also starts its server again when it finds it gone
    (:mod:`orders.embedded_client`); a configured server is never started by us. With
    ``redis_cluster`` the URL names one node of a Redis Cluster, and the client is
    redis-py's ``RedisCluster``: it learns the other nodes from that one.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_socket_timeout_s,
        "health_check_interval": 30,
        "retry": redis_retry(cluster=False),
    }
    if settings.redis_url is None:
        from orders.embedded_client import embedded_client  # noqa: PLC0415

        log.debug("redis client for the embedded server of %s", settings.home)
        return embedded_client(
            settings.home, socket_timeout=settings.redis_socket_timeout_s, **options
        )
    url: SecretUrl = settings.redis_url
    log.debug("redis %s for %s", "cluster client" if settings.redis_cluster else "client", url)
    try:
        if settings.redis_cluster:
            options["retry"] = redis_retry(cluster=True)
            del options["health_check_interval"]
            return RedisCluster.from_url(
                url.reveal(), socket_timeout=settings.redis_socket_timeout_s, **options
            )
        return redis.Redis.from_url(
            url.reveal(), socket_timeout=settings.redis_socket_timeout_s, **options
        )
    except ValueError:
        # Settings checked the URL already; from None: redis-py's message may quote it.
        raise InvalidInput("redis_url", "refused by redis-py") from None
    except (redis.RedisError, RedisClusterException) as exc:
        # Only the cluster client connects at once: it reads the slot map from the node.
        raise StoreUnavailable(
            "redis", f"no cluster node answered at {url} ({type(exc).__name__})"
        ) from None


def build_service(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    startup_warnings: bool = True,
) -> OrderService:
    """A service on the configured stores, its schema checked.

    The embedded SQLite file is migrated on first use; any other database must have been
    upgraded already (``orders db upgrade``), else :class:`SchemaNotReady`. The Redis
    server's risky configuration is logged unless ``startup_warnings`` is off (a one-shot
    command, whose stderr is its one error line).
    """
    settings = settings or Settings.from_env()
    engine = build_engine(settings)
    try:
        check_schema(engine, settings)
        service = OrderService(engine, build_redis(settings), settings, clock=clock)
        for warning in service.index.server_warnings() if startup_warnings else []:
            log.warning("%s", warning)
        return service
    except BaseException:
        engine.dispose()
        raise


def check_schema(engine: Engine, settings: Settings) -> None:
    """The embedded SQLite file is migrated on first use; any other database must be at
    the newest revision already (:class:`SchemaNotReady`)."""
    if settings.database_url is None:
        ensure_embedded_schema(engine, settings.home)
    else:
        ensure_schema(engine)


def ensure_schema(engine: Engine) -> None:
    """Raise SchemaNotReady unless the database is at the newest revision."""
    from orders import migrate  # noqa: PLC0415  (alembic is only needed here)

    if not migrate.is_current(engine):
        raise SchemaNotReady("the database schema is missing or behind this version")


def ensure_embedded_schema(engine: Engine, home: Path) -> None:
    """Migrate the embedded SQLite file, one process at a time."""
    from orders import migrate  # noqa: PLC0415
    from orders.host import file_lock  # noqa: PLC0415

    if migrate.is_current(engine):
        return
    with file_lock(home / "schema.lock", store="sql", timeout_s=60):
        if not migrate.is_current(engine):
            migrate.upgrade(engine)
