"""The bench's one event loop, and the async service on it.

The async variants run on a single ``asyncio.Runner`` held for the whole bench: the
:class:`~orders.aio.AsyncOrderService`, its pooled connections and its Redis sockets
belong to that loop, as in an application, and each timed run is one
``runner.run`` of :func:`~benchmarks.measure.run_tasks` (so starting the loop is not in
any operation's time). The loop runs only while an async variant runs; between them, the
threaded variants have the machine to themselves. The bench closes it after each figure
(:func:`~benchmarks.report.run_bench`), so no figure inherits the service's threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from benchmarks.measure import Run, run_tasks
from orders.aio import AsyncOrderService, build_async_service
from orders.config import Settings
from orders.domain import Clock


class BenchLoop:
    """An event loop and the async service, built on first use."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self._settings = settings
        self._clock = clock
        self._runner: asyncio.Runner | None = None
        self._service: AsyncOrderService | None = None

    @property
    def runner(self) -> asyncio.Runner:
        if self._runner is None:
            self._runner = asyncio.Runner()
        return self._runner

    @property
    def service(self) -> AsyncOrderService:
        """The async service (same settings and clock as the bench's synchronous one)."""
        if self._service is None:
            self._service = self.runner.run(
                build_async_service(self._settings, clock=self._clock, startup_warnings=False)
            )
        return self._service

    def run(
        self, op: Callable[[AsyncOrderService, int], Awaitable[object]], n: int, tasks: int
    ) -> Run:
        """``await op(service, i)`` for i in 0..n-1 as ``tasks`` tasks on this loop, timed."""
        service = self.service
        return self.runner.run(run_tasks(lambda i: op(service, i), n, tasks))

    def close(self) -> None:
        """Close the service (its connections), then the loop."""
        runner, service = self._runner, self._service
        self._runner = self._service = None
        if runner is None:
            return
        try:
            if service is not None:
                runner.run(service.aclose())
        finally:
            runner.close()
