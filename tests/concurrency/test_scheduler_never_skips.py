"""The races of a job that sets its own next run in APScheduler 3 (orders/scheduler/jobs.py).

APScheduler counts a run from its submission until the run's thread has returned and the
future's callback has run; a job due again meanwhile is skipped ("maximum number of running
instances reached"). As it submits a run it sets the job's next run from the trigger, under
the job-store lock that ``modify_job`` waits for; ``shutdown(wait=True)`` holds that lock
while it joins the worker threads. Each test below turns one of these into a failure of a
next run set at the wrong moment or on the wrong thread.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import (  # type: ignore[import-untyped]
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MODIFIED,
    EVENT_JOB_SUBMITTED,
    JobEvent,
)

from orders.scheduler import jobs
from orders.scheduler.jobs import RECONCILE_JOB_ID, build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from tests.support.processes import child_env, run_python

#: The rebuild job's check interval in this test (1 s in production): short, so many runs.
CHECK_S = 0.02
STALLS = 25
SKIP_WARNING = "maximum number of running instances"


class StallAfterRescheduling:
    """The EVENT_JOB_MODIFIED listener (called on the thread that set the rebuild job's next
    run) that stalls that thread until the job is submitted again or skipped."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.stalls = self.skips = 0
        self.submitted, self.done = threading.Event(), threading.Event()

    def __call__(self, event: JobEvent) -> None:
        if event.job_id != RECONCILE_JOB_ID:
            return
        if event.code in (EVENT_JOB_SUBMITTED, EVENT_JOB_MAX_INSTANCES):
            self.skips += event.code == EVENT_JOB_MAX_INSTANCES
            self.submitted.set()
        elif self.stalls < STALLS and not self.done.is_set():
            self.submitted.clear()
            self.stalls += 1
            # Long enough for several due times of the job; set long before that.
            assert self.submitted.wait(10), "the job was neither run again nor skipped"
            if self.stalls == STALLS:
                self.done.set()


@pytest.mark.timeout(120)
def test_the_rebuild_job_is_never_skipped_even_when_its_thread_stalls_after_rescheduling(
    service: OrderService, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread can stall anywhere (a GC pause, a starved thread): here right after it set
    the job's next run. If that is the run's own thread, still counted, the job is skipped."""
    monkeypatch.setattr(jobs, "RECONCILE_CHECK_S", CHECK_S)
    sweeper = Sweeper(service, interval_s=0.01)  # wakes the scheduler every 10 ms or so
    scheduler = build_scheduler(sweeper, blocking=False)
    stall = StallAfterRescheduling(scheduler)
    scheduler.add_listener(
        stall, EVENT_JOB_MODIFIED | EVENT_JOB_SUBMITTED | EVENT_JOB_MAX_INSTANCES
    )
    caplog.set_level(logging.WARNING)
    scheduler.start()
    try:
        assert stall.done.wait(60), f"{stall.stalls} stalls, {stall.skips} skips in 60 s"
    finally:
        stall.done.set()
        stall.submitted.set()
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()

    assert stall.skips == 0
    assert [r.getMessage() for r in caplog.records if SKIP_WARNING in r.getMessage()] == []


@pytest.mark.timeout(120)
def test_runs_that_end_before_apscheduler_has_finished_submitting_them_keep_their_job_going(
    service: OrderService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run can end before APScheduler has finished submitting it (the future is done when
    its callback is added: the callback runs on the scheduler's own thread, before the job's
    next run is set from the trigger, an hour ahead). The next run that run asked for must
    stand."""
    monkeypatch.setattr(jobs, "RECONCILE_CHECK_S", 0.0001)
    sweeper = Sweeper(service, interval_s=0.0005)
    runs = threading.Semaphore(0)
    original = sweeper.reconcile_if_due

    def counted() -> None:
        original()
        runs.release()

    monkeypatch.setattr(sweeper, "reconcile_if_due", counted)
    scheduler = build_scheduler(sweeper, blocking=False)
    scheduler.start()
    try:
        for run in range(2000):
            assert runs.acquire(timeout=10), f"the rebuild job stopped after {run} runs"
    finally:
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()


#: A scheduler whose first tick ends while ``shutdown(wait=True)`` joins its worker threads.
SHUTDOWN_DURING_A_RUN = """
import threading, time
from orders.bootstrap import build_service
from orders.config import Settings
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper

sweeper = Sweeper(build_service(Settings.from_env()))
real_tick, ticking = sweeper.tick, threading.Event()

def tick():
    ticking.set()
    while scheduler.running:
        time.sleep(0.001)
    time.sleep(0.2)  # meanwhile shutdown takes the job-store lock and joins this thread
    return real_tick()

sweeper.tick = tick
scheduler = build_scheduler(sweeper, blocking=False)
scheduler.start()
ticking.wait()
scheduler.shutdown(wait=True)
sweeper.close()
print("stopped")
"""


def test_a_run_ending_while_shutdown_joins_the_workers_lets_the_shutdown_end(
    service: OrderService, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Run in a child: a deadlock would leave threads that no test can end."""
    env = child_env(
        ORDERS_HOME=str(tmp_path / "home"),
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_url,
    )
    done = run_python("-c", SHUTDOWN_DURING_A_RUN, env=env, timeout_s=30)
    assert (done.returncode, done.stdout) == (0, "stopped\n"), done.stderr


@pytest.mark.timeout(120)
def test_a_blocking_scheduler_stopped_by_a_run_that_ends_during_its_submission_returns_cleanly(
    service: OrderService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's end shuts a blocking scheduler down once the sweeper stops. A run that ends
    before its submission is done calls back on the scheduler's own thread, inside
    ``_process_jobs``: a shutdown there empties the job store under it, and ``start()``
    raised JobLookupError (a scheduler process exiting 1 on SIGTERM)."""
    monkeypatch.setattr(jobs, "RECONCILE_CHECK_S", 0.0001)
    for attempt in range(20):
        sweeper = Sweeper(service, interval_s=0.0005)
        scheduler = build_scheduler(sweeper, blocking=True)
        ran, raised = threading.Semaphore(0), []
        original = sweeper.reconcile_if_due

        def counted(original: Any = original, ran: threading.Semaphore = ran) -> None:
            original()
            ran.release()

        monkeypatch.setattr(sweeper, "reconcile_if_due", counted)

        def start(scheduler: Any = scheduler, raised: list[BaseException] = raised) -> None:
            try:
                scheduler.start()
            except BaseException as error:
                raised.append(error)

        thread = threading.Thread(target=start)
        thread.start()
        for _ in range(20):
            assert ran.acquire(timeout=10), "the rebuild job stopped"
        sweeper.request_stop()
        thread.join(10)
        sweeper.close()
        assert not thread.is_alive(), f"attempt {attempt}: start() did not return"
        assert raised == [], f"attempt {attempt}"
