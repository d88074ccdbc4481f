"""What one sweeper tells the outside about itself: gauges, its heartbeat, its health.

A :class:`~orders.scheduler.sweeper.Sweeper` reports here what it learns in each tick (the lease
taken or lost, a sweep run to its end, the oldest overdue order, a sign of life), and
:class:`SweeperStatus` keeps the few facts the health endpoint and the dashboard read, sets
the Prometheus gauges, and publishes the scheduler's beat (:mod:`orders.index.heartbeat`). A
failed publish is logged once, and once again when it works, never failing the tick: the
heartbeat is for people, the lease is what decides.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from orders import metrics
from orders.domain import Clock
from orders.errors import StoreUnavailable
from orders.index.heartbeat import Heartbeats, SchedulerBeat
from orders.service import OrderService

#: A beat is forgotten after this many lease TTLs without another one.
FORGET_AFTER_LEASE_TTLS = 3


class SweeperStatus:
    """The last successful sweep, the lease's expiry and the last sign of life of one sweeper.

    ``log(level, event, **fields)`` writes the sweeper's log lines. The health server reads
    while the scheduler's threads write: each fact is one attribute, replaced whole.
    """

    def __init__(
        self, service: OrderService, owner: str, lease_ttl_ms: int, *, log: Callable[..., None]
    ) -> None:
        index = service.index
        self.heartbeats = Heartbeats(index.client, key_prefix=index.key_prefix)
        self.owner = owner
        self.clock: Clock = service.clock
        self.lease_ttl_ms = lease_ttl_ms
        self.forget_after_ms = FORGET_AFTER_LEASE_TTLS * lease_ttl_ms
        self._log: Callable[..., Any] = log
        self._last_sweep_ms: int | None = None
        self._lease_expires_ms: int | None = None
        self._alive_at = time.monotonic()
        self._beat_failing = False

    @property
    def last_sweep_ms(self) -> int | None:
        """Service-clock ms of the last sweep that ran to its end (None: none yet)."""
        return self._last_sweep_ms

    @property
    def lease_expires_ms(self) -> int | None:
        """When the lease lapses unless renewed (None while this sweeper does not hold it)."""
        return self._lease_expires_ms

    def silent_s(self) -> float:
        """Seconds since the last sign of life: the start of a tick or of a sweep's batch."""
        return time.monotonic() - self._alive_at

    def alive(self) -> None:
        self._alive_at = time.monotonic()

    def lease_seen(self, held: bool, asked_at_ms: int) -> None:
        """Redis answered the lease call sent at ``asked_at_ms``: held or not.

        A sweeper that is no longer active stops judging the backlog: its backlog gauges go
        to 0, so an alert on the largest value across processes follows the active one.
        """
        was_held = self._lease_expires_ms is not None
        self._lease_expires_ms = asked_at_ms + self.lease_ttl_ms if held else None
        metrics.SCHEDULER_ACTIVE.set(1 if held else 0)
        if was_held and not held:
            metrics.BACKLOG.set(0)
            metrics.OLDEST_OVERDUE_SECONDS.set(0)

    def swept(self, earliest_ms: int | None, now_ms: int, *, whole: bool) -> None:
        """A sweep ended without a store error; ``whole``: it was not cut short.

        ``earliest_ms`` is the earliest unpaid expiry left after it (the sweeper reads it
        anyway for its next delay), so the oldest overdue order costs no query of its own.
        """
        overdue_ms = 0 if earliest_ms is None else max(0, now_ms - earliest_ms)
        metrics.OLDEST_OVERDUE_SECONDS.set(overdue_ms / 1000)
        if whole:
            self._last_sweep_ms = now_ms
            metrics.LAST_SWEEP_TIMESTAMP.set(now_ms / 1000)

    def beat(self, active: bool) -> None:
        """Publish this scheduler's beat; a failure is logged once, never raised."""
        beat = SchedulerBeat(
            owner=self.owner,
            active=active,
            last_sweep_ms=self._last_sweep_ms,
            lease_expires_ms=self._lease_expires_ms if active else None,
            seen_ms=self.clock(),
        )
        try:
            self.heartbeats.publish(beat, forget_after_ms=self.forget_after_ms)
        except StoreUnavailable as exc:
            if not self._beat_failing:
                self._beat_failing = True
                self._log(logging.WARNING, "heartbeat_failed", detail=str(exc))
            return
        if self._beat_failing:
            self._beat_failing = False
            self._log(logging.INFO, "heartbeat_back")

    def stopped(self) -> None:
        """The sweeper stopped and let its lease go: say so now, not after the forget window."""
        self._lease_expires_ms = None
        metrics.SCHEDULER_ACTIVE.set(0)
        # If Redis is down, the beat is forgotten after forget_after_ms anyway.
        with contextlib.suppress(StoreUnavailable):
            self.heartbeats.remove(self.owner)
