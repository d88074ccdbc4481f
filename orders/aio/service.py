"""AsyncOrderService: the use cases of :class:`~orders.service.OrderService`, awaited.

It holds no rule of its own. Each method awaits the synchronous service's method, run by
:func:`orders.aio.greenlets.run` on the caller's event loop over the same stores: SQL
through ``AsyncEngine.sync_engine`` (the async driver underneath), Redis through
:func:`orders.aio.loop_redis.loop_client`. Validation, the scripts, the statements, the
errors and the outbox events are therefore those of the synchronous API, by construction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from decimal import Decimal
from types import TracebackType
from typing import Any

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from sqlalchemy.ext.asyncio import AsyncEngine

from orders.aio.greenlets import LoopRetry, run
from orders.aio.loop_redis import (
    AsyncRedisClient,
    check_async_client,
    loop_client,
)
from orders.bootstrap import redis_retry
from orders.config import Settings
from orders.domain import Clock, Order, SweepResult
from orders.events import EventPosition, OrderEvent
from orders.reconciler import DEFAULT_CHUNK_SIZE, ReconcileReport
from orders.service import OrderService


class AsyncOrderService:
    """The order-expiry service for asyncio code (FastAPI, Starlette, Litestar, ...).

    Built from the ``AsyncEngine`` and ``redis.asyncio`` client an application has::

        engine = create_async_engine("postgresql+psycopg://...")
        client = redis.asyncio.Redis.from_url("redis://...")
        async with AsyncOrderService(engine, client, Settings(unpaid_limit=3)) as service:
            order = await service.create_unpaid_order("user-1")

    The schema must exist, as for the synchronous service. Nothing connects until the
    first call. ``aclose()`` (or leaving ``async with``) disposes of the engine and closes
    the client. Use one instance from one event loop.
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

    # --- the use cases: see OrderService for what each does ------------------------------

    async def create_unpaid_order(
        self,
        user_id: str | int,
        *,
        order_id: str | None = None,
        ttl_s: float | None = None,
        limit: int | None = None,
        amount: Decimal | int | str | None = None,
        currency: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Order:
        """See :meth:`OrderService.create_unpaid_order`."""
        core = await self.core()
        return await run(
            core.create_unpaid_order,
            user_id,
            order_id=order_id,
            ttl_s=ttl_s,
            limit=limit,
            amount=amount,
            currency=currency,
            metadata=metadata,
        )

    async def mark_paid(self, order_id: str, *, payment_ref: str | None = None) -> Order:
        """See :meth:`OrderService.mark_paid`."""
        return await run((await self.core()).mark_paid, order_id, payment_ref=payment_ref)

    async def cancel_order(self, order_id: str, *, reason: str | None = None) -> Order:
        """See :meth:`OrderService.cancel_order`."""
        return await run((await self.core()).cancel_order, order_id, reason=reason)

    async def extend_order(self, order_id: str, extra_s: float) -> Order:
        """See :meth:`OrderService.extend_order`."""
        return await run((await self.core()).extend_order, order_id, extra_s)

    async def get_order(self, order_id: str) -> Order:
        """See :meth:`OrderService.get_order`."""
        return await run((await self.core()).get_order, order_id)

    async def list_unpaid(self, user_id: str | int) -> list[Order]:
        """See :meth:`OrderService.list_unpaid`."""
        return await run((await self.core()).list_unpaid, user_id)

    async def iter_events(
        self, *, after: EventPosition | None = None, limit: int = 100
    ) -> list[OrderEvent]:
        """See :meth:`OrderService.iter_events`."""
        return await run((await self.core()).iter_events, after=after, limit=limit)

    async def sweep_expired(
        self,
        *,
        now_ms: int | None = None,
        batch_size: int | None = None,
        max_batches: int | None = None,
    ) -> SweepResult:
        """See :meth:`OrderService.sweep_expired`."""
        core = await self.core()
        return await run(
            core.sweep_expired, now_ms=now_ms, batch_size=batch_size, max_batches=max_batches
        )

    async def reconcile(
        self,
        *,
        user_id: str | None = None,
        dry_run: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> ReconcileReport:
        """See :meth:`OrderService.reconcile`."""
        core = await self.core()
        return await run(core.reconcile, user_id=user_id, dry_run=dry_run, chunk_size=chunk_size)
