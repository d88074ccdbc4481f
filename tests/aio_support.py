"""Running the asyncio API in tests: a checked event loop, and the async service called
from synchronous tests (so the contract tests run against both APIs unchanged).

Every loop here runs in asyncio's debug mode with a slow-callback threshold of
:data:`SLOW_CALLBACK_S`: a callback (a task's step) that holds the loop longer is a
blocking call on the loop, and fails the test that ran it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from orders.aio import AsyncOrderService
from orders.aio.default import async_redis
from orders.bootstrap import build_async_engine
from orders.config import Settings
from orders.service import OrderService

T = TypeVar("T")

#: The longest a callback may hold the loop (the issue's 20 ms).
SLOW_CALLBACK_S = 0.020


class SlowCallbacks(logging.Handler):
    """Collects asyncio's debug-mode reports of callbacks slower than the threshold."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reports: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing ") and " took " in message:
            self.reports.append(message)


@contextmanager
def no_slow_callbacks() -> Iterator[SlowCallbacks]:
    """Fails (AssertionError) when a checked loop reported a slow callback meanwhile.

    The garbage collector is paused meanwhile: a full collection of the test process's
    heap (every collected test item) takes tens of milliseconds, which is the test
    runner's pause, not a blocking call of the code under test.
    """
    handler = SlowCallbacks()
    logger = logging.getLogger("asyncio")
    logger.addHandler(handler)
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        if collecting:
            gc.enable()
    assert not handler.reports, f"the event loop was blocked: {handler.reports}"


def checked_runner() -> asyncio.Runner:
    runner = asyncio.Runner(debug=True)
    runner.get_loop().slow_callback_duration = SLOW_CALLBACK_S
    return runner


def run_checked(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` in debug mode; fails on any callback over the threshold."""
    with no_slow_callbacks(), checked_runner() as runner:
        return runner.run(main)


async def new_async_service(
    settings: Settings, *, clock: Callable[[], int] | None = None
) -> AsyncOrderService:
    """An AsyncOrderService on the stores ``settings`` names (schema already there)."""
    engine = build_async_engine(settings)
    return AsyncOrderService(engine, await async_redis(settings), settings, clock=clock)


class LoopThread:
    """A checked event loop in a thread of its own; :meth:`call` awaits a coroutine there."""

    def __init__(self) -> None:
        self._runner = checked_runner()
        self._loop = self._runner.get_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._runner.close()


#: The use cases AwaitedService sends to the async service; every other attribute is the
#: synchronous service's (the parts tests look into: index, records, settings, ...).
USE_CASES = frozenset(
    {
        "create_unpaid_order",
        "mark_paid",
        "cancel_order",
        "extend_order",
        "get_order",
        "list_unpaid",
        "iter_events",
        "sweep_expired",
        "reconcile",
    }
)


class AwaitedService:
    """An AsyncOrderService in a loop thread, called like an OrderService."""

    def __init__(self, sync: OrderService, loop: LoopThread, service: AsyncOrderService) -> None:
        self._sync = sync
        self._loop = loop
        self.aio = service

    def __getattr__(self, name: str) -> Any:
        if name not in USE_CASES:
            return getattr(self._sync, name)
        method = getattr(self.aio, name)

        def awaited(*args: Any, **kwargs: Any) -> Any:
            return self._loop.call(method(*args, **kwargs))

        return awaited
