"""Retention: prune paid, cancelled and closed orders past an age (``orders prune``).

The rule of what may go is SQL's (:mod:`orders.sql.retention`): terminal, older than the
cutoff, no refund owed, no event retrying or parked, every consumer still reading past its
events. A consumer behind (its first unread event older than the cutoff) is logged at
WARNING by each prune: one still reading holds those orders, one whose cursor has not moved
for the retention period is passed (they go unread by it). Orders
go in batches, each with its events, in a transaction of its own; an archive hook
(:meth:`Pruner.archive`), when set, receives each batch's rows before they are deleted, and
a hook that raises stops the prune with that batch kept. A crash between the hook and the
delete hands the batch to the hook again next time: archive idempotently (by order id).
Nothing here touches Redis: a terminal order has no member.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orders.domain import Clock
from orders.errors import InvalidInput
from orders.sql.retention import Retention
from orders.validation import check_count

log = logging.getLogger("orders.retention")

#: Receives one batch's orders (each a dict of its columns, with its ``events``).
ArchiveHook = Callable[[list[dict[str, Any]]], None]


@dataclass(frozen=True, slots=True)
class PruneReport:
    """What a prune deleted (or, with ``dry_run``, would delete)."""

    orders: int
    events: int
    batches: int
    cutoff_ms: int
    dry_run: bool
    #: More was left when ``max_batches`` stopped it.
    more: bool = False
    #: Consumers still reading whose unread events hold orders older than the cutoff.
    held_by: tuple[str, ...] = ()
    #: Consumers stopped for the retention period: their unread events that old went.
    passed_by: tuple[str, ...] = ()


class Pruner:
    """Prunes over the service's records (composed by :class:`OrderService`)."""

    def __init__(self, retention: Retention, clock: Clock) -> None:
        self.retention = retention
        self.clock = clock
        self.archive: ArchiveHook | None = None

    def prune(
        self,
        older_than_s: float,
        dry_run: bool,
        batch_size: int,
        max_batches: int | None,
        on_batch: Callable[[int], None] | None,
    ) -> PruneReport:
        """Delete what may go of the orders whose last transition is ``older_than_s`` ago."""
        if isinstance(older_than_s, bool) or not isinstance(older_than_s, int | float):
            raise InvalidInput("older_than", "must be a number of seconds")
        if not older_than_s > 0:
            raise InvalidInput("older_than", "must be above 0")
        size = check_count("batch_size", batch_size, 1, 10_000)
        if max_batches is not None:
            check_count("max_batches", max_batches, 1)
        cutoff_ms = self.clock() - round(older_than_s * 1000)
        held_by, passed_by = self._behind(cutoff_ms)
        orders = events = batches = 0
        archive = None if dry_run else self.archive  # read once: a hook set meanwhile waits
        found = self.retention.batches(
            cutoff_ms, size, dry_run=dry_run, with_rows=archive is not None
        )
        for batch, rows in found:
            if max_batches is not None and batches >= max_batches:
                more = True
                break
            if archive is not None:
                archive(rows)
            orders += len(batch.orders)
            events += batch.events
            batches += 1
            if on_batch is not None:
                on_batch(orders)
        else:
            more = False
        return PruneReport(
            orders, events, batches, cutoff_ms, dry_run, more, tuple(held_by), tuple(passed_by)
        )

    def _behind(self, cutoff_ms: int) -> tuple[list[str], list[str]]:
        held_by, passed_by = self.retention.behind(cutoff_ms)
        for name in held_by:
            log.warning(
                "retention: consumer %s is behind; the orders of its unread events older than "
                "the cutoff are kept while it reads (until its cursor stands still for the "
                "retention period)",
                name,
            )
        for name in passed_by:
            log.warning(
                "retention: consumer %s has not moved for the retention period; its unread "
                "events older than the cutoff are pruned without it",
                name,
            )
        return held_by, passed_by
