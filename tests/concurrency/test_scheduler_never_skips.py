"""APScheduler's "skipped: maximum number of running instances reached" never happens.

APScheduler counts a job's run from its submission until the run's function has returned
and its future's callback has run; a job that is due again while counted is skipped with
that warning. The worker thread of a run can stall anywhere (a GC pause, a process stopped
with SIGSTOP, a starved thread): here it stalls inside APScheduler's own ``modify_job`` (a
blocking listener of the job's EVENT_JOB_MODIFIED, dispatched on the thread that modifies
the job), right after the run set its next run time. Each stall lasts until APScheduler
has either submitted the job again or skipped it; after many runs, no skip. And a run that
ends before APScheduler has finished submitting it (common for a short run on a new
thread) keeps its job going.
"""

from __future__ import annotations

import logging
import threading
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

#: The rebuild job's check interval in this test (1 s in production): short, so many runs.
CHECK_S = 0.02
STALLS = 25
SKIP_WARNING = "maximum number of running instances"


class StallAfterRescheduling:
    """The EVENT_JOB_MODIFIED listener that stalls the rebuild's worker thread once the run
    has set its next run time, until the job is submitted again or skipped."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.stalls = 0
        self.skips = 0
        self.submitted = threading.Event()
        self.done = threading.Event()

    def __call__(self, event: JobEvent) -> None:
        if event.job_id != RECONCILE_JOB_ID:
            return
        if event.code == EVENT_JOB_SUBMITTED:
            self.submitted.set()
        elif event.code == EVENT_JOB_MAX_INSTANCES:
            self.skips += 1
            self.submitted.set()
        elif self.stalls < STALLS and not self.done.is_set():
            job = self.scheduler.get_job(RECONCILE_JOB_ID)
            if job is not None and job.next_run_time is not None:
                self.submitted.clear()
                self.stalls += 1
                # Long enough for several due times of the job; set long before that.
                assert self.submitted.wait(10), "the job was neither run again nor skipped"
                if self.stalls == STALLS:
                    self.done.set()


@pytest.mark.timeout(120)
def test_the_rebuild_job_is_never_skipped_even_when_its_thread_stalls_after_rescheduling(
    service: OrderService,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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
        assert stall.done.wait(60), f"only {stall.stalls} stalls in 60 s"
    finally:
        stall.done.set()
        stall.submitted.set()
        scheduler.shutdown(wait=True)
        sweeper.close()

    assert stall.skips == 0
    assert [r.getMessage() for r in caplog.records if SKIP_WARNING in r.getMessage()] == []


@pytest.mark.timeout(120)
def test_runs_that_end_before_apscheduler_has_finished_submitting_them_keep_their_job_going(
    service: OrderService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run can end before APScheduler has finished submitting it (the future is done when
    its callback is added: the callback then runs on the scheduler's own thread, inside its
    job processing). The next run that run asked for must stand."""
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
        scheduler.shutdown(wait=True)
        sweeper.close()
