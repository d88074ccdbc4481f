"""AsyncOrderService: the use cases of :class:`~orders.service.OrderService`, awaited.

It holds no rule of its own. Each method awaits the synchronous service's method, run by
:func:`orders.aio.greenlets.run` on the caller's event loop over the same stores: SQL
through ``AsyncEngine.sync_engine`` (the async driver underneath), Redis through
:func:`orders.aio.loop_redis.loop_client`. Validation, the scripts, the statements, the
errors and the outbox events are therefore those of the synchronous API, by construction.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from sqlalchemy import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from orders import metrics
from orders.aio.greenlets import LoopRetry, run
from orders.aio.loop_redis import (
    AsyncRedisClient,
    check_async_client,
    disconnect,
    loop_client,
)
from orders.bootstrap import redis_retry
from orders.config import Settings
from orders.domain import Clock
from orders.errors import InvalidInput
from orders.service import OrderService

P = ParamSpec("P")
R = TypeVar("R")


class Awaited(Generic[P, R]):
    """An :class:`OrderService` method as a coroutine method of :class:`AsyncOrderService`:
    the same parameters, documentation and result, run by :func:`run` on the caller's
    loop. Written once here, so no use case's signature or body is written twice."""

    def __init__(self, method: Callable[Concatenate[OrderService, P], R]) -> None:
        self.method = method
        functools.update_wrapper(self, method)

    @overload
    def __get__(self, service: None, owner: type[Any]) -> Awaited[P, R]: ...

    @overload
    def __get__(
        self, service: AsyncOrderService, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...

    def __get__(
        self, service: AsyncOrderService | None, owner: type[Any]
    ) -> Awaited[P, R] | Callable[P, Coroutine[Any, Any, R]]:
        if service is None:
            return self
        return functools.partial(self, service)

    async def __call__(self, service: AsyncOrderService, *args: P.args, **kwargs: P.kwargs) -> R:
        given = {**kwargs}
        if given.get("connection") is not None:
            given["connection"] = sync_side(given["connection"])
        return await run(self.method, await service.core(), *args, **given)


def sync_side(connection: object) -> Connection | Session:
    """The synchronous Connection or Session under the host's ``AsyncConnection`` or
    ``AsyncSession`` (their public ``sync_connection`` / ``sync_session``): what the core's
    one copy of the rules writes on, in the greenlet the host's own awaits run in too.
    :class:`InvalidInput` for anything else (a synchronous connection included)."""
    if isinstance(connection, AsyncSession):
        return connection.sync_session
    if isinstance(connection, AsyncConnection):
        sync = connection.sync_connection
        if sync is None:
            raise InvalidInput("connection", "the AsyncConnection is not started")
        return sync
    raise InvalidInput(
        "connection",
        f"orders.aio takes an AsyncConnection or AsyncSession, not {type(connection).__name__}",
    )


class AsyncOrderService:
    """The order-expiry service for asyncio code (FastAPI, Starlette, Litestar, ...).

    Built from the ``AsyncEngine`` and ``redis.asyncio`` client an application has::

        engine = create_async_engine("postgresql+psycopg://...")
        client = redis.asyncio.Redis.from_url("redis://...")
        async with AsyncOrderService(engine, client, Settings(unpaid_limit=3)) as service:
            order = await service.create_unpaid_order("user-1")

    ``create_unpaid_order``, ``mark_paid`` and ``cancel_order`` take the host's
    ``AsyncConnection`` or ``AsyncSession`` as ``connection=``, with the meaning the
    synchronous methods give a ``Connection`` or ``Session``.

    The schema must exist, as for the synchronous service. Nothing connects until the
    first call, or until ``await service.core()``, which an application's start-up (a
    lifespan hook) can call to pay the one-time cost before traffic: on a Redis Cluster,
    redis-py reads the slot map and the command table on the loop, 10 to 25 ms of CPU.
    ``aclose()`` (or leaving ``async with``) disposes of the engine and closes the client.
    Use one instance from one event loop.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        redis_client: AsyncRedisClient,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.engine = engine
        self.redis_client = check_async_client(redis_client)
        self._clock = clock
        self._core: OrderService | None = None
        self._starting: asyncio.Lock | None = None

    async def core(self) -> OrderService:
        """The synchronous service this one runs (built on first use, on this loop)."""
        if self._core is None:
            self._starting = self._starting or asyncio.Lock()
            async with self._starting:
                if self._core is None:
                    # Importing prometheus-client and registering the metrics costs about
                    # 30 ms of CPU once: in a thread, not on the loop at the first count.
                    await asyncio.to_thread(metrics.register)
                    self._core = await run(self._build)
        return self._core

    def _build(self) -> OrderService:
        cluster = isinstance(self.redis_client, AsyncRedisCluster)
        client = loop_client(self.redis_client, redis_retry(cluster=cluster, kind=LoopRetry))
        return OrderService(self.engine.sync_engine, client, self.settings, clock=self._clock)

    async def aclose(self) -> None:
        """Close the Redis connections and dispose of the engine."""
        if self._core is not None:
            await run(self._core.close)
            await run(disconnect, self._core.index.client)
        else:
            await self.engine.dispose()
        await self.redis_client.aclose()

    async def __aenter__(self) -> AsyncOrderService:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    # --- the use cases: OrderService's own, awaited (see Awaited) --------------------------

    create_unpaid_order = Awaited(OrderService.create_unpaid_order)
    mark_paid = Awaited(OrderService.mark_paid)
    cancel_order = Awaited(OrderService.cancel_order)
    extend_order = Awaited(OrderService.extend_order)
    get_order = Awaited(OrderService.get_order)
    list_unpaid = Awaited(OrderService.list_unpaid)
    iter_events = Awaited(OrderService.iter_events)
    sweep_expired = Awaited(OrderService.sweep_expired)
    reconcile = Awaited(OrderService.reconcile)
