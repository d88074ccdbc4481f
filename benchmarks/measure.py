"""Timing and summarising: runs, ratios, and the sizes of a run (percentiles and spreads are
``orders bench``'s own, :mod:`orders.bench.measure`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine, event

from orders.bench.measure import percentile, spread

ns = time.perf_counter_ns


# --- measuring -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run of one variant: ``ops`` operations in ``elapsed_ns`` wall time.

    ``cpu_ns`` is the CPU time this process (all its threads) used meanwhile: unlike the
    wall time, it hardly changes when other programs load the machine, so it shows where
    the client's own cost goes even on a busy host (the servers' CPU is not in it).
    """

    ops: int
    elapsed_ns: int
    latencies_ns: list[int] = field(default_factory=list)
    cpu_ns: int = 0

    @property
    def ops_s(self) -> float:
        return self.ops * 1e9 / max(1, self.elapsed_ns)

    @property
    def cpu_us(self) -> float:
        """Client CPU microseconds per operation."""
        return self.cpu_ns / 1000 / max(1, self.ops)


#: A variant: given a number of operations, prepares its data (untimed) and times them.
Variant = Callable[[int], Run]


def _timed(op: Callable[[int], object], indices: range, latencies: list[int]) -> None:
    """Call ``op(i)`` for each index, appending each call's wall time to ``latencies``."""
    for i in indices:
        t0 = ns()
        op(i)
        latencies.append(ns() - t0)


async def _awaited(
    op: Callable[[int], Awaitable[object]], indices: range, latencies: list[int]
) -> None:
    """:func:`_timed`, awaiting ``op(i)``."""
    for i in indices:
        t0 = ns()
        await op(i)
        latencies.append(ns() - t0)


def _shares(n: int, workers: int) -> list[range]:
    """The indices each of ``workers`` threads or tasks takes, in turn: i, i + workers, ..."""
    return [range(w, n, workers) for w in range(workers)]


def _finished(n: int, elapsed: int, latencies: list[list[int]], cpu_started: int) -> Run:
    return Run(
        n, elapsed, [x for mine in latencies for x in mine], time.process_time_ns() - cpu_started
    )


def run_ops(op: Callable[[int], object], n: int, threads: int = 1) -> Run:
    """Call ``op(i)`` for i in 0..n-1 on ``threads`` threads; time each call and the whole.

    The wall clock starts when every thread is ready and stops when the last is done.
    """
    cpu_started = time.process_time_ns()
    per_thread: list[list[int]] = [[] for _ in range(max(1, threads))]
    if threads <= 1:
        started = ns()
        _timed(op, range(n), per_thread[0])
        return _finished(n, ns() - started, per_thread, cpu_started)
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)

    def work(t: int, indices: range) -> None:
        ready.wait()
        try:
            _timed(op, indices, per_thread[t])
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    workers = [
        threading.Thread(target=work, args=(t, indices), daemon=True)
        for t, indices in enumerate(_shares(n, threads))
    ]
    for worker in workers:
        worker.start()
    ready.wait()
    started = ns()
    for worker in workers:
        worker.join()
    run = _finished(n, ns() - started, per_thread, cpu_started)
    if errors:
        raise errors[0]
    return run


async def run_tasks(op: Callable[[int], Awaitable[object]], n: int, tasks: int = 1) -> Run:
    """:func:`run_ops` on the running event loop: ``await op(i)`` for i in 0..n-1, as
    ``tasks`` tasks gathered in a task group (1: awaited in turn, by the caller's task).

    The wall clock starts as the tasks are created (none runs before the group awaits
    them) and stops when the last is done; a task that fails cancels the others.
    """
    cpu_started = time.process_time_ns()
    per_task: list[list[int]] = [[] for _ in range(max(1, tasks))]
    started = ns()
    if tasks <= 1:
        await _awaited(op, range(n), per_task[0])
    else:
        try:
            async with asyncio.TaskGroup() as group:
                for t, indices in enumerate(_shares(n, tasks)):
                    group.create_task(_awaited(op, indices, per_task[t]))
        except BaseExceptionGroup as failed:  # as run_ops: the first error, unwrapped
            raise failed.exceptions[0] from None
    return _finished(n, ns() - started, per_task, cpu_started)


def python_loop_ms(rounds: int = 5, n: int = 1_000_000) -> float:
    """The median wall time of a fixed pure-Python loop (``n`` additions), in ms: how fast
    this machine runs Python just now. Client-bound figures of two reports compare only as
    far as this does (the same code measured twice as slow on a slower virtual machine)."""
    times = []
    for _ in range(rounds):
        started = ns()
        total = 0
        for i in range(n):
            total += i
        times.append((ns() - started) / 1e6)
    return float(statistics.median(times))


def describe(runs: Sequence[Run]) -> dict[str, Any]:
    """ops/s over the repetitions, latency percentiles over every operation of them, and
    the client's CPU per operation (median over the repetitions)."""
    latencies = [x for run in runs for x in run.latencies_ns]
    return {
        "ops_s": spread([run.ops_s for run in runs]),
        "p50_ms": percentile(latencies, 50) / 1e6,
        "p99_ms": percentile(latencies, 99) / 1e6,
        "cpu_us": statistics.median(run.cpu_us for run in runs) if runs else 0.0,
    }


def ratios(a: Sequence[Run] | Sequence[float], b: Sequence[Run] | Sequence[float]) -> list[float]:
    """Per-repetition ratios a_r / b_r of two interleaved variants (ops/s)."""
    left = [x.ops_s if isinstance(x, Run) else x for x in a]
    right = [x.ops_s if isinstance(x, Run) else x for x in b]
    return [x / y for x, y in zip(left, right, strict=True) if y > 0]


@contextlib.contextmanager
def counting_statements(engine: Engine | type[Engine]) -> Iterator[list[int]]:
    """Counts every statement the engine sends to the database while the block runs
    (given the class ``Engine``: every engine of the process, an ``AsyncEngine``'s too)."""
    counter = [0]

    def on_execute(*_: Any) -> None:
        counter[0] += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        yield counter
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)


def counted(engine: Engine | type[Engine], variant: Variant, counter: list[int]) -> Variant:
    """``variant``, adding the statements each of its runs sends to ``counter[0]``."""

    def run(n: int) -> Run:
        with counting_statements(engine) as statements:
            result = variant(n)
        counter[0] += statements[0]
        return result

    return run


@contextlib.contextmanager
def quiet(logger_name: str) -> Iterator[None]:
    """Hold a logger at WARNING (the sweeper logs a line per sweep that closed something)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


# --- sizes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    ops: int = 1000
    reps: int = 5
    threads: int = 4
    tasks: int = 64
    warmup: int = 100
    sweep_rows: int = 50_000
    sweep_due: int = 10_000
    batch_sizes: tuple[int, ...] = (100, 500, 2000)
    lag_rate: float = 1000.0
    lag_seconds: float = 10.0
    memory_users: int = 10_000
    memory_reps: int = 3

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ops=150,
            reps=3,
            warmup=20,
            sweep_rows=5_000,
            sweep_due=1_000,
            lag_rate=200.0,
            lag_seconds=2.0,
            memory_users=1_000,
            memory_reps=2,
        )
