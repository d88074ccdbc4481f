"""The scheduler process: close expired orders on time, with one active sweeper at a time.

A :class:`Sweeper` does one round per :meth:`~Sweeper.tick`: take (or renew) the Redis
lease, and if it holds it, sweep SQL and work out when the next round is wanted, which is
the earliest open expiry, never later than the interval. :func:`build_scheduler` wraps it in
an APScheduler 3 job that reschedules itself with that answer, so an order closes within
milliseconds of its expiry instead of up to an interval later. :func:`run_scheduler` is the
``orders scheduler`` process: it runs until SIGTERM or SIGINT, then stops after the batch in
hand and gives the lease up.

Several processes may run at once. The lease (``SET NX PX`` with an owner token, renewed and
released only by its owner) makes one of them active and the others standbys that take
over within ``lease_ttl_s`` of its death. The lease is an economy, not a guard: the SQL
compare-and-set is what keeps an order from being closed twice, so when Redis is down every
process sweeps SQL regardless.

Log lines of the ``orders.sweeper`` logger are JSON objects. A sweep that closed something
logs one ``{"event": "sweep", ...}`` line at INFO; one that closed nothing logs nothing.
Lease changes (taken, lost, released) and store outages (once each, not once per tick) are
logged too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib import import_module
from types import FrameType
from typing import Any

from apscheduler.executors.pool import ThreadPoolExecutor  # type: ignore[import-untyped]
from apscheduler.jobstores.base import JobLookupError  # type: ignore[import-untyped]
from apscheduler.schedulers.background import (  # type: ignore[import-untyped]
    BackgroundScheduler,
)
from apscheduler.schedulers.base import (  # type: ignore[import-untyped]
    BaseScheduler,
    SchedulerNotRunningError,
)
from apscheduler.schedulers.blocking import BlockingScheduler  # type: ignore[import-untyped]
from apscheduler.triggers.interval import IntervalTrigger  # type: ignore[import-untyped]

from orders import metrics
from orders.config import check_int_range
from orders.domain import EventKind, SweepResult
from orders.errors import InvalidInput, StoreUnavailable
from orders.events import EventConsumer, OrderEvent
from orders.service import OrderService

log = logging.getLogger(__name__)

#: The APScheduler job id of the sweep.
JOB_ID = "orders-sweep"
#: The job running closed-order handlers, and how often it looks for new events.
EVENTS_JOB_ID = "orders-events"
EVENTS_INTERVAL_S = 0.5
#: The job rebuilding the Redis index, and how often it checks whether one is due.
RECONCILE_JOB_ID = "orders-reconcile"
RECONCILE_CHECK_S = 1.0
#: The soonest a next round is asked for (when due orders are left after a sweep).
MIN_DELAY_S = 0.001


def default_owner() -> str:
    """``host:pid:random``: an operator (or a test) can tell from the lease who holds it."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class Sweeper:
    """One scheduler process's sweeping, one :meth:`tick` at a time (thread-safe).

    ``interval_s``, ``lease_ttl_s`` and ``batch_size`` default to the service's settings.
    The holder renews its lease at every tick, so ticks come at least every
    ``cadence_s = min(interval_s, lease_ttl_s / 2)``: the interval unless the lease is
    configured shorter than two intervals.
    """

    def __init__(
        self,
        service: OrderService,
        *,
        interval_s: float | None = None,
        lease_ttl_s: float | None = None,
        batch_size: int | None = None,
        owner: str | None = None,
    ) -> None:
        s = service.settings
        self.service = service
        self.interval_s = _seconds(
            "interval_s", s.sweep_interval_s if interval_s is None else interval_s
        )
        self.lease_ttl_s = _seconds(
            "lease_ttl_s", s.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        )
        self.batch_size = check_int_range(
            "batch_size", s.sweep_batch_size if batch_size is None else batch_size, 1, 10_000
        )
        if owner is not None and (not isinstance(owner, str) or not owner.strip()):
            raise InvalidInput("owner", "must be a non-empty string")
        self.owner: str = owner or default_owner()
        self.lease_ttl_ms = max(1, round(self.lease_ttl_s * 1000))
        self.cadence_s = min(self.interval_s, self.lease_ttl_s / 2)
        # A long sweep renews between batches, this often, so the lease outlives it.
        self._renew_every_s = self.lease_ttl_s / 3
        # A plain attribute: request_stop() may be called from a signal handler.
        self._stop_requested = False
        self._tick_lock = threading.Lock()
        self._holds_lease = False
        self._renewed_at = 0.0
        self._lost_lease = False
        self._down: set[str] = set()
        self.reconcile_interval_s = s.reconcile_interval_s
        #: When the next scheduled reconcile is due (monotonic); None: as soon as active.
        self._reconcile_at: float | None = None

    @property
    def stopping(self) -> bool:
        return self._stop_requested

    @property
    def holds_lease(self) -> bool:
        """Whether the last word from Redis was that this sweeper holds the lease."""
        return self._holds_lease

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
        with self._tick_lock:
            if self._stop_requested or not self._take_lease():
                return self.cadence_s
            return self._sweep()

    def close(self) -> None:
        """Stop, wait for a tick in progress to finish its batch, and release the lease.

        Releasing is compare-and-delete: it never removes another process's lease.
        """
        self.request_stop()
        with self._tick_lock:
            try:
                released = self.service.index.release_lease(self.owner)
            except StoreUnavailable as exc:
                self._log(
                    logging.WARNING,
                    "lease_release_failed",
                    detail=str(exc),
                    lapses_in_s=self.lease_ttl_s,
                )
                return
            self._holds_lease = False
            if released:
                self._log(logging.INFO, "lease_released")

    # --- one round -------------------------------------------------------------------

    def _take_lease(self) -> bool:
        """True if this sweeper should sweep: it holds the lease, or Redis cannot say."""
        try:
            held = self.service.index.acquire_lease(self.owner, self.lease_ttl_ms)
        except StoreUnavailable as exc:
            self._store_down("redis", exc, "sweeping without the lease until redis is back")
            return True
        self._store_up("redis")
        self._renewed_at = time.monotonic()
        self._set_holds(held)
        return held

    def reconcile_if_due(self) -> None:
        """Rebuild the Redis index from SQL when this sweeper becomes active, on schedule,
        and at once when the epoch marker is gone (Redis lost its data).

        Only the lease holder does it. The scheduler runs it as a job of its own, beside
        the sweep, so a long rebuild never holds back the closing of expired orders.
        """
        if self._stop_requested or not self._holds_lease:
            return
        now = time.monotonic()
        if self._reconcile_at is not None and now < self._reconcile_at:
            try:
                if self.service.index.get_epoch() is not None:
                    return
            except StoreUnavailable:
                return  # _take_lease already logged the outage
            reason = "index_lost"
        else:
            reason = "scheduled" if self._reconcile_at is not None else "startup"
        started = time.monotonic()
        try:
            report = self.service.reconcile()
        except StoreUnavailable as exc:
            self._store_down(exc.store, exc, "reconcile retried in a second")
            return
        self._store_up("sql")
        self._reconcile_at = now + self.reconcile_interval_s
        self._log(
            logging.INFO if report.fixes or reason == "index_lost" else logging.DEBUG,
            "reconcile",
            reason=reason,
            duration_ms=round((time.monotonic() - started) * 1000),
            **report.as_dict(),
        )

    def _sweep(self) -> float:
        self._lost_lease = False
        started = time.monotonic()
        try:
            result = self.service.sweep_expired(
                batch_size=self.batch_size, should_stop=self._should_stop
            )
            duration_ms = round((time.monotonic() - started) * 1000)
            earliest_ms = self.service.earliest_unpaid_expiry_ms()
            now_ms = self.service.clock()
        except StoreUnavailable as exc:
            self._store_down(exc.store, exc, "retrying every tick")
            return self.cadence_s
        self._store_up("sql")
        if result.closed:
            self._log(
                logging.INFO,
                "sweep",
                closed=result.closed,
                batches=result.batches,
                users=result.users,
                max_lag_ms=result.max_lag_ms,
                duration_ms=duration_ms,
            )
        with contextlib.suppress(StoreUnavailable):
            metrics.BACKLOG.set(self.service.count_due())
        if self._stop_requested or self._lost_lease:
            return self.cadence_s
        return self._next_delay_s(result, earliest_ms, now_ms)

    def _next_delay_s(self, result: SweepResult, earliest_ms: int | None, now_ms: int) -> float:
        if earliest_ms is None:
            return self.cadence_s
        if earliest_ms <= result.cutoff_ms and result.closed == 0:
            # Due orders this sweep could not take (another sweeper holds their rows):
            # come back at the normal pace instead of spinning.
            return self.cadence_s
        return min(self.cadence_s, max(MIN_DELAY_S, (earliest_ms - now_ms) / 1000))

    def _should_stop(self) -> bool:
        """Asked before each batch: stop if asked to, or if another sweeper took over."""
        if self._stop_requested:
            return True
        if time.monotonic() - self._renewed_at < self._renew_every_s:
            return False
        self._renewed_at = time.monotonic()  # also paces retries while Redis is down
        try:
            held = self.service.index.acquire_lease(self.owner, self.lease_ttl_ms)
        except StoreUnavailable as exc:
            self._store_down("redis", exc, "sweeping without the lease until redis is back")
            return False
        self._store_up("redis")
        self._set_holds(held)
        self._lost_lease = not held
        return not held

    # --- state changes, each logged once ---------------------------------------------

    def _set_holds(self, held: bool) -> None:
        if held and not self._holds_lease:
            self._log(logging.INFO, "lease_acquired", lease_ttl_s=self.lease_ttl_s)
        elif self._holds_lease and not held:
            self._log(logging.INFO, "lease_lost")
        self._holds_lease = held

    def _store_down(self, store: str, exc: Exception, consequence: str) -> None:
        if store not in self._down:
            self._down.add(store)
            self._log(
                logging.WARNING, "store_unavailable", store=store, detail=str(exc), then=consequence
            )

    def _store_up(self, store: str) -> None:
        if store in self._down:
            self._down.discard(store)
            self._log(logging.INFO, "store_back", store=store)

    def _log(self, level: int, event: str, **fields: Any) -> None:
        log_event(level, event, owner=self.owner, **fields)


def log_event(level: int, event: str, *, owner: str, **fields: Any) -> None:
    """One log line of ``orders.sweeper``: a JSON object naming the event and the owner."""
    log.log(level, "%s", json.dumps({"event": event, **fields, "owner": owner}))


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(name, "must be a number of seconds")
    if not math.isfinite(value) or value <= 0:
        raise InvalidInput(name, "must be a positive finite number of seconds")
    return float(value)


# --- APScheduler -----------------------------------------------------------------------


class _SweepJob:
    """What APScheduler runs: one tick, then the job moves its own next run to the answer.

    The job is paused while a tick runs, so a sweep longer than the interval never makes
    the scheduler skip a run with a "maximum number of running instances" warning; the
    ``finally`` always sets the next run again. ``lock`` is held for a whole run, the
    rescheduling included, which lets shutdown wait for a run to finish *before* it takes
    the scheduler's locks (shutting down holds them while joining the worker thread, and
    a rescheduling run needs them: waiting inside would deadlock).
    """

    def __init__(self, sweeper: Sweeper, *, exit_when_stopped: bool) -> None:
        self.sweeper = sweeper
        self.exit_when_stopped = exit_when_stopped
        self.lock = threading.Lock()
        self.scheduler: Any = None

    def __call__(self) -> None:
        with self.lock:
            if self.sweeper.stopping:
                self._exit()
                return
            self._move(None)
            delay_s = self.sweeper.cadence_s
            try:
                delay_s = self.sweeper.tick()
            finally:
                self._after_tick(delay_s)

    def _after_tick(self, delay_s: float) -> None:
        if self.sweeper.stopping:
            self._exit()
        else:
            self._move(delay_s)

    def _move(self, delay_s: float | None) -> None:
        """Set the job's next run ``delay_s`` from now (None: pause it)."""
        at = None if delay_s is None else datetime.now(UTC) + timedelta(seconds=delay_s)
        try:
            self.scheduler.modify_job(JOB_ID, next_run_time=at)
        except JobLookupError:
            log.debug("the sweep job is gone; not rescheduled")

    def _exit(self) -> None:
        """A blocking scheduler ends once the sweeper stops: start() returns to its caller."""
        if self.exit_when_stopped:
            with contextlib.suppress(SchedulerNotRunningError):
                self.scheduler.shutdown(wait=False)


def _stop_job(job: _SweepJob, *, wait: bool) -> None:
    job.sweeper.request_stop()
    if wait:
        with job.lock:
            pass


class _BlockingSweepScheduler(BlockingScheduler):  # type: ignore[misc]
    sweep_job: _SweepJob

    def shutdown(self, wait: bool = True) -> None:
        _stop_job(self.sweep_job, wait=wait)
        super().shutdown(wait)


class _BackgroundSweepScheduler(BackgroundScheduler):  # type: ignore[misc]
    sweep_job: _SweepJob

    def shutdown(self, wait: bool = True) -> None:
        _stop_job(self.sweep_job, wait=wait)
        super().shutdown(wait)


def build_scheduler(sweeper: Sweeper, *, blocking: bool) -> BaseScheduler:
    """An APScheduler 3 scheduler (UTC) running ``sweeper`` now and then as it asks.

    The job: ``max_instances=1``, ``coalesce=True``, ``misfire_grace_time=None`` (a late run
    is run, never dropped), an interval trigger of ``sweeper.cadence_s`` as the fallback,
    and after each tick its next run moved to what the tick returned.

    ``shutdown(wait=...)`` asks the sweeper to stop after the batch in hand, and with
    ``wait=True`` waits for it. It does not release the lease: call ``sweeper.close()``.
    A blocking scheduler also ends by itself once ``sweeper.request_stop()`` is called (say,
    from a signal handler): its ``start()`` returns within one cadence, or after the batch
    in hand.
    """
    job = _SweepJob(sweeper, exit_when_stopped=blocking)
    scheduler_class = _BlockingSweepScheduler if blocking else _BackgroundSweepScheduler
    scheduler = scheduler_class(
        timezone=UTC, executors={"default": ThreadPoolExecutor(max_workers=3)}
    )
    scheduler.sweep_job = job
    job.scheduler = scheduler
    scheduler.add_job(
        job,
        IntervalTrigger(seconds=sweeper.cadence_s, timezone=UTC),
        id=JOB_ID,
        name="orders sweep",
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
        next_run_time=datetime.now(UTC),
    )
    scheduler.add_job(
        sweeper.reconcile_if_due,
        IntervalTrigger(seconds=RECONCILE_CHECK_S, timezone=UTC),
        id=RECONCILE_JOB_ID,
        name="orders index rebuild",
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
    )
    consumers = closed_order_consumers(sweeper.service)
    if consumers:
        scheduler.add_job(
            _EventsJob(sweeper, consumers),
            IntervalTrigger(seconds=EVENTS_INTERVAL_S, timezone=UTC),
            id=EVENTS_JOB_ID,
            name="orders closed-order handlers",
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
        )
    return scheduler


def load_handler(path: str) -> Callable[[OrderEvent], None]:
    """``package.module:function`` (or ``package.module.function``) to the function."""
    module_name, _, attr = path.strip().replace(":", ".").rpartition(".")
    if not module_name or not attr:
        raise InvalidInput("on_closed", "must name handlers as package.module:function")
    try:
        handler: Callable[[OrderEvent], None] = getattr(import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise InvalidInput("on_closed", f"cannot import the handler {path.strip()}") from None
    return handler


def closed_order_consumers(service: OrderService) -> list[EventConsumer]:
    """One durable consumer per closed-order handler: registered in code or configured."""
    handlers = list(service.closed_handlers)
    handlers += [load_handler(p) for p in service.settings.on_closed.split(",") if p.strip()]
    return [
        EventConsumer(
            service.engine,
            f"on_closed:{h.__module__}.{h.__qualname__}"[:64],
            h,
            kinds=[EventKind.CLOSED],
            clock=service.clock,
        )
        for h in handlers
    ]


class _EventsJob:
    """Runs the closed-order handlers; only the active scheduler does (the lease holder)."""

    def __init__(self, sweeper: Sweeper, consumers: list[EventConsumer]) -> None:
        self.sweeper = sweeper
        self.consumers = consumers

    def __call__(self) -> None:
        if self.sweeper.stopping or not self.sweeper.holds_lease:
            return
        for consumer in self.consumers:
            try:
                result = consumer.run_once()
            except StoreUnavailable as exc:
                log_event(
                    logging.WARNING,
                    "handlers_failed",
                    owner=self.sweeper.owner,
                    consumer=consumer.name,
                    detail=str(exc),
                )
                continue
            if result.handled or result.failed or result.retried_ok:
                log_event(
                    logging.INFO,
                    "handlers",
                    owner=self.sweeper.owner,
                    consumer=consumer.name,
                    handled=result.handled,
                    failed=result.failed,
                    retried_ok=result.retried_ok,
                )


def run_scheduler(
    service: OrderService,
    *,
    interval_s: float | None = None,
    lease_ttl_s: float | None = None,
    batch_size: int | None = None,
) -> None:
    """Sweep until SIGTERM or SIGINT, then finish the batch in hand, release the lease and
    return. Call it from the main thread (signal handlers are installed there).

    The handlers only set the sweeper's stop flag: the job notices it after its batch (or
    at its next run, within one cadence) and ends the scheduler from an ordinary thread,
    so no lock is ever taken inside a signal handler.
    """
    sweeper = Sweeper(
        service, interval_s=interval_s, lease_ttl_s=lease_ttl_s, batch_size=batch_size
    )
    scheduler = build_scheduler(sweeper, blocking=True)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sweeper.request_stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    log_event(
        logging.INFO,
        "scheduler_started",
        owner=sweeper.owner,
        interval_s=sweeper.interval_s,
        lease_ttl_s=sweeper.lease_ttl_s,
        batch_size=sweeper.batch_size,
    )
    try:
        scheduler.start()
    finally:
        sweeper.close()
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        log_event(logging.INFO, "scheduler_stopped", owner=sweeper.owner)
