"""A health server on loopback watching a sweeper, as ``orders scheduler`` runs one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from orders.scheduler.health import HealthServer
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper


@contextmanager
def health_of(sweeper: Sweeper) -> Iterator[HealthServer]:
    """A HealthServer on an ephemeral loopback port attached to ``sweeper`` and to a
    scheduler built for it (not started); closed on the way out."""
    health = HealthServer("127.0.0.1", 0)
    health.attach(sweeper, build_scheduler(sweeper, blocking=False))
    try:
        yield health
    finally:
        health.close()
