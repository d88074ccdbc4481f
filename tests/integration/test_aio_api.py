"""The surface of ``orders.aio``: the env-configured default service, its typed errors, and
what an AsyncOrderService refuses to be built from. Every loop here is checked (no
callback over 20 ms), failures included: a dead store must not stall the loop either."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from sqlalchemy import Engine, select

import orders.aio
from orders.aio import AsyncOrderService
from orders.bootstrap import build_async_engine
from orders.config import Settings
from orders.errors import InvalidInput, OrderClosed, StoreUnavailable
from orders.sql.models import events_table, orders_table
from tests.support.aio import new_async_service, run_checked

DEAD_REDIS_URL = "redis://127.0.0.1:1/0"
DEAD_DATABASE_URL = "postgresql://u:p@127.0.0.1:1/x"


@pytest.fixture
def default_from_env(
    database_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("ORDERS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("ORDERS_DATABASE_URL", database_url)
    monkeypatch.setenv("ORDERS_REDIS_URL", redis_url)
    monkeypatch.setenv("ORDERS_UNPAID_LIMIT", "1")
    orders.aio.configure(None)


def test_module_functions_run_on_the_default_service_built_from_the_environment(
    default_from_env: None, engine: Engine, redis_client: redis.Redis
) -> None:
    async def main() -> tuple[str, str]:
        try:
            order = await orders.aio.create_unpaid_order("env-user", amount="9.90")
            paid = await orders.aio.mark_paid(order.id, payment_ref="psp-1")
            again = await orders.aio.create_unpaid_order("env-user")
            await orders.aio.cancel_order(again.id)
            with pytest.raises(OrderClosed):
                await orders.aio.mark_paid(again.id, payment_ref="psp-2")
            return paid.id, again.id
        finally:
            await (await orders.aio.default_service()).aclose()
            orders.aio.configure(None)

    paid_id, cancelled_id = run_checked(main())
    with engine.connect() as conn:
        statuses = dict(conn.execute(select(orders_table.c.id, orders_table.c.status)).all())
        kinds = sorted(conn.execute(select(events_table.c.kind)).scalars())
    assert statuses == {paid_id: "paid", cancelled_id: "cancelled"}
    assert kinds == ["cancelled", "created", "created", "paid", "payment_refused"]
    assert redis_client.zcard("UnpaidOrder-env-user") == 0


@pytest.mark.parametrize("dead", ["redis", "sql"])
def test_a_dead_store_is_store_unavailable_without_blocking_the_loop(
    dead: str, database_url: str, redis_url: str
) -> None:
    settings = Settings(
        database_url=DEAD_DATABASE_URL if dead == "sql" else database_url,
        redis_url=DEAD_REDIS_URL if dead == "redis" else redis_url,
        redis_socket_timeout_s=0.5,
        sql_connect_timeout_s=1,
    )

    async def main() -> StoreUnavailable:
        service = await new_async_service(settings)
        try:
            # A payment never needs Redis (SQL decides); a create needs both.
            call = (
                service.create_unpaid_order("u1")
                if dead == "redis"
                else service.mark_paid("some-order")
            )
            with pytest.raises(StoreUnavailable) as refused:
                await call
            return refused.value
        finally:
            await service.aclose()

    started = time.monotonic()
    error = run_checked(main())
    assert error.store == dead
    assert ":p@" not in str(error)  # no secret in the message
    assert ":p@" not in repr(error)
    assert time.monotonic() - started < 10


def test_bad_input_is_refused_before_any_store_is_touched(database_url: str) -> None:
    settings = Settings(database_url=DEAD_DATABASE_URL, redis_url=DEAD_REDIS_URL)

    async def main() -> None:
        service = await new_async_service(settings)
        try:
            with pytest.raises(InvalidInput):
                await service.create_unpaid_order("", ttl_s=60)
            with pytest.raises(InvalidInput):
                await service.create_unpaid_order("u1", ttl_s=-1)
        finally:
            await service.aclose()

    run_checked(main())


@pytest.mark.parametrize(
    ("client", "why"),
    [
        (lambda url: url, "must be a redis-py"),
        (lambda url: redis.asyncio.Redis.from_url(url, decode_responses=True), "decode"),
    ],
    ids=["not-a-client", "decoding-client"],
)
def test_a_client_the_service_cannot_use_is_invalid_input(
    client: Any, why: str, database_url: str, redis_url: str
) -> None:
    engine = build_async_engine(Settings(database_url=database_url))
    with pytest.raises(InvalidInput, match=why):
        AsyncOrderService(engine, client(redis_url))


def test_aclose_closes_every_redis_connection_the_service_opened(
    database_url: str, redis_options: dict[str, Any], redis_client: redis.Redis
) -> None:
    settings = Settings(database_url=database_url, aio_threads=40, **redis_options)

    def open_descriptors() -> int:
        """The process's open sockets (the loop check keeps a file per thread open)."""
        sockets = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(FileNotFoundError):  # closed meanwhile
                sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return sockets

    def pool_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("orders-aio")}

    async def main() -> tuple[int, int, int]:
        before = open_descriptors()
        threads_before = pool_threads()
        service = await new_async_service(settings)
        core = await service.core()
        # Forty Redis calls in flight at once: the forty threads meet, then each holds a
        # connection of the service's own in a blocking pop for a moment.
        met = threading.Barrier(40, timeout=30)

        def held_call() -> None:
            met.wait()
            core.index.client.blpop(["nothing"], timeout=0.3)

        await asyncio.gather(*(service.calls.call(held_call) for _ in range(40)))
        during = open_descriptors()
        await service.aclose()
        left = pool_threads() - threads_before
        assert not left, f"{len(left)} of the service's threads still alive after aclose()"
        return before, during, open_descriptors()

    before, during, after = run_checked(main())
    assert during - before >= 30  # most of the forty (a thread late to its pop reuses one)
    assert after - before <= 2, f"{after - before} descriptors left open by aclose()"
