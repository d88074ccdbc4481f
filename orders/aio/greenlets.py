"""Running the service's one synchronous core on an event loop.

The technique is SQLAlchemy's own for its asyncio extension: :func:`run` starts a function
in a greenlet; wherever that function would block on I/O, the driver hands an awaitable to
the event loop instead (:func:`wait_for`) and the greenlet resumes with its result. The
SQL side needs nothing more than ``AsyncEngine.sync_engine``; the Redis side gets the same
from :mod:`orders.aio.loop_redis`. So a use case's rules (validation, the scripts and their
arguments, every statement, the status -> error decision, the admission policy) run as
the very code the synchronous :class:`~orders.service.OrderService` runs.

Cancellation: a use case is one step for a task that awaits it. A task cancelled while it
awaits :func:`run` gets its ``CancelledError`` once the call has finished, never half-way:
the call's effect, if it had one, stands (as when an acknowledgement is lost; a create
retried with the same ``order_id`` finds its order). Cutting a call at its I/O instead
was tried first: the drivers' clean-up of a connection interrupted mid-statement is where
it broke (aiosqlite's connection close then never returned). How long a cancelled caller
waits is bounded by the stores' timeouts, as the call itself is.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

from redis.retry import Retry
from sqlalchemy import util as sa_util

from orders.sql.greenlet import wait_for

T = TypeVar("T")


async def run(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a greenlet on this loop (see the module docstring)."""
    task = asyncio.ensure_future(sa_util.greenlet_spawn(fn, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await _finished(task)
        raise


async def _finished(task: asyncio.Future[Any]) -> None:
    """Wait for ``task`` to end, however often the waiting task is cancelled meanwhile."""
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([task])
    if not task.cancelled():
        task.exception()  # retrieved: its error was the cancelled caller's to lose


class LoopRetry(Retry):
    """redis-py's Retry, but its back-off sleeps on the event loop, not in ``time.sleep``."""

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        self._backoff.reset()  # type: ignore[no-untyped-call]
        failures = 0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if is_retryable is not None and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                if 0 <= self._retries < failures:
                    raise
                pause_s = self._backoff.compute(failures)
                if pause_s > 0:
                    wait_for(asyncio.sleep(pause_s))
