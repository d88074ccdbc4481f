"""The active/standby sweeper: close expired orders on time, one active process at a time.

A :class:`Sweeper` does one round per :meth:`~Sweeper.tick`: take (or renew) the Redis
lease (:class:`~orders.index.lease.SweeperLease`), and if it holds it, sweep SQL and work out when
the next round is wanted, which is the earliest open expiry, never later than the interval.
:mod:`orders.scheduler.jobs` runs it in APScheduler and :mod:`orders.scheduler.process` is the
``orders scheduler`` process.

Several processes may run at once. The lease (an owner token with a ``PX`` expiry, taken
when free, renewed and released only by its owner; still renewed when Redis is at
maxmemory) makes one of them active and the others standbys that take over within
``lease_ttl_s`` of its death. The lease is an economy, not a guard: the SQL
compare-and-set is what keeps an order from being closed twice, so when Redis is down every
process sweeps SQL regardless.

Its log lines (logger ``orders.sweeper``, :data:`LOGGER_NAME`) are listed in
:mod:`orders.scheduler.log`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from orders import metrics
from orders.domain import SweepResult
from orders.errors import InvalidInput, StoreUnavailable
from orders.events.consumer import ConsumeResult
from orders.index.lease import SweeperLease
from orders.scheduler.log import BacklogWatch, LogSummary
from orders.scheduler.pause_watch import PauseWatch
from orders.scheduler.rebuild import UNSCHEDULED, IndexRebuilds, RebuildStopped
from orders.scheduler.status import SweeperStatus
from orders.service import OrderService
from orders.validation import check_count, check_seconds

#: The scheduler process's one logger; operators filter on this name (docs/operations.md).
LOGGER_NAME = "orders.sweeper"
log = logging.getLogger(LOGGER_NAME)

#: The soonest a next round is asked for (when due orders are left after a sweep).
MIN_DELAY_S = 0.001
#: How often, at most, the summary line is written.
SUMMARY_PERIOD_S = 10.0
#: A close lag (or a due order's age) beyond this is a backlog.
BACKLOG_LAG_S = 5.0


def default_owner() -> str:
    """``host:pid:random``: an operator (or a test) can tell from the lease who holds it."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Sweeper:
    """One scheduler process's sweeping, one :meth:`tick` at a time (thread-safe).

    ``interval_s``, ``lease_ttl_s`` and ``batch_size`` default to the service's settings.
    The holder renews its lease at every tick, so ticks come at least every
    ``cadence_s = min(interval_s, lease_ttl_s / 2)``: the interval unless the lease is
    configured shorter than two intervals.

    The active sweeper rebuilds the Redis index from SQL as soon as it takes the lease,
    then every ``reconcile_interval_s`` (:class:`~orders.scheduler.rebuild.IndexRebuilds`);
    ``reconcile_at_start=False`` skips the first rebuild.

    ``summary_period_s`` and ``backlog_lag_s`` shape the log (see the module docstring);
    ``monotonic`` is the clock, in seconds, of those two (tests inject one).
    """

    def __init__(
        self,
        service: OrderService,
        *,
        interval_s: float | None = None,
        lease_ttl_s: float | None = None,
        batch_size: int | None = None,
        owner: str | None = None,
        reconcile_at_start: bool = True,
        summary_period_s: float = SUMMARY_PERIOD_S,
        backlog_lag_s: float = BACKLOG_LAG_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        s = service.settings
        self.service = service
        self.interval_s = check_seconds(
            "interval_s", s.sweep_interval_s if interval_s is None else interval_s
        )
        self.lease_ttl_s = check_seconds(
            "lease_ttl_s", s.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        )
        self.batch_size = check_count(
            "batch_size", s.sweep_batch_size if batch_size is None else batch_size, 1, 10_000
        )
        if owner is not None and (not isinstance(owner, str) or not owner.strip()):
            raise InvalidInput("owner", "must be a non-empty string")
        self.owner: str = owner or default_owner()
        self.lease = SweeperLease(service.index.client, key_prefix=service.index.key_prefix)
        self.lease_ttl_ms = max(1, round(self.lease_ttl_s * 1000))
        #: Its gauges, heartbeat and health facts (:mod:`orders.scheduler.status`).
        self.status = SweeperStatus(service, self.owner, self.lease_ttl_ms, log=self.log_event)
        self.cadence_s = min(self.interval_s, self.lease_ttl_s / 2)
        # A long sweep renews between batches, this often, so the lease outlives it.
        self._renew_every_s = self.lease_ttl_s / 3
        # A plain attribute: request_stop() may be called from a signal handler.
        self._stop_requested = False
        self._tick_lock = threading.Lock()
        #: Totals for the periodic summary line; the events job adds the handlers' runs.
        self.summary = LogSummary(
            check_seconds("summary_period_s", summary_period_s), monotonic=monotonic
        )
        backlog_lag_s = check_seconds("backlog_lag_s", backlog_lag_s)
        self._backlog = BacklogWatch(backlog_lag_s, monotonic=monotonic)
        self._pause = PauseWatch(service.operations.current_pause, self.log_event)
        self._holds_lease = False
        self._renewed_at = 0.0
        self._lost_lease = False
        self._down: set[str] = set()
        self.rebuilds = IndexRebuilds(
            service,
            s.reconcile_interval_s,
            at_start=reconcile_at_start,
            stop_requested=lambda: self._stop_requested,
        )

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    @property
    def holds_lease(self) -> bool:
        """Whether the last word from Redis was that this sweeper holds the lease."""
        return self._holds_lease

    @property
    def last_sweep_ms(self) -> int | None:
        """Service-clock ms of the last sweep that ran to its end without a store error."""
        return self.status.last_sweep_ms

    @property
    def lease_expires_ms(self) -> int | None:
        """When this sweeper's lease lapses unless renewed; None while it does not hold it."""
        return self.status.lease_expires_ms

    def request_stop(self) -> None:
        """Stop a running sweep after its current batch; later ticks do nothing.

        Only sets a flag, so it is safe in a signal handler. It cannot be undone.
        """
        self._stop_requested = True

    def tick(self) -> float:
        """One round: take or renew the lease; if active, sweep.

        Returns the seconds until the next round is wanted, ``0 < x <= interval_s``: the
        time until the earliest open expiry when that comes sooner, else the cadence.
        """
        with self._tick_lock, self.rebuilds.ticking():
            self.status.alive()
            try:
                if self._stop_requested or not self._take_lease():
                    return self.cadence_s
                return self._sweep()
            finally:
                if not self._stop_requested and "redis" not in self._down:
                    self.status.beat(self._holds_lease)  # (an outage is logged once already)
                self.log_summary_if_due()

    def close(self) -> None:
        """Stop, wait for a tick in progress to finish its batch, and release the lease.

        Releasing is compare-and-delete: it never removes another process's lease.
        """
        self.request_stop()
        with self._tick_lock:
            self.log_summary_if_due(force=True)
            try:
                released = self.lease.release(self.owner)
            except StoreUnavailable as exc:
                self.log_event(
                    logging.WARNING,
                    "lease_release_failed",
                    detail=str(exc),
                    lapses_in_s=self.lease_ttl_s,
                )
                return
            self._holds_lease = False
            self.status.stopped()
            if released:
                self.log_event(logging.INFO, "lease_released")

    # --- one round -------------------------------------------------------------------

    def _take_lease(self) -> bool:
        """True if this sweeper should sweep: it holds the lease, or Redis cannot say."""
        return self._renew() is not False

    def _renew(self) -> bool | None:
        """Take or renew the lease: whether this sweeper holds it now, or None when Redis
        cannot say (the outage is logged; the sweeper sweeps without the lease)."""
        self._renewed_at = time.monotonic()  # also paces retries while Redis is down
        asked_at_ms = self.service.clock()
        try:
            held = self.lease.acquire(self.owner, self.lease_ttl_ms)
        except StoreUnavailable as exc:
            self._store_down("redis", exc, "sweeping without the lease until redis is back")
            return None
        self._store_up("redis")
        self._set_holds(held, asked_at_ms)
        return held

    def reconcile_if_due(self) -> None:
        """Rebuild the Redis index from SQL when this sweeper becomes active, on schedule,
        and at once when an epoch marker is gone (Redis lost its data: reason
        ``index_lost``) or names another server run (Redis restarted or failed over, maybe
        from an older snapshot: ``index_rewound``); see :mod:`orders.index.epoch`.

        Only the lease holder does it. The scheduler runs it as a job of its own, so a long
        rebuild never holds back the closing of expired orders: the sweep goes first
        (:class:`~orders.scheduler.rebuild.IndexRebuilds`).
        """
        if self._stop_requested or not self._holds_lease:
            return
        try:
            reason = self.rebuilds.due()
        except StoreUnavailable:
            return  # _take_lease already logged the outage
        if reason is None:
            return
        try:
            started = time.monotonic()
            report = self.rebuilds.run()
        except RebuildStopped:
            self.log_event(logging.DEBUG, "reconcile_stopped", reason=reason)
            return
        except StoreUnavailable as exc:
            self._store_down(exc.store, exc, "reconcile retried in a second")
            return
        self._store_up("sql")
        self.log_event(
            logging.INFO if report.fixes or reason in UNSCHEDULED else logging.DEBUG,
            "reconcile",
            reason=reason,
            duration_ms=round((time.monotonic() - started) * 1000),
            **report.as_dict(),
        )

    def _sweep(self) -> float:
        self._lost_lease = False
        started = time.monotonic()
        try:
            if self._pause.paused():
                return self.cadence_s
        except StoreUnavailable as exc:
            self._store_down(exc.store, exc, "retrying every tick")
            return self.cadence_s
        self._backlog.sweep_started()
        try:
            result = self.service.sweep_expired(
                batch_size=self.batch_size, should_stop=self._should_stop
            )
            duration_ms = round((time.monotonic() - started) * 1000)
            earliest_ms = self.service.earliest_unpaid_expiry_ms()
            reminder_ms = self._earliest_reminder_ms()
            now_ms = self.service.clock()
        except StoreUnavailable as exc:
            self._store_down(exc.store, exc, "retrying every tick")
            return self.cadence_s
        self._store_up("sql")
        whole = not (self._stop_requested or self._lost_lease)
        self.status.swept(earliest_ms, now_ms, whole=whole)
        if result.closed:
            fields = {**asdict(result), "duration_ms": duration_ms}
            if self._lost_lease:  # after a freeze, written after the lease_lost its end found
                fields["lease_lost"] = True
            self.log_event(logging.DEBUG, "sweep", **fields)
        self.summary.add_sweep(result)
        due: int | None = None
        with contextlib.suppress(StoreUnavailable):
            due = self.service.count_due()
            metrics.BACKLOG.set(due)
        if self._stop_requested or self._lost_lease:
            return self.cadence_s  # the backlog is no longer ours to judge
        self._watch_backlog(result, earliest_ms, now_ms, due)
        return self._next_delay_s(result, earliest_ms, now_ms, reminder_ms)

    def _watch_backlog(
        self, result: SweepResult, earliest_ms: int | None, now_ms: int, due: int | None
    ) -> None:
        edge = self._backlog.after_sweep(result, earliest_ms, now_ms, due)
        if edge is not None:
            event, fields = edge
            self.log_event(
                logging.WARNING if self._backlog.behind else logging.INFO, event, **fields
            )

    def _earliest_reminder_ms(self) -> int | None:
        """None while reminders are off: the sweep writes none, so none is waited for."""
        if not self.service.settings.reminds:
            return None
        return self.service.earliest_reminder_ms()

    def _next_delay_s(
        self,
        result: SweepResult,
        earliest_ms: int | None,
        now_ms: int,
        reminder_ms: int | None = None,
    ) -> float:
        """The cadence, or sooner: when the earliest expiry (or reminder) is due sooner."""
        return min(
            self.cadence_s,
            self._delay_until_s(earliest_ms, result.closed, result.cutoff_ms, now_ms),
            self._delay_until_s(reminder_ms, result.reminded, result.cutoff_ms, now_ms),
        )

    def _delay_until_s(self, due_ms: int | None, done: int, cutoff_ms: int, now_ms: int) -> float:
        """Until ``due_ms``; ``done``: what the sweep just wrote of that kind."""
        if due_ms is None:
            return self.cadence_s
        if due_ms <= cutoff_ms and done == 0:
            # Due rows this sweep could not take (another sweeper holds them): come back
            # at the normal pace instead of spinning.
            return self.cadence_s
        return max(MIN_DELAY_S, (due_ms - now_ms) / 1000)

    def _should_stop(self) -> bool:
        """Asked before each batch: stop if asked to, or if another sweeper took over."""
        if self._stop_requested:
            return True
        self.status.alive()
        if time.monotonic() - self._renewed_at < self._renew_every_s:
            return False
        held = self._renew()
        if held is None:
            return False
        self._lost_lease = not held
        return not held

    # --- what is logged -----------------------------------------------------------------

    def add_handler_run(self, consumer: str, result: ConsumeResult) -> None:
        """Count a closed-order handlers' run in the summary (its own line is DEBUG)."""
        if result.handled or result.failed or result.retried_ok:
            self.log_event(logging.DEBUG, "handlers", consumer=consumer, **asdict(result))
            self.summary.add_handlers(result)
        self.log_summary_if_due()

    def log_summary_if_due(self, *, force: bool = False) -> None:
        """Write the summary line if its period has passed and there is something in it."""
        fields = self.summary.take(force=force)
        if fields is not None:
            self.log_event(logging.INFO, "summary", **fields)

    # --- state changes, each logged once ---------------------------------------------

    def _set_holds(self, held: bool, asked_at_ms: int) -> None:
        self.status.lease_seen(held, asked_at_ms)
        if held and not self._holds_lease:
            self.log_event(logging.INFO, "lease_acquired", lease_ttl_s=self.lease_ttl_s)
        elif self._holds_lease and not held:
            self.log_event(logging.INFO, "lease_lost")
        self._holds_lease = held

    def _store_down(self, store: str, exc: Exception, consequence: str) -> None:
        if store not in self._down:
            self._down.add(store)
            self.log_event(
                logging.WARNING, "store_unavailable", store=store, detail=str(exc), then=consequence
            )

    def _store_up(self, store: str) -> None:
        if store in self._down:
            self._down.discard(store)
            self.log_event(logging.INFO, "store_back", store=store)

    def log_event(self, level: int, event: str, **fields: Any) -> None:
        """One line of ``orders.sweeper``: a JSON object naming the event and this owner."""
        log.log(level, "%s", json.dumps({"event": event, **fields, "owner": self.owner}))
