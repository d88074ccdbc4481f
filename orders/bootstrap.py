"""Turn Settings into a running service: the one place that connects to anything."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from orders.config import Settings
from orders.config.urls import SecretUrl
from orders.domain import Clock
from orders.embedded.server import check_can_start, database_url
from orders.errors import InvalidInput, SchemaNotReady
from orders.index.errors import no_cluster_node
from orders.index.nodes import RedisClient
from orders.service import OrderService
from orders.sql import engine

log = logging.getLogger(__name__)

#: A pooled connection to one Redis server idle this long is pinged before its next use
#: (the clients the service builds, sync and asyncio; a host's own client keeps its own).
HEALTH_CHECK_INTERVAL_S = 30


def build_engine(settings: Settings, url: str | None = None) -> Engine:
    """:func:`orders.sql.engine.build_engine` for ``url``, by default the configured one
    (else the embedded SQLite file)."""
    return engine.build_engine(settings, url or database_url(settings))


def build_async_engine(settings: Settings, url: str | None = None) -> AsyncEngine:
    """:func:`orders.sql.engine.build_async_engine` for ``url`` (default as above)."""
    return engine.build_async_engine(settings, url or database_url(settings))


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
    (:mod:`orders.embedded.client`); a configured server is never started by us. With
    ``redis_cluster`` the URL names one node of a Redis Cluster, and the client is
    redis-py's ``RedisCluster``: it learns the other nodes from that one.
    """
    options: dict[str, Any] = {
        "socket_connect_timeout": settings.redis_socket_timeout_s,
        "health_check_interval": HEALTH_CHECK_INTERVAL_S,
        "retry": redis_retry(cluster=False),
    }
    if settings.redis_url is None:
        from orders.embedded.client import RestartingRetry, embedded_client  # noqa: PLC0415

        log.debug("redis client for the embedded server of %s", settings.home)
        options["retry"] = redis_retry(cluster=False, kind=RestartingRetry)
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
        raise no_cluster_node(url, exc) from None


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
    check_embedded_redis(settings)
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


def check_embedded_redis(settings: Settings) -> None:
    """With no ``redis_url``, raise before anything is written (the home, the SQLite file)
    when the embedded server neither runs nor can be started: no redis-server or
    valkey-server found, or one too old (:func:`orders.embedded.server.check_can_start`)."""
    if settings.redis_url is None:
        check_can_start(settings.home)


def check_schema(engine: Engine, settings: Settings) -> None:
    """The embedded SQLite file is migrated on first use; any other database must be at
    the newest revision already (:class:`SchemaNotReady`)."""
    if settings.database_url is None:
        ensure_embedded_schema(engine, settings.home)
    else:
        ensure_schema(engine)


def ensure_schema(engine: Engine) -> None:
    """Raise SchemaNotReady unless the database is at the newest revision; SchemaConflict
    when it records no revision of ours yet our tables' names are taken (an upgrade would
    refuse too, so "run `orders db upgrade`" would send the operator round in a loop)."""
    from orders.sql import migrate  # noqa: PLC0415  (alembic is only needed here)

    if not migrate.is_current(engine):
        migrate.refuse_unrecorded_schema(engine)
        raise SchemaNotReady("the database schema is missing or behind this version")


def ensure_embedded_schema(engine: Engine, home: Path) -> None:
    """Migrate the embedded SQLite file, one process at a time."""
    from orders.embedded.locks import file_lock  # noqa: PLC0415
    from orders.sql import migrate  # noqa: PLC0415

    if migrate.is_current(engine):
        return
    with file_lock(home / "schema.lock", store="sql", timeout_s=60):
        if not migrate.is_current(engine):
            migrate.upgrade(engine)
