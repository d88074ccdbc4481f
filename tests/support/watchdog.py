"""The event-loop check's machinery: a heartbeat on each checked loop, and a watchdog thread.

A heartbeat is a callback the loop runs every :data:`BEAT_S`; each beat stamps the time, the
loop thread's CPU time and the run-queue waits of the process's threads. Two beats further
apart than :data:`SLOW_CALLBACK_S` mean the loop ran nothing else for that long: something
on it held it (one call, or a burst of ready callbacks run back to back). The gap is judged
in *held* time (see :class:`SlowCallbacks`), so a busy machine (or a busy host under a virtual
one) cannot fail it. The watchdog
thread looks at every loop's last beat while a check is on and, when one is late, dumps the
loop thread's stack with :mod:`faulthandler` (public, unlike ``sys._current_frames``): what
was running, for the report. Nothing here touches the loop's internals, so it works on any
loop with ``call_later`` (asyncio's and uvloop's).
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import re
import sysconfig
import tempfile
import threading
import time
from typing import NamedTuple

#: The longest the loop may be held without running anything else (the issue's 20 ms).
SLOW_CALLBACK_S = 0.020
#: How often a heartbeat beats: the loop never sleeps longer than this while it is checked.
BEAT_S = 0.002
#: The watchdog's shortest sleep between two looks at the heartbeats.
TICK_S = 0.002
#: The watchdog's longest sleep: a loop late by more than this has had its stack caught,
#: unless the watchdog thread could not run either (see :func:`stalled_process`).
LOOK_S = SLOW_CALLBACK_S / 2
#: How long the end of a check waits for each running loop's next beat.
SETTLE_S = 1.0
#: A report shows this many of the loop thread's innermost frames, and as many of the
#: innermost ones outside the standard library (asyncio's own frames say little).
STACK_FRAMES = 3
STDLIB = sysconfig.get_paths()["stdlib"]


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


class StolenTime:
    """How long the hypervisor has kept each CPU of this (virtual) machine from running it
    (the ``steal`` field of each ``cpuN`` line of Linux's ``/proc/stat``, in clock ticks),
    or an empty tuple where there is no such file. A stolen CPU is no run-queue wait: a
    thread holding the GIL on it stands still, and the loop waiting for that GIL too, with
    nothing counted in :class:`RunQueueWaits` (seen in CI: 21 to 27 ms held, 0.1 ms
    computed, beside a busy thread). One read is about 8 microseconds."""

    TICK_S = 1 / os.sysconf("SC_CLK_TCK")

    def __init__(self) -> None:
        # The total's line and one per CPU come first (the interrupt counts, long, after).
        self.size = 160 * ((os.cpu_count() or 1) + 1)
        try:
            self._file: int | None = os.open("/proc/stat", os.O_RDONLY)
        except OSError:
            self._file = None

    def read(self) -> tuple[int, ...]:
        if self._file is None:
            return ()
        try:
            text = os.pread(self._file, self.size, 0).decode()
        except OSError:
            return ()
        lines = text.partition("\nintr")[0].splitlines()
        cpus = [line.split() for line in lines if line[3:4].isdigit()]
        return tuple(int(fields[8]) for fields in cpus if len(fields) > 8)

    @classmethod
    def most_s(cls, before: tuple[int, ...], after: tuple[int, ...]) -> float:
        """The most time one CPU was stolen between two reads (the GIL's holder may have
        run on any of them). Ticks are coarse (10 ms): a short theft may count a whole tick,
        which makes a loaded run less strict, never stricter."""
        deltas = [now - then for then, now in zip(before, after, strict=False)]
        return max(deltas, default=0) * cls.TICK_S


def held_s(
    took_s: float,
    cpu_s: float,
    before: dict[int, int],
    after: dict[int, int],
    stolen_s: float = 0.0,
) -> float:
    """A gap's wall time ``took_s`` less the run-queue waits of the process's threads
    meanwhile and the time a CPU was stolen from the machine (``stolen_s``), and at least
    the loop thread's ``cpu_s``. A thread started meanwhile waited all its life in the run
    queue (``Thread.start()`` waits for the new thread to run: on a busy machine, tens of
    milliseconds); one that ended meanwhile cannot be read, and counts nothing."""
    waited_ns = sum(waits - before.get(tid, 0) for tid, waits in after.items())
    return max(cpu_s, took_s - waited_ns / 1e9 - stolen_s)


class Gap(NamedTuple):
    """Two beats of one loop further apart than the bound; times from ``perf_counter``."""

    loop: str
    started: float
    took_s: float
    held_s: float
    cpu_s: float
    stack: str


class SlowCallbacks:
    """The gaps of checked loops that held their loop :data:`SLOW_CALLBACK_S` or more.

    A gap's wall time is what the code on the loop did (computing, or sleeping in a
    blocking call: I/O, ``time.sleep``, a lock) plus what the machine did to it: on a busy
    machine the loop's thread waits in the CPU run queue, and so do the process's other
    threads, one of which may hold the GIL or a lock the loop waits for. The kernel counts
    those waits per thread (:class:`RunQueueWaits`), and a virtual machine's hypervisor the
    time it kept each CPU from it (:class:`StolenTime`); a gap's *held* time is its wall
    time less the waits of every thread of the process and the longest theft meanwhile,
    and never less than the CPU time the loop's thread spent in it. Load only adds waits,
    so it cannot push a gap over the bound (it can hide a blocking call that coincides
    with another thread's wait: a loaded run is less strict, never stricter). Gaps over
    the bound in wall time but not in held time are counted in ``waited``, and so are gaps
    whose stack was caught in the heartbeat's own code: the loop was then waiting for the
    GIL or the run-queue reader's lock inside the check, not running the code under test
    (a wait the kernel does not count as a run-queue wait, seen on a loaded CI machine).
    Only gaps that began after ``since``
    count.
    """

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.waited = 0
        self.worst_s = 0.0
        self.since = time.perf_counter()

    def note(self, gap: Gap) -> None:
        if gap.started < self.since:
            return
        if gap.held_s < SLOW_CALLBACK_S or in_the_check(gap.stack) or stalled_process(gap):
            self.waited += 1
            return
        self.worst_s = max(self.worst_s, gap.held_s)
        running = f"; running:\n{gap.stack}" if gap.stack else " (no stack caught)"
        self.reports.append(
            f"the {gap.loop} loop was held {gap.held_s * 1000:.1f} ms (gap "
            f"{gap.took_s * 1000:.1f} ms, computed {gap.cpu_s * 1000:.1f} ms) "
            f"{gap.started - self.since:.3f} s into the check{running}"
        )


def stalled_process(gap: Gap) -> bool:
    """Whether the whole process stood still through ``gap``, not only its loop: the
    watchdog thread, which looks at a late loop within :data:`LOOK_S`, caught no stack in
    it, so it did not run either, and the loop thread spent less than the bound on the CPU.
    A blocking call on the loop (I/O, ``time.sleep``, a lock) gives the GIL up and is
    caught by the watchdog; a computation is counted in the loop thread's CPU time. What
    stops both is outside the code under test: the process not scheduled in a way the run
    queue does not count (memory reclaim, page faults on a loaded CI machine), seen as a
    37.9 ms gap with 1.3 ms computed and no stack."""
    return not gap.stack and gap.cpu_s < SLOW_CALLBACK_S


def in_the_check(stack: str) -> bool:
    """Whether a caught stack's innermost frame is this module's (the heartbeat itself)."""
    innermost = stack.partition("\n")[0]
    return f'"{__file__}"' in innermost


class Beat(NamedTuple):
    wall: float
    cpu: float
    waits: dict[int, int]
    stolen: tuple[int, ...]


class Heartbeat:
    """The heartbeat of one loop (named ``kind`` in reports). :meth:`start` and :meth:`stop`
    are called on the thread that runs the loop, around each run of it: a loop that is not
    running has no gaps."""

    def __init__(self, loop: asyncio.AbstractEventLoop, kind: str) -> None:
        self.loop = loop
        self.kind = kind
        self.last: Beat | None = None
        self.thread = 0  # threading.get_ident() of the thread running the loop
        self.timer: asyncio.TimerHandle | None = None
        self.checked = True  # False inside tests.support.aio.unchecked
        self.stack = (float("nan"), "")  # the last beat of the stall it was caught in, stack
        WATCHDOG.heartbeats[id(loop)] = self

    def start(self) -> None:
        self.thread = threading.get_ident()
        self.last = beat_now()
        self.timer = self.loop.call_later(BEAT_S, self.beat)

    def beat(self) -> None:
        self.judge()
        self.timer = self.loop.call_later(BEAT_S, self.beat)

    def stop(self) -> None:
        """The loop has stopped: its last gap ends here."""
        self.judge()
        self.last = None
        if self.timer is not None:
            self.timer.cancel()

    def close(self) -> None:
        WATCHDOG.heartbeats.pop(id(self.loop), None)

    def pause(self) -> None:
        """From any thread: the gaps that end meanwhile are not judged."""
        self.checked = False

    def resume(self) -> None:
        """From any thread: judged again from the loop's next callback on (before any
        callback scheduled after this call), the gap in progress dropped."""
        self.loop.call_soon_threadsafe(self.restart)

    def restart(self) -> None:
        self.checked = True
        self.last = beat_now()

    def judge(self) -> None:
        last, now = self.last, beat_now()
        self.last = now
        if last is not None and self.checked:
            WATCHDOG.note(self.gap(last, now))

    def gap(self, last: Beat, now: Beat) -> Gap:
        """The gap between two beats: ``now`` may be read on another thread, with the loop
        thread's CPU time read through its clock (``in_progress``)."""
        took_s, cpu_s = now.wall - last.wall, now.cpu - last.cpu
        caught_at, stack = self.stack
        stack = stack if caught_at == last.wall else ""
        stolen_s = StolenTime.most_s(last.stolen, now.stolen)
        held = held_s(took_s, cpu_s, last.waits, now.waits, stolen_s)
        return Gap(self.kind, last.wall, took_s, held, cpu_s, stack)

    def in_progress(self) -> Gap | None:
        """From another thread: the gap since the last beat, if the loop is running."""
        last = self.last
        if last is None or not self.checked:
            return None
        cpu = time.clock_gettime(time.pthread_getcpuclockid(self.thread))
        waits = WAITS.read()
        return self.gap(last, Beat(time.perf_counter(), cpu, waits, STOLEN.read()))


def beat_now() -> Beat:
    waits = WAITS.read()
    return Beat(time.perf_counter(), time.thread_time(), waits, STOLEN.read())


class Watchdog:
    """The thread that watches the heartbeats while a check is on (``watchers``): when a
    loop's last beat is half the bound old, it keeps the loop thread's stack for the gap's
    report. It wakes only when a loop's last beat could be that old (every 10 ms or so, not
    every beat): its own run-queue waits count as the process's (see :func:`held_s`)."""

    def __init__(self) -> None:
        self.heartbeats: dict[int, Heartbeat] = {}
        self.watchers: list[SlowCallbacks] = []
        self.watching = threading.Event()
        self.thread: threading.Thread | None = None
        self.dump = tempfile.TemporaryFile()  # noqa: SIM115 (the process's, for its life)

    def watch(self, watcher: SlowCallbacks) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, name="loop-watchdog", daemon=True)
            self.thread.start()
        watcher.since = time.perf_counter()
        self.watchers.append(watcher)
        self.watching.set()

    def unwatch(self, watcher: SlowCallbacks) -> None:
        """The check ends: each running loop's gap in progress is judged first (by its next
        beat, or here if it has not beaten within :data:`SETTLE_S`)."""
        asked = time.perf_counter()
        others = [hb for hb in self.running() if hb.thread != threading.get_ident()]
        while time.perf_counter() < asked + SETTLE_S:
            if all(hb.last is None or hb.last.wall >= asked for hb in others):
                break
            time.sleep(BEAT_S / 2)
        else:
            for heartbeat in others:
                gap = heartbeat.in_progress()
                if gap is not None and gap.started < asked:
                    watcher.note(gap)
        self.watchers.remove(watcher)
        if not self.watchers:
            self.watching.clear()

    def running(self) -> list[Heartbeat]:
        return [hb for hb in list(self.heartbeats.values()) if hb.last is not None]

    def note(self, gap: Gap) -> None:
        if gap.took_s >= SLOW_CALLBACK_S:
            for watcher in list(self.watchers):
                watcher.note(gap)

    def run(self) -> None:
        while self.watching.wait():
            now = time.perf_counter()
            due = now + LOOK_S  # no loop late yet, or every late one's stack caught
            for heartbeat in self.running():
                last = heartbeat.last
                if last is None:
                    continue
                if now - last.wall < LOOK_S:
                    due = min(due, last.wall + LOOK_S)
                elif heartbeat.stack[0] != last.wall:
                    heartbeat.stack = (last.wall, self.stack_of(heartbeat.thread))
            time.sleep(max(due - now, TICK_S))

    def stack_of(self, thread: int) -> str:
        """The innermost frames of ``thread``, from faulthandler's dump of every thread."""
        fd = self.dump.fileno()
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        faulthandler.dump_traceback(fd, all_threads=True)
        text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
        for block in text.split("\n\n"):
            header, _, frames = block.partition("\n")
            found = re.match(r"(?:Current thread|Thread) 0x([0-9a-f]+)", header)
            if found is not None and int(found[1], 16) == thread:
                lines = frames.splitlines()
                ours = [line for line in lines[STACK_FRAMES:] if STDLIB not in line]
                return "\n".join(lines[:STACK_FRAMES] + ours[:STACK_FRAMES])
        return ""


WAITS = RunQueueWaits()
STOLEN = StolenTime()
WATCHDOG = Watchdog()
