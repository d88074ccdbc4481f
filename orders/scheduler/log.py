"""What the scheduler tells an operator, and when: a periodic summary and the backlog's edges.

Neither class logs: each hands :class:`~orders.scheduler.sweeper.Sweeper` the fields of a line when
one is due, so the rules can be read (and tested) apart from the sweeping. Both read time
from a ``monotonic`` function in seconds (``time.monotonic`` unless a test injects one).

* :class:`LogSummary` adds up sweeps and closed-order handler runs and gives their totals
  at most once per ``period_s``, only when something happened since the last summary.
* :class:`BacklogWatch` says when the scheduler starts falling behind (an order closed, or
  still due, more than ``lag_s`` after its expiry) and when it has caught up again (both
  under half of that, so a lag hovering at the threshold does not log every tick).

Log lines of the ``orders.sweeper`` logger
(:data:`~orders.scheduler.sweeper.LOGGER_NAME`, shared by the jobs and process modules) are
JSON objects, few enough at INFO to keep:

* ``summary``, at most once per ``summary_period_s`` (10 s) and only when something happened:
  totals since the last one (sweeps that closed something, closed, batches, max_lag_ms;
  closed-order handlers' handled, failed, retried_ok; ``over_s``, the time they cover). The
  last one is written by :meth:`Sweeper.close`. Each sweep's own ``sweep`` line is DEBUG.
* at once, each time it happens: ``backlog`` (WARNING) when an order is closed, or left
  due, more than ``backlog_lag_s`` (5 s) after its expiry, and ``backlog_cleared`` when
  both are back under half that (:class:`BacklogWatch`); the lease's changes
  (``lease_acquired``, ``lease_lost``, ``lease_released``); a store outage
  (``store_unavailable``, WARNING) and its end (``store_back``), once each, not every tick;
  an index rebuild that fixed something (``reconcile``); a heartbeat that cannot be
  published (``heartbeat_failed``, :mod:`orders.scheduler.status`) and its end (``heartbeat_back``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from orders.domain import SweepResult
from orders.events.consumer import ConsumeResult

Fields = dict[str, int | float | None]


@dataclass
class _Totals:
    sweeps: int = 0
    closed: int = 0
    batches: int = 0
    max_lag_ms: int | None = None
    handled: int = 0
    failed: int = 0
    retried_ok: int = 0

    def empty(self) -> bool:
        return not (self.sweeps or self.handled or self.failed or self.retried_ok)


class LogSummary:
    """Totals of sweeps (that closed something) and handler runs since the last summary.

    Thread-safe: the sweep and the handlers run in different jobs.
    """

    def __init__(self, period_s: float, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._totals = _Totals()
        self._since = monotonic()

    def add_sweep(self, result: SweepResult) -> None:
        if not result.closed:
            return
        with self._lock:
            t = self._totals
            t.sweeps += 1
            t.closed += result.closed
            t.batches += result.batches
            if result.max_lag_ms is not None:
                t.max_lag_ms = max(t.max_lag_ms or 0, result.max_lag_ms)

    def add_handlers(self, result: ConsumeResult) -> None:
        with self._lock:
            self._totals.handled += result.handled
            self._totals.failed += result.failed
            self._totals.retried_ok += result.retried_ok

    def take(self, *, force: bool = False) -> Fields | None:
        """The totals to log, if there are any and ``period_s`` has passed since the last
        summary (``force``: whatever the time, say at shutdown); then counting starts over.

        ``over_s`` in the answer is the time since the last summary (or since the start).
        """
        with self._lock:
            now = self._monotonic()
            if self._totals.empty() or (not force and now - self._since < self.period_s):
                return None
            fields: Fields = {**asdict(self._totals), "over_s": round(now - self._since, 1)}
            self._totals = _Totals()
            self._since = now
            return fields


class BacklogWatch:
    """Whether the scheduler is behind: the edges only, each reported once."""

    def __init__(self, lag_s: float, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.lag_ms = round(lag_s * 1000)
        self._monotonic = monotonic
        self._since: float | None = None

    @property
    def behind(self) -> bool:
        return self._since is not None

    def after_sweep(
        self, result: SweepResult, oldest_due_ms: int, due: int | None
    ) -> tuple[str, Fields] | None:
        """``("backlog", fields)`` when falling behind starts, ``("backlog_cleared", ...)``
        when it ends, else None.

        ``oldest_due_ms``: how long ago the oldest order still due after the sweep expired
        (0 if none is due); ``due``: how many are due (None if it could not be counted).
        """
        lag_ms = max(result.max_lag_ms or 0, oldest_due_ms)
        if self._since is None and lag_ms > self.lag_ms:
            self._since = self._monotonic()
            return "backlog", {
                "max_lag_ms": result.max_lag_ms,
                "oldest_due_ms": oldest_due_ms,
                "due": due,
                "threshold_ms": self.lag_ms,
            }
        if self._since is not None and lag_ms <= self.lag_ms // 2:
            lasted_s = round(self._monotonic() - self._since, 1)
            self._since = None
            return "backlog_cleared", {"lasted_s": lasted_s}
        return None
