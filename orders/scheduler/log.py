"""What the scheduler tells an operator, and when: a periodic summary and the backlog's edges.

Neither class logs: each hands :class:`~orders.scheduler.sweeper.Sweeper` the fields of a line when
one is due, so the rules can be read (and tested) apart from the sweeping. Both read time
from a ``monotonic`` function in seconds (``time.monotonic`` unless a test injects one).

* :class:`LogSummary` adds up sweeps and closed-order handler runs and gives their totals
  at most once per ``period_s``, only when something happened since the last summary.
* :class:`BacklogWatch` says when the scheduler starts falling behind (an order closed, or
  still due, more than ``lag_s`` after its expiry, as far as its own clock can have seen
  it due) and when it has caught up again (under half of that, so a lag hovering at the
  threshold does not log every tick).

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
    """Whether the scheduler is behind: the edges only, each reported once.

    Lateness is judged on this sweeper's own clock. An order's expiry was written with its
    creating host's clock; a host whose clock runs behind writes orders that look overdue
    (to the sweeper's clock) the moment they appear, and such an order is not late: nobody
    could have closed it earlier. So the lag of a sweep is the clocks' difference (a close
    minus the expiry, or now minus the oldest due expiry) capped by how long this sweeper
    could have seen the order due (its monotonic clock):

    * an order closed by this sweep was not closable when the previous sweep started (that
      sweep would have taken it), unless the previous sweep left it due: it counts from the
      previous sweep's start, or from when the orders left due were first seen;
    * orders left due count from the start of the sweep before the one that first left
      them, for as long as each later sweep leaves some of them: it closed fewer orders
      than were left, or the oldest expiry first left is still due. An order that appears
      already overdue after a sweep, from a host whose clock runs behind, is closed by the
      next one and starts no run.

    On its first sweep (after a start or a takeover with no sweep of its own before) the
    sweeper counts from that sweep's start: orders a dead predecessor left overdue are
    warned only if they take longer than the threshold to close. The gauges
    (``orders_oldest_overdue_unpaid_seconds``, the close-lag histogram) keep the clocks'
    difference. Call :meth:`sweep_started` as each sweep starts.
    """

    def __init__(self, lag_s: float, *, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.lag_ms = round(lag_s * 1000)
        self._monotonic = monotonic
        self._since: float | None = None
        self._started: float | None = None
        #: The start of the last sweep judged (monotonic).
        self._last_start: float | None = None
        #: While sweeps leave orders due: the oldest expiry when they were first left (ms),
        #: since when (monotonic) they may have been due in this sweeper's sight, and how
        #: many the last sweep left (None: not counted).
        self._left: tuple[int, float, int | None] | None = None

    @property
    def behind(self) -> bool:
        return self._since is not None

    def sweep_started(self) -> None:
        self._started = self._monotonic()

    def after_sweep(
        self, result: SweepResult, earliest_ms: int | None, now_ms: int, due: int | None
    ) -> tuple[str, Fields] | None:
        """``("backlog", fields)`` when falling behind starts, ``("backlog_cleared", ...)``
        when it ends, else None.

        ``earliest_ms``: the earliest unpaid expiry after the sweep (None if none), read
        before ``now_ms``, the service's clock then; ``due``: how many are due (None if it
        could not be counted).
        """
        now = self._monotonic()
        started = now if self._started is None else self._started
        # Its first sweep counts from its own start: it saw nothing due before.
        fresh = started if self._last_start is None else self._last_start
        seen_since = fresh if self._left is None else self._left[1]
        lag_ms = min(result.max_lag_ms or 0, _ms(now - seen_since))
        oldest_due_ms = 0 if earliest_ms is None else max(0, now_ms - earliest_ms)
        if earliest_ms is not None and earliest_ms <= now_ms:
            left = self._left
            if left is not None and _still_left(left, result, earliest_ms):
                since = left[1]
                self._left = (left[0], since, due)
            else:
                since = fresh
                self._left = (earliest_ms, since, due)
            lag_ms = max(lag_ms, min(oldest_due_ms, _ms(now - since)))
        else:
            self._left = None
        self._last_start, self._started = started, None
        return self._edge(lag_ms, result, oldest_due_ms, due)

    def _edge(
        self, lag_ms: int, result: SweepResult, oldest_due_ms: int, due: int | None
    ) -> tuple[str, Fields] | None:
        if self._since is None and lag_ms > self.lag_ms:
            self._since = self._monotonic()
            return "backlog", {
                "lag_ms": lag_ms,
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


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _still_left(left: tuple[int, float, int | None], result: SweepResult, earliest_ms: int) -> bool:
    """Whether some of the orders the previous sweep left due are still due: the oldest of
    them still is, or this sweep closed fewer orders than were left."""
    oldest_ms, _, left_count = left
    return earliest_ms <= oldest_ms or (left_count is not None and result.closed < left_count)
