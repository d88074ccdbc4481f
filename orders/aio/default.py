"""The async service configured from ``ORDERS_*``, and the module-level functions on it."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis.asyncio
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from orders.aio.calls import in_thread, new_lock
from orders.aio.clients import AsyncRedisClient
from orders.aio.service import AsyncOrderService
from orders.bootstrap import (
    HEALTH_CHECK_INTERVAL_S,
    build_engine,
    build_redis,
    check_embedded_redis,
    check_schema,
)
from orders.config import Settings
from orders.domain import Clock
from orders.errors import InvalidInput

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _checked_service(settings: Settings, clock: Clock | None) -> AsyncOrderService:
    """As :func:`orders.bootstrap.build_service` does (blocking: run in a thread): the
    schema checked, then the service on the configured stores (the embedded Redis server
    started if none runs; the client starts it again whenever it finds it gone)."""
    check_embedded_redis(settings)
    engine = build_engine(settings)
    try:
        check_schema(engine, settings)
        return AsyncOrderService(engine, build_redis(settings), settings, clock=clock)
    except BaseException:
        engine.dispose()
        raise


def _embedded_url(settings: Settings) -> str:
    from orders.embedded.server import ensure_redis  # noqa: PLC0415

    return ensure_redis(settings.home).url


async def async_redis(settings: Settings) -> AsyncRedisClient:
    """A ``redis.asyncio`` client for the configured server or cluster (the embedded server
    is started first when none runs), as a host would build one: the tests and the bench
    hand it to :class:`AsyncOrderService` the way an application does."""
    timeouts: dict[str, Any] = {
        "socket_timeout": settings.redis_socket_timeout_s,
        "socket_connect_timeout": settings.redis_socket_timeout_s,
    }
    one_server = {**timeouts, "health_check_interval": HEALTH_CHECK_INTERVAL_S}
    if settings.redis_url is None:
        url = await in_thread(_embedded_url, settings)
        return redis.asyncio.Redis.from_url(url, **one_server)
    try:
        if settings.redis_cluster:
            return AsyncRedisCluster.from_url(settings.redis_url.reveal(), **timeouts)
        return redis.asyncio.Redis.from_url(settings.redis_url.reveal(), **one_server)
    except ValueError:
        raise InvalidInput("redis_url", "refused by redis-py") from None


async def build_async_service(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    startup_warnings: bool = True,
) -> AsyncOrderService:
    """:func:`orders.bootstrap.build_service` for asyncio: the configured stores, the schema
    checked, the Redis server's risky configuration logged; connected before it returns."""
    settings = settings or Settings.from_env()
    service = await in_thread(_checked_service, settings, clock)
    try:
        core = await service.core()
        if startup_warnings:
            for warning in await service.calls.call(core.index.server_warnings):
                log.warning("%s", warning)
    except BaseException:
        await service.aclose()
        raise
    return service


_default: AsyncOrderService | None = None
_default_lock: AbstractAsyncContextManager[Any] | None = None


async def default_service() -> AsyncOrderService:
    """The service behind the module-level functions, built from ``ORDERS_*`` on first use
    (on the event loop that first uses it)."""
    global _default, _default_lock  # noqa: PLW0603
    if _default is None:
        _default_lock = _default_lock or new_lock()
        async with _default_lock:
            if _default is None:
                _default = await build_async_service()
    return _default


def configure(service: AsyncOrderService | None) -> None:
    """Bind the module-level functions to ``service`` (None: rebuild from the environment
    on next use; the service bound before is not closed)."""
    global _default, _default_lock
    _default, _default_lock = service, None


def on_default(
    method: Callable[Concatenate[AsyncOrderService, P], Coroutine[Any, Any, R]],
) -> Callable[P, Coroutine[Any, Any, R]]:
    """``method`` of :class:`AsyncOrderService` as a function on the default service."""

    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return await method(await default_service(), *args, **kwargs)

    return functools.wraps(method)(call)
