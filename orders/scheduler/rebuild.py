"""When the active sweeper rebuilds the Redis index from SQL, and how it yields to sweeps.

:class:`IndexRebuilds` answers two questions for :class:`~orders.scheduler.sweeper.Sweeper`:
is a rebuild due (the first time the sweeper is active, every ``interval_s`` after the last
one, and at once when the index's epoch marker says Redis lost or rewound its data; see
:mod:`orders.index.epoch`), and how to run one without holding back the closing of expired
orders: the rebuild waits for a tick in progress before it starts and between its chunks of
users, and a stop request ends it between two chunks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from orders.index.epoch import IndexEpoch
from orders.rules.reconcile import ReconcileReport
from orders.service import OrderService

#: The reasons of a rebuild that the epoch check asked for (logged at INFO).
UNSCHEDULED = (IndexEpoch.LOST.value, IndexEpoch.REWOUND.value)
#: While a sweep runs, how often a waiting index rebuild looks for a stop request.
REBUILD_WAIT_S = 0.1


class RebuildStopped(Exception):
    """Raised between two chunks of a rebuild when the sweeper is asked to stop."""


class IndexRebuilds:
    """The schedule of one sweeper's index rebuilds (thread-safe for one rebuilding thread
    beside the ticking one).

    ``at_start=False`` skips the first rebuild: the next comes ``interval_s`` after
    construction, or at once if the epoch marker is gone or names another Redis run.
    ``stop_requested`` is polled while a rebuild waits.
    """

    def __init__(
        self,
        service: OrderService,
        interval_s: float,
        *,
        at_start: bool,
        stop_requested: Callable[[], bool],
    ) -> None:
        self.service = service
        self.interval_s = interval_s
        self._stop_requested = stop_requested
        #: When the next scheduled rebuild is due (monotonic); None: as soon as active.
        self._due_at: float | None = None if at_start else time.monotonic() + interval_s
        self._asked_at = 0.0
        # Clear while a tick runs: a rebuild waits for it between chunks.
        self._not_ticking = threading.Event()
        self._not_ticking.set()

    @contextmanager
    def ticking(self) -> Iterator[None]:
        """Around a tick: a rebuild neither starts nor goes on to its next chunk meanwhile."""
        self._not_ticking.clear()
        try:
            yield
        finally:
            self._not_ticking.set()

    def due(self) -> str | None:
        """Why a rebuild is due now (``startup``, ``scheduled``, or the epoch's finding), or
        None. Raises StoreUnavailable when Redis cannot say whether its data is intact."""
        now = self._asked_at = time.monotonic()
        if self._due_at is None:
            return "startup"
        if now >= self._due_at:
            return "scheduled"
        found = self.service.index.epoch.check()
        return None if found is IndexEpoch.INTACT else found.value

    def run(self) -> ReconcileReport:
        """Rebuild now, yielding to ticks; the next scheduled one then comes ``interval_s``
        after :meth:`due` asked. Raises RebuildStopped (the schedule unchanged, so the
        next active sweeper rebuilds again) or StoreUnavailable."""
        self._wait_for_tick()
        report = self.service.reconcile(on_progress=self._between_chunks)
        self._due_at = self._asked_at + self.interval_s
        return report

    def _between_chunks(self, users: int) -> None:
        self._wait_for_tick()

    def _wait_for_tick(self) -> None:
        """Return once no tick runs; raise RebuildStopped when asked to stop meanwhile."""
        while True:
            if self._stop_requested():
                raise RebuildStopped
            if self._not_ticking.wait(REBUILD_WAIT_S):
                return
