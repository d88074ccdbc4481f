"""The ``orders scheduler`` process: sweep until SIGTERM or SIGINT, then stop cleanly.

It stops after the batch in hand and gives the lease up, so a standby takes over at once
rather than after ``lease_ttl_s``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import SUMMARY_PERIOD_S, Sweeper
from orders.service import OrderService

if TYPE_CHECKING:
    from orders.scheduler.health import SchedulerHealth


@contextlib.contextmanager
def on_stop_signals(stop: Callable[[], None]) -> Iterator[None]:
    """``stop()`` on SIGTERM or SIGINT while inside (from the main thread); the handlers
    found before are put back on the way out."""
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop())
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def run_scheduler(
    service: OrderService,
    *,
    interval_s: float | None = None,
    lease_ttl_s: float | None = None,
    batch_size: int | None = None,
    summary_period_s: float = SUMMARY_PERIOD_S,
    health: SchedulerHealth | None = None,
) -> None:
    """Sweep until SIGTERM or SIGINT, then finish the batch in hand, release the lease and
    return. Call it from the main thread (signal handlers are installed there).

    The handlers only set the sweeper's stop flag: the job notices it after its batch (or
    at its next run, within one cadence) and ends the scheduler from an ordinary thread,
    so no lock is ever taken inside a signal handler.

    The sweeper's ``summary`` line comes at most every ``summary_period_s``, and once more
    on the way out.

    ``health`` (a :class:`~orders.scheduler.health.SchedulerHealth`) reports on this
    scheduler while it runs.
    """
    sweeper = Sweeper(
        service,
        interval_s=interval_s,
        lease_ttl_s=lease_ttl_s,
        batch_size=batch_size,
        summary_period_s=summary_period_s,
    )
    scheduler = build_scheduler(sweeper, blocking=True)
    if health is not None:
        health.attach(sweeper, scheduler)
    with on_stop_signals(sweeper.request_stop):
        sweeper.log_event(
            logging.INFO,
            "scheduler_started",
            interval_s=sweeper.interval_s,
            lease_ttl_s=sweeper.lease_ttl_s,
            batch_size=sweeper.batch_size,
        )
        try:
            scheduler.start()
        finally:
            sweeper.close()
            sweeper.log_event(logging.INFO, "scheduler_stopped")
