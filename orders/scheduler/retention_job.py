"""The scheduler's retention job (``ORDERS_RETENTION_DAYS``): the active scheduler prunes.

A run deletes at most :data:`BATCHES_PER_RUN` batches, then hands the thread back: the
sweep and the creates never wait behind a long prune (each batch is a transaction of its
own, read along the terminal statuses' indexes). With more left, the next run comes
:data:`BUSY_S` later; with nothing left, after a tenth of the retention period, at most an
hour (:func:`idle_s`: a short retention is kept to within about a tenth of itself). Only
the scheduler holding the lease prunes (two would only step on each other's batches); a
store outage is logged and retried at the next run.
"""

from __future__ import annotations

import logging

from orders.errors import StoreUnavailable
from orders.scheduler.sweeper import Sweeper

RETENTION_JOB_ID = "orders-retention"
BATCHES_PER_RUN = 20
BUSY_S = 2.0
IDLE_S = 3600.0
#: The shortest wait after a run that found nothing left to prune.
MIN_IDLE_S = 10.0
#: A standby checks again this often whether it became the active scheduler.
STANDBY_S = 60.0


def idle_s(retention_days: float) -> float:
    """The wait after a run that left nothing to prune: a tenth of the retention period,
    between :data:`MIN_IDLE_S` and :data:`IDLE_S` (a 90-day retention checks hourly, a
    five-minute one every 30 s)."""
    return min(IDLE_S, max(MIN_IDLE_S, retention_days * 86_400 / 10))


def prune_step(sweeper: Sweeper) -> float:
    """One run of the job; the seconds until the next."""
    service = sweeper.service
    days = service.settings.retention_days
    if days is None:
        return IDLE_S
    if sweeper.stopping or not sweeper.holds_lease:
        return STANDBY_S
    try:
        done = service.operations.prune(days * 86_400, max_batches=BATCHES_PER_RUN)
    except StoreUnavailable as exc:
        sweeper.log_event(logging.WARNING, "prune_failed", detail=str(exc))
        return STANDBY_S
    if done.orders:
        sweeper.log_event(
            logging.INFO, "pruned", orders=done.orders, events=done.events, more=done.more
        )
    return BUSY_S if done.more else idle_s(days)
