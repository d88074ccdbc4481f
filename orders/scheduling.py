"""The sweeper in APScheduler 3: the jobs, the schedulers that run them, ``build_scheduler``.

:func:`build_scheduler` wraps a :class:`~orders.sweeper.Sweeper` in a job that reschedules
itself with each tick's answer, so an order closes within milliseconds of its expiry
instead of up to an interval later. Beside it run the index rebuild (reconcile) and, when
there are closed-order handlers (:func:`closed_order_consumers`), the events job. Only the
lease holder does any of that work. Logging goes to the sweeper's logger
(:data:`orders.sweeper.LOGGER_NAME`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from importlib import import_module
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

from orders.domain import EventKind
from orders.errors import InvalidInput, StoreUnavailable
from orders.events import EventConsumer, OrderEvent
from orders.service import OrderService
from orders.sweeper import LOGGER_NAME, Sweeper, log_event

log = logging.getLogger(LOGGER_NAME)

#: The APScheduler job id of the sweep.
JOB_ID = "orders-sweep"
#: The width of ``event_cursors.name``.
CONSUMER_NAME_LENGTH = 64
#: The job running closed-order handlers, and how often it looks for new events.
EVENTS_JOB_ID = "orders-events"
EVENTS_INTERVAL_S = 0.5
#: The job rebuilding the Redis index, and how often it checks whether one is due.
RECONCILE_JOB_ID = "orders-reconcile"
RECONCILE_CHECK_S = 1.0


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
    _add_job(
        scheduler, job, sweeper.cadence_s, JOB_ID, "orders sweep", next_run_time=datetime.now(UTC)
    )
    _add_job(
        scheduler,
        sweeper.reconcile_if_due,
        RECONCILE_CHECK_S,
        RECONCILE_JOB_ID,
        "orders index rebuild",
    )
    consumers = closed_order_consumers(sweeper.service)
    if consumers:
        _add_job(
            scheduler,
            _EventsJob(sweeper, consumers),
            EVENTS_INTERVAL_S,
            EVENTS_JOB_ID,
            "orders closed-order handlers",
        )
    return scheduler


def _add_job(
    scheduler: BaseScheduler,
    func: Callable[[], None],
    every_s: float,
    job_id: str,
    name: str,
    **options: Any,
) -> None:
    """Every job runs one at a time, coalesced, and late runs are run, never dropped.

    ``options`` go to ``add_job`` as they are (``next_run_time``: None would pause the job,
    so it is passed only when given).
    """
    scheduler.add_job(
        func,
        IntervalTrigger(seconds=every_s, timezone=UTC),
        id=job_id,
        name=name,
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
        **options,
    )


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


def consumer_name(handler: Callable[[OrderEvent], None]) -> str:
    """The durable cursor's name for a closed-order handler: at most 64 characters.

    A name cut to fit ends in a hash of the whole, so two handlers whose names share a
    long prefix never share a cursor (one would silently skip what the other consumed).
    """
    name = f"on_closed:{handler.__module__}.{handler.__qualname__}"
    if len(name) <= CONSUMER_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{name[: CONSUMER_NAME_LENGTH - 13]}~{digest}"


def closed_order_consumers(service: OrderService) -> list[EventConsumer]:
    """One durable consumer per closed-order handler: registered in code or configured."""
    handlers = list(service.closed_handlers)
    handlers += [load_handler(p) for p in service.settings.on_closed.split(",") if p.strip()]
    names = [consumer_name(h) for h in handlers]
    if len(set(names)) != len(names):
        raise InvalidInput("on_closed", "names one handler twice")
    return [
        EventConsumer(
            service.engine,
            name,
            handler,
            kinds=[EventKind.CLOSED],
            clock=service.clock,
            max_attempts=service.settings.event_max_attempts,
        )
        for name, handler in zip(names, handlers, strict=True)
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
