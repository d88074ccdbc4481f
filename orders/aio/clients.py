"""The synchronous twins of the stores a host hands to :class:`~orders.aio.AsyncOrderService`.

The service's core runs in threads (:mod:`orders.aio.calls`), so it talks to the stores
through blocking clients: for a ``redis.asyncio`` client, a redis-py client of the same
server or cluster with the same options (:func:`sync_redis`); for an ``AsyncEngine``, an
engine of the same database on its synchronous driver (:func:`sync_engine`). Each keeps its
own connections: the host's pools are its own, used by its own awaits.

What a Redis connection carries over: where the server is, who we are, how long to wait,
how often to check an idle connection, which errors and timeouts to retry, the protocol,
and every TLS setting (``ssl_*``: CA, client certificate and key, verification mode,
host-name check, minimum version, ciphers). What stays the host's: its pool, its parser,
its Retry (the twin retries by the service's policy), its encoder (the twin reads bytes).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from sqlalchemy import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from orders.bootstrap import build_engine, redis_retry
from orders.config import Settings
from orders.errors import InvalidInput
from orders.index.errors import no_cluster_node
from orders.index.nodes import RedisClient

AsyncRedisClient = redis.asyncio.Redis | AsyncRedisCluster

#: The twin's pools have no cap of their own: the service's threads bound how many
#: connections are in use at once (redis-py 8's default cap of 100 would fail a call past
#: it, with MaxConnectionsError, where there are more threads).
UNCAPPED = 2**31 - 1

#: The options of a connection that the twin takes over (the ``ssl_*`` ones besides).
CARRIED = frozenset(
    {
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "credential_provider",
        "client_name",
        "lib_name",
        "lib_version",
        "driver_info",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "socket_read_size",
        "health_check_interval",
        "retry_on_timeout",
        "retry_on_error",
        "protocol",
        "legacy_responses",
    }
)

#: A connection class of redis.asyncio -> its synchronous counterpart (most specific first).
TWIN_CLASSES: tuple[tuple[type[Any], type[redis.connection.AbstractConnection]], ...] = (
    (redis.asyncio.SSLConnection, redis.SSLConnection),
    (redis.asyncio.UnixDomainSocketConnection, redis.UnixDomainSocketConnection),
    (redis.asyncio.Connection, redis.Connection),
)

#: The SQLAlchemy drivers of an ``AsyncEngine`` -> the synchronous driver of that database.
SYNC_DRIVERS = {
    "sqlite+aiosqlite": "sqlite+pysqlite",
    "postgresql+psycopg": "postgresql+psycopg",
    "postgresql+psycopg_async": "postgresql+psycopg",
    "postgresql+asyncpg": "postgresql+psycopg",
}


def check_async_client(client: object) -> AsyncRedisClient | RedisClient:
    """Refuse (InvalidInput) a client that is no redis-py client, or that decodes replies."""
    if isinstance(client, AsyncRedisCluster | RedisCluster):
        decode = client.get_encoder().decode_responses
    elif isinstance(client, redis.asyncio.Redis | redis.Redis):
        decode = client.connection_pool.connection_kwargs.get("decode_responses", False)
    else:
        raise InvalidInput(
            "redis_client", "must be a redis-py Redis or RedisCluster (asyncio or not)"
        )
    if decode:
        raise InvalidInput("redis_client", "must not decode responses (ids are read as bytes)")
    return client


def twin_class(connection_class: type[Any]) -> type[redis.connection.AbstractConnection]:
    for async_class, sync_class in TWIN_CLASSES:
        if issubclass(connection_class, async_class):
            return sync_class
    raise InvalidInput(
        "redis_client", f"its connection class {connection_class.__name__} is not redis-py's"
    )


def carried(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The options of ``kwargs`` the twin takes over (see the module docstring)."""
    return {
        name: value
        for name, value in kwargs.items()
        if name in CARRIED or (name.startswith("ssl") and not name.startswith("ssl_ocsp"))
    }


def sync_redis(client: AsyncRedisClient | RedisClient) -> RedisClient:
    """A redis-py client for ``client``'s server or cluster (``client`` itself when it is
    synchronous already)."""
    check_async_client(client)
    if isinstance(client, redis.Redis | RedisCluster):
        return client
    if isinstance(client, AsyncRedisCluster):
        kwargs = client.connection_kwargs
        # The nodes it was given (it learns the others on its first call, as the twin does).
        given = client.nodes_manager.startup_nodes.values()
        nodes = [ClusterNode(node.host, node.port) for node in given]  # type: ignore[no-untyped-call]
        options = carried(kwargs)
        if issubclass(kwargs["connection_class"], redis.asyncio.SSLConnection):
            options["ssl"] = True
        try:
            return RedisCluster(
                startup_nodes=nodes,
                max_connections=UNCAPPED,  # per node
                retry=redis_retry(cluster=True),
                **options,
            )
        except (redis.RedisError, RedisClusterException) as exc:
            raise no_cluster_node(f"{nodes[0].host}:{nodes[0].port}", exc) from None
    pool = client.connection_pool
    connection_class = twin_class(pool.connection_class)
    options = carried(pool.connection_kwargs)
    accepted = _accepted(connection_class)
    twin_pool = redis.ConnectionPool(
        connection_class=connection_class,
        max_connections=UNCAPPED,
        retry=redis_retry(cluster=False),
        **{name: value for name, value in options.items() if accepted(name)},
    )
    return redis.Redis(connection_pool=twin_pool)


def _accepted(connection_class: type[Any]) -> Any:
    """Whether ``connection_class`` (or one of its bases) takes an option by that name."""
    names: set[str] = set()
    for cls in connection_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            names.update(inspect.signature(init).parameters)
    return names.__contains__


def sync_engine(engine: AsyncEngine | Engine, settings: Settings) -> Engine:
    """An engine of ``engine``'s database on its synchronous driver, with the service's
    pool and connection settings (``engine`` itself when it is synchronous already)."""
    if isinstance(engine, Engine):
        return engine
    url = engine.url
    driver = SYNC_DRIVERS.get(url.drivername)
    if driver is None:
        raise InvalidInput(
            "engine", f"orders.aio has no synchronous driver for {url.drivername} here"
        )
    return build_engine(settings, url.set(drivername=driver).render_as_string(hide_password=False))
