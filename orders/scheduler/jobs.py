"""The sweeper in APScheduler 3: its jobs and the scheduler that runs them, ``build_scheduler``.

:func:`build_scheduler` runs a :class:`~orders.scheduler.sweeper.Sweeper`'s ticks in a job
whose next run comes when the last tick asked for it, so an order closes within milliseconds
of its expiry instead of up to an interval later. Beside it run the index rebuild
(reconcile), the retention job (with ``retention_days``), the events job when there are
event handlers (``on_closed``, ``on_payment_refused``: :func:`closed_order_consumers`) and
the webhook job with ``webhook_url`` (:func:`orders.events.webhooks.webhook_consumer`); each
run of any of them says when its next run is wanted. Only the lease holder does any of that
work. Logging goes to the sweeper's logger (:data:`orders.scheduler.sweeper.LOGGER_NAME`);
a job run that ends in an exception is counted in ``orders_job_failures_total``.

How a run sets the next one, with APScheduler's public API only: every job's trigger is an
interval of :data:`FALLBACK_S`, so a job is not due again while a run is under way, and a
listener of the run's end sets the next run to what the run returned, once APScheduler no
longer counts the run as running (a job due while counted is skipped). The listener acts on
a thread of its own: APScheduler holds its job-store lock from submitting a run until it set
the next run from the trigger (a run ending that soon calls back inside, where a change is
overwritten or a shutdown empties the store under the loop), and while ``shutdown(wait=True)``
joins the workers. tests/concurrency/test_scheduler_never_skips.py turns each race into a
failure.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

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

from orders import metrics
from orders.events.webhooks import webhook_consumer
from orders.scheduler.event_jobs import EVENTS_INTERVAL_S, EventsJob, closed_order_consumers
from orders.scheduler.retention_job import IDLE_S, RETENTION_JOB_ID, STANDBY_S, prune_step
from orders.scheduler.sweeper import Sweeper

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
#: Every job's trigger: the longest wait any run asks for (the retention job's, idle). A
#: run's end sets the next run, sooner; a run lasting longer is warned about by APScheduler.
FALLBACK_S = IDLE_S

#: A job: id, name, seconds until its first run, and the run (it returns the seconds until
#: the next one).
_Job = tuple[str, str, float, Callable[[], float]]


def build_scheduler(sweeper: Sweeper, *, blocking: bool) -> BaseScheduler:
    """An APScheduler 3 scheduler (UTC) running ``sweeper``'s jobs as they ask.

    Each job runs one at a time, coalesced, a late run run and never dropped
    (``misfire_grace_time=None``); the sweep at once, the others a first interval later,
    and each again when its last run asked. No run is ever skipped with a warning,
    however long a run or its thread takes up to :data:`FALLBACK_S`.

    Once ``sweeper.request_stop()`` is called (say, from a signal handler) no job is set
    to run again, and a blocking scheduler shuts itself down at the end of the next run
    (within one cadence, or after the batch in hand): its ``start()`` returns to its caller.
    Call ``sweeper.request_stop()`` before ``shutdown(wait=True)`` for a sweep to stop after
    the batch in hand rather than at its end. Neither releases the lease: call
    ``sweeper.close()``.
    """
    scheduler_class = BlockingScheduler if blocking else BackgroundScheduler
    # One thread per job (sweep, rebuild, retention, handlers, webhook): none waits for another.
    scheduler = scheduler_class(timezone=UTC, executors={"default": ThreadPoolExecutor(5)})
    now, ours = datetime.now(UTC), _jobs(sweeper)
    for job_id, name, first_s, run in ours:
        scheduler.add_job(
            run,
            "interval",
            seconds=FALLBACK_S,
            id=job_id,
            name=name,
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
            next_run_time=now + timedelta(seconds=first_s),
        )
        metrics.JOB_FAILURES.labels(job_id)  # its series from 0: increase() sees a first failure

    def ended(event: JobExecutionEvent) -> None:
        """A run ended (EVENT_JOB_EXECUTED or EVENT_JOB_ERROR, APScheduler logged the
        exception): count a failure, and set the job's next run, or end a blocking scheduler
        once the sweeper stops."""
        if event.exception is not None:
            metrics.JOB_FAILURES.labels(event.job_id).inc()
        if sweeper.stopping:
            if blocking:
                _on_own_thread(_stop, scheduler)
            return
        if event.job_id not in {job[0] for job in ours}:
            return  # a job of the host's own keeps its trigger
        delay_s = sweeper.cadence_s if event.exception is not None else event.retval
        at = datetime.now(UTC) + timedelta(seconds=delay_s)
        _on_own_thread(_reschedule, scheduler, event.job_id, at)

    scheduler.add_listener(ended, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR)
    return scheduler


def _on_own_thread(action: Callable[..., None], *args: object) -> None:
    """``action(*args)`` on a thread of its own, after the job-store lock the calling
    listener may be inside of (see the module docstring)."""
    threading.Thread(target=action, args=args, name="orders-reschedule").start()


def _stop(scheduler: BaseScheduler) -> None:
    # Not inside _process_jobs: a shutdown there empties the job store under its loop.
    with contextlib.suppress(SchedulerNotRunningError):
        scheduler.shutdown(wait=False)


def _reschedule(scheduler: BaseScheduler, job_id: str, at: datetime) -> None:
    with contextlib.suppress(JobLookupError):  # a job removed meanwhile stays removed
        scheduler.modify_job(job_id, next_run_time=at)


def _jobs(sweeper: Sweeper) -> list[_Job]:
    """The jobs of ``sweeper``'s service. A store outage is not a failed run (not counted):
    the runs catch StoreUnavailable, log it once and retry at their next run."""
    service = sweeper.service
    jobs: list[_Job] = [
        (JOB_ID, "orders sweep", 0.0, sweeper.tick),
        (RECONCILE_JOB_ID, "orders index rebuild", RECONCILE_CHECK_S, lambda: _reconcile(sweeper)),
    ]
    if service.settings.retention_days is not None:
        prune = (RETENTION_JOB_ID, "orders retention", STANDBY_S, lambda: prune_step(sweeper))
        jobs.append(prune)
    consumers = closed_order_consumers(service)
    if consumers:
        handlers = EventsJob(sweeper, consumers)
        jobs.append((EVENTS_JOB_ID, "orders event handlers", EVENTS_INTERVAL_S, handlers))
    webhook = webhook_consumer(service.engine, service.settings, clock=service.clock)
    if webhook is not None:
        # A job of its own: a slow receiver never delays the handlers above.
        posting = EventsJob(sweeper, [webhook], limit=WEBHOOK_BATCH)
        jobs.append((WEBHOOK_JOB_ID, "orders webhook", EVENTS_INTERVAL_S, posting))
    return jobs


def _reconcile(sweeper: Sweeper) -> float:
    sweeper.reconcile_if_due()
    return RECONCILE_CHECK_S
