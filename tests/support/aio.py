"""Running the asyncio API in tests: a checked event loop, and the async service called
from synchronous tests (so the contract tests run against both APIs unchanged).

Every loop here runs with a heartbeat (``tests.support.watchdog``), not in asyncio's debug
mode, whose traceback taken at each task's and future's creation costs the loop more than
the calls it would watch (tens of ms in a burst of a few hundred tasks):
inside :func:`no_slow_callbacks`, a loop that runs nothing else for :data:`SLOW_CALLBACK_S`
or more is held by a blocking call, and fails the test that ran it. What is judged is the
time the code held the loop, not the time the machine made it wait (see
:class:`SlowCallbacks`). The loops are asyncio's, or uvloop's when ``ORDERS_TEST_LOOP=uvloop``
(:func:`loop_kind`): every loop made here, and in the worker processes, is of that kind.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import importlib
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import uvloop

from orders.aio import AsyncOrderService
from orders.aio.default import async_redis
from orders.bootstrap import build_async_engine
from orders.config import Settings
from orders.service import OrderService
from orders.sql import migrate
from tests.support.watchdog import (
    SLOW_CALLBACK_S,
    WATCHDOG,
    Heartbeat,
    RunQueueWaits,
    SlowCallbacks,
    held_s,
)

#: The drivers' modules a first engine or client imports on first use, some with C parts
#: whose initialisation holds the GIL for tens of milliseconds (CI saw a checked loop wait
#: 27 ms for the GIL while a service thread built its first PostgreSQL engine). Imported
#: here, before any check, as an application has them imported before it serves.
DRIVER_MODULES = (
    "psycopg",
    "psycopg.pq",
    "sqlalchemy.dialects.postgresql.psycopg",
    "sqlalchemy.dialects.sqlite.pysqlite",
    "sqlalchemy.dialects.sqlite.aiosqlite",
    "aiosqlite",
    "redis.asyncio",
    "redis.asyncio.cluster",
)


def warm_up() -> list[str]:
    """Import :data:`DRIVER_MODULES` (those installed) and read the migration scripts'
    revisions once (a service's schema check parses them, once per process): an
    application's start-up, done before any check. The modules imported."""
    imported = []
    for name in DRIVER_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        imported.append(name)
    migrate.script_heads()
    return imported


warm_up()

__all__ = [
    "LOOP_ENV",
    "SLOW_CALLBACK_S",
    "AwaitedService",
    "CheckedRunner",
    "LoopThread",
    "RunQueueWaits",
    "SlowCallbacks",
    "checked_runner",
    "held_s",
    "kind_of",
    "loop_kind",
    "new_async_service",
    "no_slow_callbacks",
    "run_checked",
    "run_watched",
    "unchecked",
]

T = TypeVar("T")

#: The variable that names the event loop the tests run: "asyncio" (unset) or "uvloop".
LOOP_ENV = "ORDERS_TEST_LOOP"
LOOP_KINDS = ("asyncio", "uvloop")


def loop_kind() -> str:
    """The loop the helpers make (``ORDERS_TEST_LOOP``); an unknown name is an error, never
    a silent fall back to asyncio's."""
    kind = os.environ.get(LOOP_ENV, "asyncio")
    if kind not in LOOP_KINDS:
        raise ValueError(f"{LOOP_ENV}={kind!r}: expected one of {LOOP_KINDS}")
    return kind


def kind_of(loop: asyncio.AbstractEventLoop) -> str:
    """The package the class of ``loop`` comes from: "uvloop" or "asyncio"."""
    return type(loop).__module__.partition(".")[0]


def new_loop(kind: str) -> asyncio.AbstractEventLoop:
    """A new event loop of ``kind`` (asserted: the switch cannot quietly give another)."""
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    assert kind_of(loop) == kind, f"asked for a {kind} loop, got {type(loop)!r}"
    return loop


@contextmanager
def no_slow_callbacks(*, fail: bool = True) -> Iterator[SlowCallbacks]:
    """Fails (AssertionError) when a checked loop was held meanwhile (with ``fail`` off,
    only collects the reports).

    The garbage collector is paused meanwhile: a full collection of the test process's
    heap (every collected test item) takes tens of milliseconds, which is the test
    runner's pause, not a blocking call of the code under test. And the GIL changes hands
    every millisecond, not every 5: a test's own threads (monitors reading the stores)
    then cannot hold a loop up for more than that at a time.
    """
    watcher = SlowCallbacks()
    collecting = gc.isenabled()
    gc.disable()
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(0.001)  # a test's monitor thread gives the GIL back within 1 ms
    WATCHDOG.watch(watcher)
    try:
        yield watcher
    finally:
        WATCHDOG.unwatch(watcher)
        sys.setswitchinterval(switch_s)
        if collecting:
            gc.enable()
    assert not (fail and watcher.reports), f"the event loop was blocked: {watcher.reports}"


@contextmanager
def unchecked(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """The gaps of ``loop`` that end meanwhile are not judged, nor the one in progress at
    the end: a host's start-up (its lifespan hook building the service before the first
    request), not a call."""
    heartbeat = WATCHDOG.heartbeats.get(id(loop))
    if heartbeat is None:
        yield
        return
    heartbeat.pause()
    try:
        yield
    finally:
        heartbeat.resume()


class CheckedRunner:
    """An ``asyncio.Runner`` (a final class: wrapped, not subclassed) on a
    loop of :func:`loop_kind` (or ``kind``), its heartbeat beating while :meth:`run` runs
    the loop."""

    def __init__(self, kind: str | None = None) -> None:
        chosen = kind or loop_kind()
        self.runner = asyncio.Runner(loop_factory=lambda: new_loop(chosen))
        loop = self.runner.get_loop()
        loop.slow_callback_duration = 3600.0
        self.heartbeat = Heartbeat(loop, chosen)

    def __enter__(self) -> CheckedRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self.runner.get_loop()

    def run(self, coro: Coroutine[Any, Any, T], *, context: contextvars.Context | None = None) -> T:
        self.heartbeat.start()
        try:
            return self.runner.run(coro, context=context)
        finally:
            self.heartbeat.stop()

    def close(self) -> None:
        self.heartbeat.close()
        self.runner.close()


def checked_runner(kind: str | None = None) -> CheckedRunner:
    """A runner whose loop is checked inside :func:`no_slow_callbacks`."""
    return CheckedRunner(kind)


def run_checked(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)``; fails on any gap over the threshold."""
    with no_slow_callbacks(), checked_runner() as runner:
        return runner.run(main)


#: What :func:`run_watched` fails on: a loop held this long.
GROSS_BLOCK_S = 0.100


def run_watched(main: Coroutine[Any, Any, T]) -> T:
    """:func:`run_checked` for runs that share the process with busy threads of their own
    (500 tasks beside a monitor thread reading both stores): gaps over the threshold
    are printed, and fail only past :data:`GROSS_BLOCK_S`: a busy thread of the test's own
    holds the GIL a millisecond at a time, and a run of several thousand steps meets it
    often enough to have gaps of 20-21 ms."""
    with no_slow_callbacks(fail=False) as slow, checked_runner() as runner:
        result = runner.run(main)
    if slow.reports:
        print(f"\nslow callbacks ({len(slow.reports)}): {slow.reports[:3]}")
    assert slow.worst_s < GROSS_BLOCK_S, f"the event loop was blocked: {slow.reports}"
    return result


async def new_async_service(
    settings: Settings, *, clock: Callable[[], int] | None = None
) -> AsyncOrderService:
    """An AsyncOrderService on the stores ``settings`` names (schema already there).

    The engine is built in a thread, as :func:`orders.aio.build_async_service` builds its
    own: the first engine of a driver imports the dialect's modules (CI saw 12 ms of import
    work, inside pytest's import hook, hold a checked loop)."""
    engine = await asyncio.to_thread(build_async_engine, settings)
    return AsyncOrderService(engine, await async_redis(settings), settings, clock=clock)


class LoopThread:
    """A checked event loop (``kind``, else :func:`loop_kind`) in a thread of its own;
    :meth:`call` awaits a coroutine there."""

    def __init__(self, kind: str | None = None) -> None:
        self._runner = checked_runner(kind)
        self.loop = self._runner.get_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._runner.heartbeat.start()
        try:
            self.loop.run_forever()
        finally:
            self._runner.heartbeat.stop()

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def start_up(self, service: AsyncOrderService) -> None:
        """Builds ``service`` as a host's start-up does (``await service.core()``), its
        gaps not judged: on a cluster, reading the slot map and the command table
        costs redis-py 10-25 ms of CPU, once."""
        with unchecked(self.loop):
            self.call(service.core())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self._runner.close()


#: The use cases AwaitedService sends to the async service (and the operator method it
#: mirrors, erase_user); every other attribute is the synchronous service's (the parts tests
#: look into: index, records, settings, ...).
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
        "refused_payments",
        "mark_refund_handled",
        "set_user_limit",
        "clear_user_limit",
        "user_limit",
        "erase_user",
        "set_capacity",
        "resource",
        "resources",
        "set_units",
        "units",
        "wait_for",
        "waiting",
        "waiting_entry",
        "leave_waiting",
    }
)


class AwaitedService:
    """An AsyncOrderService in a loop thread, called like an OrderService."""

    def __init__(self, sync: OrderService, loop: LoopThread, service: AsyncOrderService) -> None:
        self._sync = sync
        self._loop = loop
        self.aio = service

    def set_late_payment_check(self, check: Any) -> None:
        """The hook goes to the service the use cases run on (and to the synchronous one,
        which the test may call directly)."""
        self._sync.set_late_payment_check(check)
        self.aio.set_late_payment_check(check)

    def set_pre_close_check(self, check: Any) -> None:
        self._sync.set_pre_close_check(check)
        self.aio.set_pre_close_check(check)

    def __getattr__(self, name: str) -> Any:
        if name not in USE_CASES:
            return getattr(self._sync, name)
        method = getattr(self.aio, name)

        def awaited(*args: Any, **kwargs: Any) -> Any:
            return self._loop.call(method(*args, **kwargs))

        return awaited
