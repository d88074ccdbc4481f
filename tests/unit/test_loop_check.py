"""The tests' event-loop check (``tests.support.aio``) itself: a step that blocks the loop
fails it, whether it sleeps or computes, and a step that the machine only kept waiting for a
CPU does not, however long it took on the wall clock."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support.aio import SLOW_CALLBACK_S, SlowCallbacks, checked_runner, no_slow_callbacks
from tests.support.processes import stop_process


def compute_for(cpu_s: float) -> None:
    """Spend ``cpu_s`` of this thread's CPU time."""
    until = time.thread_time() + cpu_s
    while time.thread_time() < until:
        pass


async def steps(work: float, blocking: str, count: int = 1) -> None:
    """``count`` steps of the loop, each blocking it for ``work`` seconds."""
    for _ in range(count):
        await asyncio.sleep(0)
        if blocking == "sleep":
            time.sleep(work)
        else:
            compute_for(work)


def run_in_checked_loop(work: float, blocking: str, count: int = 1) -> SlowCallbacks:
    with no_slow_callbacks(fail=False) as slow, checked_runner() as runner:
        runner.run(steps(work, blocking, count))
    return slow


@pytest.mark.parametrize("blocking", ["sleep", "compute"])
def test_a_step_that_holds_the_loop_fails_the_check(blocking: str) -> None:
    with pytest.raises(AssertionError, match="the event loop was blocked"):  # noqa: SIM117
        with no_slow_callbacks(), checked_runner() as runner:
            runner.run(steps(2 * SLOW_CALLBACK_S, blocking))
    slow = run_in_checked_loop(2 * SLOW_CALLBACK_S, blocking)
    assert len(slow.reports) == 1
    assert slow.worst_s >= 2 * SLOW_CALLBACK_S


@contextmanager
def cpu_taken(cpu: int, hogs: int = 2) -> Iterator[None]:
    """``hogs`` processes spinning on CPU ``cpu`` only, stopped (by PID) on the way out."""
    spin = "import os, sys, time\nos.sched_setaffinity(0, {int(sys.argv[1])})\n"
    spin += "end = time.monotonic() + 60\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin, str(cpu)]) for _ in range(hogs)]
    try:
        time.sleep(0.2)  # each has pinned itself by now
        yield
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux only")
def test_a_step_kept_waiting_for_the_cpu_passes_the_check() -> None:
    """The loop runs in a thread of its own at nice 10, pinned to one CPU that two spinning
    processes share: steps of 5 ms of work take far more than the bound on the wall clock
    (asserted, or the test proved nothing), the rest of it spent in the run queue."""
    cpu = min(os.sched_getaffinity(0))
    found: list[SlowCallbacks] = []

    def loop_thread() -> None:
        os.sched_setaffinity(0, {cpu})  # 0: this thread (Linux's affinity is per thread)
        os.setpriority(os.PRIO_PROCESS, 0, 10)  # and so is the nice value
        found.append(run_in_checked_loop(SLOW_CALLBACK_S / 4, "compute", count=5))

    with cpu_taken(cpu):
        thread = threading.Thread(target=loop_thread)
        thread.start()
        thread.join(60)
    [slow] = found
    assert slow.waited >= 1, "no step was slowed past the bound: nothing was shown"
    assert slow.reports == []
    assert slow.worst_s == 0.0
