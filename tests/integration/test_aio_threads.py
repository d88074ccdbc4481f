"""orders.aio's threads: how many calls run at once, the bounded queue past them, the
embedded server started again for async callers, and the API under trio (through anyio).

The calls themselves (their rules, errors and cancellation) are the contract suites'
(``both_apis``), tests/integration/test_aio_api.py and test_aio_cancellation.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from orders import OrderNotFound, OrderStatus, Overloaded
from orders.aio import build_async_service
from orders.config import Settings
from orders.embedded.server import redis_status, stop_redis
from orders.index.nodes import RedisClient
from tests.support.aio import new_async_service, run_checked
from tests.support.processes import servers_under, wait_dead

#: The longest a test waits for a call handed to a thread to show up as in flight.
HAND_OVER_S = 10.0


async def in_flight_reaches(service: Any, count: int) -> None:
    """Wait (on the loop, never blocking it) until ``count`` calls are handed over."""
    async with asyncio.timeout(HAND_OVER_S):
        while service.calls.in_flight < count:
            await asyncio.sleep(0.001)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no SQL rule here
def test_a_call_past_the_queue_is_refused_at_once_and_writes_nothing(
    database_url: str, redis_options: dict[str, Any], redis_client: RedisClient
) -> None:
    settings = Settings(database_url=database_url, aio_threads=1, aio_queue=1, **redis_options)

    async def main() -> None:
        service = await new_async_service(settings)
        try:
            await service.core()
            gate = threading.Event()
            holder = asyncio.ensure_future(service.calls.call(gate.wait, HAND_OVER_S))
            await in_flight_reaches(service, 1)  # the one thread is taken
            queued = asyncio.ensure_future(service.create_unpaid_order("u1", order_id="queued"))
            await in_flight_reaches(service, 2)  # the one place in the queue is taken
            with pytest.raises(Overloaded, match="1 calls already wait"):
                await service.create_unpaid_order("u1", order_id="refused")
            gate.set()
            assert await holder is True
            assert (await queued).status is OrderStatus.UNPAID
            with pytest.raises(OrderNotFound):
                await service.get_order("refused")
            assert service.calls.in_flight == 0
        finally:
            await service.aclose()

    run_checked(main())
    members = {m.decode() for m in redis_client.zrange("UnpaidOrder-u1", 0, -1)}
    assert members == {"queued"}


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)  # no SQL rule here
def test_no_more_calls_run_at_once_than_aio_threads(
    database_url: str, redis_options: dict[str, Any]
) -> None:
    threads = 3
    settings = Settings(database_url=database_url, aio_threads=threads, **redis_options)
    # The calls meet in threes: all of a round must run at once to pass the barrier, and
    # a fourth running beside them would be counted.
    rounds = threading.Barrier(threads, timeout=HAND_OVER_S)
    guard = threading.Lock()
    running: list[int] = [0]
    most: list[int] = [0]
    seen: set[int] = set()

    def one_call() -> None:
        with guard:
            seen.add(threading.get_ident())
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            rounds.wait()
        finally:
            with guard:
                running[0] -= 1

    async def main() -> None:
        service = await new_async_service(settings)
        try:
            await asyncio.gather(*(service.calls.call(one_call) for _ in range(4 * threads)))
        finally:
            await service.aclose()

    run_checked(main())
    assert most[0] == threads
    # All twelve are handed over before the first round ends: a pool with room for one
    # more thread would have started it, and it would have run some of them.
    assert len(seen) == threads


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_default_async_service_starts_its_dead_embedded_server_again(
    database_url: str, tmp_path: Path
) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    settings = Settings(database_url=database_url, home=home)

    async def main() -> tuple[int, int]:
        async with await build_async_service(settings) as service:
            first = await service.create_unpaid_order("u1")
            running = redis_status(home)
            assert running is not None
            os.kill(running.pid, signal.SIGKILL)
            assert await asyncio.to_thread(wait_dead, running.pid)
            second = await service.create_unpaid_order("u1")  # starts it again
            assert {o.id for o in await service.list_unpaid("u1")} == {first.id, second.id}
            restarted = redis_status(home)
            assert restarted is not None
            return running.pid, restarted.pid

    try:
        killed, restarted = run_checked(main())
        assert restarted != killed
        assert servers_under(home) == [restarted]
    finally:
        stop_redis(home)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_the_api_runs_under_trio_through_anyio(
    database_url: str, redis_options: dict[str, Any], redis_client: RedisClient
) -> None:
    settings = Settings(database_url=database_url, unpaid_limit=2, **redis_options)

    async def main() -> list[str]:
        import trio  # noqa: PLC0415

        service = await build_async_service(settings)
        try:
            outcomes: list[str] = []

            async def create(n: int) -> None:
                try:
                    await service.create_unpaid_order("u1", order_id=f"o{n}")
                    outcomes.append("created")
                except Exception as exc:
                    outcomes.append(type(exc).__name__)

            async with trio.open_nursery() as nursery:
                for n in range(4):
                    nursery.start_soon(create, n)
            paid = next(o for o in await service.list_unpaid("u1"))
            assert (await service.mark_paid(paid.id)).status is OrderStatus.PAID
            return sorted(outcomes)
        finally:
            await service.aclose()

    outcomes = anyio.run(main, backend="trio")
    assert outcomes == ["UnpaidOrderLimitReached"] * 2 + ["created"] * 2
    assert redis_client.zcard("UnpaidOrder-u1") == 1
