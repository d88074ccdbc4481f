"""A scheduler's health probes watching a sweeper, as ``orders scheduler`` attaches them."""

from __future__ import annotations

from orders.scheduler.health import SchedulerHealth
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper


def health_of(sweeper: Sweeper) -> SchedulerHealth:
    """Probes attached to ``sweeper`` and to a scheduler built for it (not started)."""
    health = SchedulerHealth()
    health.attach(sweeper, build_scheduler(sweeper, blocking=False))
    return health
