"""Running the service's synchronous core off the event loop, in threads the service owns.

A use case of :class:`~orders.service.OrderService` blocks on its stores (a Redis round
trip, a SQL statement and its commit). :class:`CallPool` runs it in one of ``aio_threads``
threads while the loop goes on with other tasks; the caller awaits its outcome. So the
asyncio API runs exactly the code the synchronous API runs (one copy of every rule), and
the loop only ever hands a call over and takes its result back.

Bounded: at most ``aio_queue`` calls wait for a thread beyond those running. One more is
refused at once with :class:`~orders.errors.Overloaded` (nothing was written), so a burst
past what the stores can serve fails fast instead of growing a queue whose callers have
long given up.

Cancellation: a call is one step for the task that awaits it. A task cancelled while its
call runs gets its ``CancelledError`` once the call has finished, never half-way: the
call's effect, if it had one, stands (as when an acknowledgement is lost; a create retried
with the same ``order_id`` finds its order). A call still waiting for a thread has done
nothing, and is dropped at once. How long a cancelled caller waits is bounded by the
stores' timeouts, as the call itself is.

On asyncio (uvloop included) the threads are a ``ThreadPoolExecutor`` and the hand-over is
``loop.run_in_executor``; under another event loop library (trio, through anyio) it is
``anyio.to_thread.run_sync`` with a capacity limiter of the same size.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from typing import Any, TypeVar

from orders.errors import Overloaded

T = TypeVar("T")


class CallPool:
    """``threads`` threads for blocking calls, and room for ``queue`` more waiting."""

    def __init__(self, threads: int, queue: int) -> None:
        self.threads = threads
        self.queue = queue
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="orders-aio")
        self._limiter: Any = None  # anyio's CapacityLimiter, made on first use off asyncio
        self._guard = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Calls handed over and not yet finished (running or waiting for a thread)."""
        return self._in_flight

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` in one of the pool's threads, with the caller's context
        variables; :class:`Overloaded` when the queue is full (see the module docstring)."""
        with self._guard:
            waiting = self._in_flight - self.threads
            if waiting >= self.queue:
                raise Overloaded(waiting)
            self._in_flight += 1
        try:
            job = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
            if on_asyncio():
                loop = asyncio.get_running_loop()
                return await settled(loop.run_in_executor(self._executor, job))
            return await self._call_elsewhere(job)
        finally:
            with self._guard:
                self._in_flight -= 1

    async def _call_elsewhere(self, job: Callable[[], T]) -> T:
        import anyio  # noqa: PLC0415 (only off asyncio)
        import anyio.to_thread  # noqa: PLC0415

        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        # Not abandoned on cancel: anyio then delivers the cancellation once it returns.
        return await anyio.to_thread.run_sync(job, limiter=self._limiter)

    async def aclose(self) -> None:
        """End the pool's threads once the calls already handed over finish, waiting for
        them in a thread of the loop's own so that the loop is not held meanwhile."""
        self._executor.shutdown(wait=False)  # no new calls from here on
        join = functools.partial(self._executor.shutdown, wait=True)
        if on_asyncio():
            await asyncio.to_thread(join)
            return
        import anyio.to_thread  # noqa: PLC0415 (only off asyncio)

        await anyio.to_thread.run_sync(join)


def on_asyncio() -> bool:
    """Whether the caller runs on an asyncio loop (uvloop's included). Everything else (trio)
    goes through anyio, imported only then: its first use on a loop costs tens of ms."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of the loop library's own (start-up work, once)."""
    if on_asyncio():
        return await asyncio.to_thread(fn, *args)
    import anyio.to_thread  # noqa: PLC0415

    return await anyio.to_thread.run_sync(fn, *args)


def new_lock() -> AbstractAsyncContextManager[Any]:
    """A lock for tasks of the running loop's library."""
    if on_asyncio():
        return asyncio.Lock()
    import anyio  # noqa: PLC0415

    return anyio.Lock()


async def settled(step: Awaitable[T]) -> T:
    """Await ``step`` to its end even if the awaiting task is cancelled meanwhile; the
    cancellation then reaches the caller afterwards, the step's own outcome dropped."""
    future = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        await _finished(future)
        raise


async def _finished(future: asyncio.Future[Any]) -> None:
    """Wait for ``future`` to end, however often the waiting task is cancelled meanwhile."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([future])
    if not future.cancelled():
        future.exception()  # retrieved: its error was the cancelled caller's to lose
