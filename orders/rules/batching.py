"""The queue that lets concurrent calls of one process share work: leader and followers.

A call that finds fewer than one batch in flight runs at once, alone: it never waits for
company. A call that arrives while another call (alone or a batch) is in flight queues;
when the one in flight ends, the first queued caller leads the next batch, taking
everything queued (up to ``max_batch``), and the others wait for it. So a caller waits only
while the process is already busy with that kind of call: for the call or batch in flight
(and, past ``max_batch`` queued, the batches ahead of its own), then its own batch.

A call made from inside the one in flight, on its thread (a host's hook that pays or
cancels another order, a nested use case), runs alone at once: it would otherwise wait for
the call that waits for it (:meth:`BatchQueue.holds_lane`).

A call or batch in flight for longer than :data:`PATIENCE_S` is stuck (a lock held by
another transaction, a starved pool, a hung connection): the callers queued behind it, and
those that arrive while it lasts, run alone, as they would with nothing combined. So one
stuck call never holds up the others for longer than that.

What a batch does is its user's (:mod:`orders.rules.combining` for creates,
:mod:`orders.rules.transition_batches` for transitions); this module only decides who
runs, who waits, and who leads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from orders import metrics

M = TypeVar("M")

#: How long a call or batch may be in flight before the callers behind it stop waiting for
#: it (module docstring): a batch of 64 takes a few to some tens of milliseconds.
PATIENCE_S = 0.5


@dataclass(slots=True, eq=False)
class Seat(Generic[M]):
    """One caller's place in the queue: ``ready`` is set when its batch is over, or when
    it is to lead one (``batch`` then holds the batch it runs, itself first)."""

    ready: threading.Event = field(default_factory=threading.Event)
    batch: list[M] | None = None


@dataclass(slots=True)
class CombinerStats:
    """What a combiner did so far (read by tests and the bench)."""

    #: Calls that found nothing in flight and ran at once by the single path.
    alone: int = 0
    #: Calls that waited and then ran alone anyway (nobody else queued with them).
    waited_alone: int = 0
    #: Batches of two calls or more, the calls in them, and the largest.
    batches: int = 0
    combined: int = 0
    largest: int = 0
    #: Calls that ran alone past a call or batch in flight for longer than the patience.
    went_past: int = 0

    @property
    def calls(self) -> int:
        """Every call the queue saw, each counted once, however it ran."""
        return self.alone + self.waited_alone + self.combined + self.went_past

    def count(self, batch_size: int) -> None:
        if batch_size == 1:
            self.waited_alone += 1
            return
        self.batches += 1
        self.combined += batch_size
        self.largest = max(self.largest, batch_size)


class BatchQueue(Generic[M]):
    """Who runs alone, who waits, and who leads (module docstring). ``seat_of(member)``:
    the member's :class:`Seat`."""

    def __init__(
        self,
        seat_of: Callable[[M], Seat[M]],
        max_batch: int,
        kind: str,
        patience_s: float = PATIENCE_S,
    ) -> None:
        self.seat_of = seat_of
        self.max_batch = max_batch
        #: What the queue combines, as the batch-size metric labels it: create, transition.
        self.kind = kind
        self.patience_s = patience_s
        self.stats = CombinerStats()
        self._lock = threading.Lock()
        self._busy = False
        self._queue: list[M] = []
        #: The thread of the call or batch in flight (None between them), and its start.
        self._owner: int | None = None
        self._since = 0.0
        #: The batch-size histogram's child of ``kind``, looked up once (first use).
        self._sizes: Any = None

    def holds_lane(self) -> bool:
        """Whether this thread runs the call or batch in flight: a call it makes from
        there goes alone, past the queue (module docstring)."""
        return self._owner == threading.get_ident()

    @property
    def queued(self) -> int:
        """Calls waiting for the one in flight to end."""
        with self._lock:
            return len(self._queue)

    def alone(self) -> bool:
        """True: nothing was in flight, run alone now (then :meth:`hand_over`), with no
        member made. False: something is; :meth:`enter` the member (which may find the
        way free by then)."""
        with self._lock:
            return self._run_alone()

    def enter(self, member: M) -> bool:
        """True: nothing was in flight, run alone now (then :meth:`hand_over`). False:
        :meth:`wait` for the member's turn (at once, when the call in flight is stuck: it
        then goes alone)."""
        with self._lock:
            if self._run_alone():
                return True
            if self._stuck():
                self._go_past(member)
            else:
                self._queue.append(member)
            return False

    def _run_alone(self) -> bool:
        """Under the lock: take the lane for a call alone, if nothing is in flight."""
        if self._busy:
            return False
        self._busy = True
        self._owner = threading.get_ident()
        self._since = time.monotonic()
        self.stats.alone += 1
        self._batch_sizes().observe(1)
        return True

    def _batch_sizes(self) -> Any:
        if self._sizes is None:
            self._sizes = metrics.COMBINED_BATCH_SIZE.labels(self.kind)
        return self._sizes

    def wait(self, member: M) -> BaseException | None:
        """Wait for the member's batch (or its turn to lead, or to go alone past a stuck
        call: its seat ready with no batch); an interrupt that came meanwhile is returned
        once the member's batch is over. Interrupted before any batch took it, the member
        leaves the queue and the interrupt is raised."""
        seat = self.seat_of(member)
        try:
            while not seat.ready.wait(self._patience_left()):
                with self._lock:
                    if member not in self._queue:  # taken: its batch ends when it ends
                        break
                    if self._stuck():
                        self._queue.remove(member)
                        self._go_past(member)
            seat.ready.wait()
        except BaseException as stop:
            with self._lock:
                if member in self._queue:  # not taken yet: nothing was done for it
                    self._queue.remove(member)
                    raise
            # Taken into a batch: it must run (or be run) to its end.
            seat.ready.wait()
            return stop
        return None

    def _stuck(self) -> bool:
        """Whether the call or batch in flight has run past the patience (lock held)."""
        return time.monotonic() - self._since > self.patience_s

    def _patience_left(self) -> float:
        return max(0.001, self._since + self.patience_s - time.monotonic())

    def _go_past(self, member: M) -> None:
        """Let the member go alone at once, past a stuck call (lock held): its seat is
        ready with no batch, which its caller takes as its turn to run alone."""
        self.stats.went_past += 1
        self._batch_sizes().observe(1)
        self.seat_of(member).ready.set()

    def lead(self, batch: list[M], run: Callable[[list[M]], None]) -> None:
        """Run the batch the first member leads (``run``, unless it is alone in it), then
        let its followers go on and hand the next batch over, whatever ``run`` raised."""
        self._owner = threading.get_ident()
        try:
            self.stats.count(len(batch))
            self._batch_sizes().observe(len(batch))
            if len(batch) > 1:
                run(batch)
        finally:
            for member in batch[1:]:
                self.seat_of(member).ready.set()
            self.hand_over()

    def hand_over(self) -> None:
        """The call or batch in flight is over: the first queued caller leads the next."""
        with self._lock:
            self._owner = None
            if not self._queue:
                self._busy = False
                return
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
            self._since = time.monotonic()
        leader = self.seat_of(batch[0])
        leader.batch = batch
        leader.ready.set()
