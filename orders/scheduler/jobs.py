"""The sweeper in APScheduler 3: the jobs, the schedulers that run them, ``build_scheduler``.

:func:`build_scheduler` wraps a :class:`~orders.scheduler.sweeper.Sweeper` in a job that reschedules
itself with each tick's answer, so an order closes within milliseconds of its expiry
instead of up to an interval later. Beside it run the index rebuild (reconcile) and, when
there are event handlers (``on_closed``, ``on_payment_refused``:
:func:`closed_order_consumers`), the events job, and with ``webhook_url`` the webhook job
(:func:`orders.events.webhooks.webhook_consumer`). Only the lease holder does any of that
work. Logging goes to the sweeper's logger (:data:`orders.scheduler.sweeper.LOGGER_NAME`);
a job run that ends in an exception is counted in ``orders_job_failures_total``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.events import (  # type: ignore[import-untyped]
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    JobExecutionEvent,
)
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
from apscheduler.triggers.base import BaseTrigger  # type: ignore[import-untyped]

from orders import metrics
from orders.events.webhooks import webhook_consumer
from orders.scheduler.event_jobs import EVENTS_INTERVAL_S, EventsJob, closed_order_consumers
from orders.scheduler.retention_job import RETENTION_JOB_ID, STANDBY_S, prune_step
from orders.scheduler.sweeper import LOGGER_NAME, Sweeper

log = logging.getLogger(LOGGER_NAME)

#: The APScheduler job id of the sweep.
JOB_ID = "orders-sweep"
#: The job running closed-order handlers (every ``EVENTS_INTERVAL_S``).
EVENTS_JOB_ID = "orders-events"
#: The job POSTing events to ``Settings.webhook_url``, and the events it takes per run: a
#: receiver that hangs holds a run (and a shutdown) up to about twice this many timeouts.
WEBHOOK_JOB_ID = "orders-webhook"
WEBHOOK_BATCH = 10
#: The job rebuilding the Redis index, and how often it checks whether one is due.
RECONCILE_JOB_ID = "orders-reconcile"
RECONCILE_CHECK_S = 1.0


#: How far ahead a submitted run parks its job until the run's end sets the next run.
PARKED = timedelta(days=365)


class _RescheduledByEachRun(BaseTrigger):  # type: ignore[misc]
    """The trigger of each of our jobs: the first run ``first_s`` after the job is added,
    then the time each run's end asked for (:meth:`_PausingJob.rescheduled`).

    APScheduler asks a job's trigger for its next run time as it submits a run. Unless that
    run has ended already, this one answers :data:`PARKED` (a year ahead), so the job is
    never due again while the run is counted as running, however long the run or its
    thread takes (an interval trigger answered one interval ahead, and a thread stalled
    that long before the run paused its job made APScheduler skip it with a warning).
    """

    def __init__(self, first_s: float) -> None:
        self.first_s = first_s
        #: (the scheduled time of the last run that ended, the next run it asked for).
        self.ended: tuple[datetime, datetime] | None = None

    def get_next_fire_time(self, previous_fire_time: datetime | None, now: datetime) -> datetime:
        if previous_fire_time is None:
            return now + timedelta(seconds=self.first_s)
        ended = self.ended
        if ended is not None and ended[0] == previous_fire_time:
            # The run ended before APScheduler finished submitting it (its future was done
            # when the callback was added, so the callback ran here, on the scheduler's
            # thread): what the run asked for stands.
            return ended[1]
        return now + PARKED

    def __str__(self) -> str:
        return f"first after {self.first_s} s, then as each run says"


class _PausingJob:
    """What APScheduler runs for each of our jobs: ``step``, then, once APScheduler no
    longer counts the run, the job's next run set to the seconds ``step`` returned.

    APScheduler counts a run from its submission until its thread has returned from the
    function and run the future's callback; a job due again meanwhile is skipped with a
    "maximum number of running instances" warning. So the job is never due during that time:
    the trigger (:class:`_RescheduledByEachRun`) parks it a year ahead at submission, and
    the next run is set by :meth:`rescheduled`, a listener of the run's end, which
    APScheduler calls after it stopped counting the run (setting it at the end of the run
    itself left a window: a thread stalled there for longer than the delay, a GC pause or
    a stopped process, made the job due while still counted).

    ``lock`` is held for a run and for its rescheduling, which lets shutdown wait for both
    *before* it takes the scheduler's locks (shutting down holds them while joining the
    worker threads, and rescheduling needs them: waiting inside would deadlock). Once the
    sweeper stops, the job is not rescheduled and ``on_stop`` (if any) is called.
    """

    def __init__(
        self,
        job_id: str,
        sweeper: Sweeper,
        step: Callable[[], float],
        *,
        first_s: float,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.job_id = job_id
        self.sweeper = sweeper
        self.step = step
        self.on_stop = on_stop
        self.trigger = _RescheduledByEachRun(first_s)
        self.lock = threading.Lock()
        self.scheduler: Any = None
        #: What the last run asked for (the cadence if it raised).
        self.delay_s = sweeper.cadence_s

    def __call__(self) -> None:
        with self.lock:
            self.delay_s = self.sweeper.cadence_s
            if not self.sweeper.stopping:
                self.delay_s = self.step()

    def rescheduled(self, event: JobExecutionEvent) -> None:
        """The listener of a run's end (EVENT_JOB_EXECUTED or EVENT_JOB_ERROR): set the
        job's next run, or call ``on_stop`` once the sweeper stops."""
        if event.job_id != self.job_id:
            return
        with self.lock:
            if self.sweeper.stopping:
                if self.on_stop is not None:
                    self.on_stop()
                return
            at = datetime.now(UTC) + timedelta(seconds=self.delay_s)
            self.trigger.ended = (event.scheduled_run_time, at)
            try:
                self.scheduler.modify_job(self.job_id, next_run_time=at)
            except JobLookupError:
                log.debug("the job %s is gone; not rescheduled", self.job_id)


def _exit(scheduler: BaseScheduler) -> None:
    """A blocking scheduler ends once the sweeper stops: start() returns to its caller."""
    with contextlib.suppress(SchedulerNotRunningError):
        scheduler.shutdown(wait=False)


class _SweepScheduler(BaseScheduler):  # type: ignore[misc]
    """What the blocking and the background scheduler add alike: ``shutdown`` first asks
    the sweeper to stop after the batch in hand and, with ``wait``, waits for the jobs."""

    sweeper: Sweeper
    pausing_jobs: list[_PausingJob]

    def shutdown(self, wait: bool = True) -> None:
        self.sweeper.request_stop()
        if wait:
            for job in self.pausing_jobs:
                with job.lock:
                    pass
        super().shutdown(wait)


class _BlockingSweepScheduler(_SweepScheduler, BlockingScheduler):  # type: ignore[misc]
    pass


class _BackgroundSweepScheduler(_SweepScheduler, BackgroundScheduler):  # type: ignore[misc]
    pass


def build_scheduler(sweeper: Sweeper, *, blocking: bool) -> BaseScheduler:
    """An APScheduler 3 scheduler (UTC) running ``sweeper`` now and then as it asks.

    The job: ``max_instances=1``, ``coalesce=True``, ``misfire_grace_time=None`` (a late run
    is run, never dropped), run at once, and after each tick its next run set to what the
    tick returned. The index rebuild and the handlers run in jobs of their own, every
    ``RECONCILE_CHECK_S`` and ``EVENTS_INTERVAL_S`` after the end of the last run. No job
    is due while a run of it is counted as running (:class:`_PausingJob`), so none is
    ever skipped with a warning, however long a run or its thread takes.

    ``shutdown(wait=...)`` asks the sweeper to stop after the batch in hand, and with
    ``wait=True`` waits for it. It does not release the lease: call ``sweeper.close()``.
    A blocking scheduler also ends by itself once ``sweeper.request_stop()`` is called (say,
    from a signal handler): its ``start()`` returns within one cadence, or after the batch
    in hand.
    """
    scheduler_class = _BlockingSweepScheduler if blocking else _BackgroundSweepScheduler
    scheduler = scheduler_class(
        # One thread per job (sweep, rebuild, handlers, webhook): none waits for another.
        timezone=UTC,
        executors={"default": ThreadPoolExecutor(max_workers=4)},
    )
    scheduler.sweeper = sweeper
    sweep = _PausingJob(
        JOB_ID,
        sweeper,
        lambda: _tick(sweeper),
        first_s=sweeper.cadence_s,
        on_stop=(lambda: _exit(scheduler)) if blocking else None,
    )
    rebuild = _PausingJob(
        RECONCILE_JOB_ID, sweeper, lambda: _reconcile(sweeper), first_s=RECONCILE_CHECK_S
    )
    scheduler.pausing_jobs = [sweep, rebuild]
    _add_job(scheduler, sweep, "orders sweep", next_run_time=datetime.now(UTC))
    _add_job(scheduler, rebuild, "orders index rebuild")
    service = sweeper.service
    if service.settings.retention_days is not None:
        pruning = _PausingJob(
            RETENTION_JOB_ID, sweeper, lambda: prune_step(sweeper), first_s=STANDBY_S
        )
        scheduler.pausing_jobs.append(pruning)
        _add_job(scheduler, pruning, "orders retention")
    consumers = closed_order_consumers(service)
    if consumers:
        handlers = _PausingJob(
            EVENTS_JOB_ID, sweeper, EventsJob(sweeper, consumers), first_s=EVENTS_INTERVAL_S
        )
        scheduler.pausing_jobs.append(handlers)
        _add_job(scheduler, handlers, "orders event handlers")
    webhook = webhook_consumer(service.engine, service.settings, clock=service.clock)
    if webhook is not None:
        # A job of its own: a slow receiver never delays the handlers above.
        posting = EventsJob(sweeper, [webhook], limit=WEBHOOK_BATCH)
        poster = _PausingJob(WEBHOOK_JOB_ID, sweeper, posting, first_s=EVENTS_INTERVAL_S)
        scheduler.pausing_jobs.append(poster)
        _add_job(scheduler, poster, "orders webhook")
    for job in scheduler.pausing_jobs:
        job.scheduler = scheduler
        scheduler.add_listener(job.rescheduled, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    scheduler.add_listener(_count_failure, EVENT_JOB_ERROR)
    for job in scheduler.get_jobs():
        # Each job's series starts at 0, so increase() sees its first failure too.
        metrics.JOB_FAILURES.labels(job.id)
    return scheduler


def _count_failure(event: JobExecutionEvent) -> None:
    """A job run ended in an exception (APScheduler logged it): count it by job id.

    Store outages are not these: the jobs catch StoreUnavailable, log it once and retry at
    their next run (``orders_store_errors_total`` counts them); what escapes is a bug or
    an unexpected error, each run of it counted.
    """
    metrics.JOB_FAILURES.labels(event.job_id).inc()


def _tick(sweeper: Sweeper) -> float:
    return sweeper.tick()  # looked up at each run: a test may wrap it


def _reconcile(sweeper: Sweeper) -> float:
    sweeper.reconcile_if_due()
    return RECONCILE_CHECK_S


def _add_job(scheduler: BaseScheduler, job: _PausingJob, name: str, **options: Any) -> None:
    """Every job runs one at a time, coalesced, and late runs are run, never dropped; the
    first run comes ``first_s`` after now, the others when each run's end sets them.

    ``options`` go to ``add_job`` as they are (``next_run_time``: None would pause the job,
    so it is passed only when given).
    """
    scheduler.add_job(
        job,
        job.trigger,
        id=job.job_id,
        name=name,
        max_instances=1,
        coalesce=True,
        misfire_grace_time=None,
        **options,
    )
