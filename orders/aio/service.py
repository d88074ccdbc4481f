"""AsyncOrderService: the use cases of :class:`~orders.service.OrderService`, awaited.

It holds no rule of its own. Each method awaits the synchronous service's method, run in
one of the service's threads (:mod:`orders.aio.calls`) over the synchronous twins of the
host's stores (:mod:`orders.aio.clients`). Validation, the scripts, the statements, the
errors and the outbox events are therefore those of the synchronous API, by construction.

With ``connection=`` (the host's ``AsyncConnection`` or ``AsyncSession``), the call runs
in the host's own transaction instead, through SQLAlchemy's public ``run_sync``: its SQL
statements are awaited on the loop by the host's driver, and its Redis round trip (one
script call; after the host's commit, one more) is made from there too, bounded by the
Redis socket timeout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import redis
from redis.cluster import RedisCluster
from sqlalchemy import Connection, Engine
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from orders import metrics
from orders.aio.calls import CallPool, new_lock, settled
from orders.aio.clients import AsyncRedisClient, check_async_client, sync_engine, sync_redis
from orders.config import Settings
from orders.domain import Clock
from orders.errors import InvalidInput
from orders.index.nodes import RedisClient
from orders.rules.payments import LatePaymentCheck
from orders.rules.sweep import PreCloseCheck
from orders.service import OrderService

P = ParamSpec("P")
R = TypeVar("R")


class Awaited(Generic[P, R]):
    """An :class:`OrderService` method as a coroutine method of :class:`AsyncOrderService`:
    the same parameters, documentation and result, run in the service's threads (or in the
    host's transaction). Written once here, so no use case's signature or body is written
    twice."""

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
        host = kwargs.get("connection")
        if host is not None:
            session = check_host(host)  # before anything connects
        core = await service.core()
        if host is None:
            return await service.calls.call(self.method, core, *args, **kwargs)
        method = self.method

        def in_host(sync: Connection | Session) -> R:
            return method(core, *args, **{**kwargs, "connection": sync})  # type: ignore[arg-type]

        return await settled(session.run_sync(in_host))


def check_host(connection: object) -> AsyncConnection | AsyncSession:
    """The host's started ``AsyncConnection`` or its ``AsyncSession``; :class:`InvalidInput`
    for anything else (a synchronous one included: it belongs to another thread)."""
    if isinstance(connection, AsyncSession):
        return connection
    if isinstance(connection, AsyncConnection):
        if connection.sync_connection is None:
            raise InvalidInput("connection", "the AsyncConnection is not started")
        return connection
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

    A synchronous ``Engine`` and redis-py client are taken as well (as
    :func:`~orders.aio.build_async_service` does). Calls run in ``settings.aio_threads``
    threads of the service's own, over its own connections to the same database and Redis
    (:mod:`orders.aio.clients`); ``settings.aio_queue`` more may wait for one, and a call
    beyond that is refused with :class:`~orders.errors.Overloaded`.

    ``create_unpaid_order``, ``mark_paid`` and ``cancel_order`` take the host's
    ``AsyncConnection`` or ``AsyncSession`` as ``connection=``, with the meaning the
    synchronous methods give a ``Connection`` or ``Session``.

    The schema must exist, as for the synchronous service. Nothing connects until the
    first call, or until ``await service.core()``, which an application's start-up (a
    lifespan hook) can call to pay the one-time cost before traffic. ``aclose()`` (or
    leaving ``async with``) closes the service's connections, disposes of the engine and
    closes the client it was given.
    """

    def __init__(
        self,
        engine: AsyncEngine | Engine,
        redis_client: AsyncRedisClient | RedisClient,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings or Settings()
        if not isinstance(engine, AsyncEngine | Engine):
            raise InvalidInput("engine", "must be a SQLAlchemy AsyncEngine or Engine")
        self.engine = engine
        self.redis_client = check_async_client(redis_client)
        self.calls = CallPool(self.settings.aio_threads, self.settings.aio_queue)
        self._clock = clock
        self._core: OrderService | None = None
        self._late_payment_check: LatePaymentCheck | None = None
        self._pre_close_check: PreCloseCheck | None = None
        self._starting: AbstractAsyncContextManager[Any] | None = None

    async def core(self) -> OrderService:
        """The synchronous service this one runs (built on first use, in a thread)."""
        if self._core is None:
            self._starting = self._starting or new_lock()
            async with self._starting:
                if self._core is None:
                    self._core = await self.calls.call(self._build)
        return self._core

    def _build(self) -> OrderService:
        metrics.register()  # prometheus-client's import and registration: 30 ms of CPU
        # Each thread may hold one SQL connection: the pool is at least that large.
        pool_size = max(self.settings.sql_pool_size, self.settings.aio_threads)
        pooled = dataclasses.replace(self.settings, sql_pool_size=pool_size)
        core = OrderService(
            sync_engine(self.engine, pooled),
            sync_redis(self.redis_client),
            self.settings,
            clock=self._clock,
        )
        core.set_late_payment_check(self._late_payment_check)
        core.set_pre_close_check(self._pre_close_check)
        return core

    async def aclose(self) -> None:
        """Close the service's connections and the stores it was given."""
        if self._core is not None:
            await self.calls.call(self._close_core, self._core)
        if isinstance(self.engine, AsyncEngine):
            await self.engine.dispose()
        else:
            await self.calls.call(self.engine.dispose)
        if isinstance(self.redis_client, redis.Redis | RedisCluster):
            await self.calls.call(self.redis_client.close)
        else:
            await self.redis_client.aclose()
        await self.calls.aclose()

    @staticmethod
    def _close_core(core: OrderService) -> None:
        core.close()  # disposes of its engine, closes its client
        client = core.index.client
        if isinstance(client, redis.Redis):
            # close() leaves a pool it was handed connected (the twin's, or the host's).
            client.connection_pool.disconnect()

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
    refused_payments = Awaited(OrderService.refused_payments)
    mark_refund_handled = Awaited(OrderService.mark_refund_handled)
    set_user_limit = Awaited(OrderService.set_user_limit)
    clear_user_limit = Awaited(OrderService.clear_user_limit)
    user_limit = Awaited(OrderService.user_limit)
    user_limit_history = Awaited(OrderService.user_limit_history)
    set_capacity = Awaited(OrderService.set_capacity)
    set_units = Awaited(OrderService.set_units)
    units = Awaited(OrderService.units)
    resource = Awaited(OrderService.resource)
    resources = Awaited(OrderService.resources)
    wait_for = Awaited(OrderService.wait_for)
    waiting = Awaited(OrderService.waiting)
    waiting_entry = Awaited(OrderService.waiting_entry)
    leave_waiting = Awaited(OrderService.leave_waiting)
    # An operator's action, which a host's request handler may also take (no module function).
    erase_user = Awaited(OrderService.erase_user)

    # --- the host's hooks, handed to the synchronous service ------------------------------

    def set_late_payment_check(self, check: LatePaymentCheck | None) -> None:
        """See :meth:`OrderService.set_late_payment_check`: a plain (not async) function,
        run in a thread of the service's own under the same time budget."""
        self._late_payment_check = check
        if self._core is not None:
            self._core.set_late_payment_check(check)

    def set_pre_close_check(self, check: PreCloseCheck | None) -> None:
        """See :meth:`OrderService.set_pre_close_check` (asked by this service's own
        ``sweep_expired``): a plain function, run in a thread of the service's own."""
        self._pre_close_check = check
        if self._core is not None:
            self._core.set_pre_close_check(check)
