"""The operator's actions over many orders at once: the incident pause, retention, and the
bulk cancel and extend.

:class:`~orders.service.OrderService` holds one as ``service.operations``; the CLI, the
dashboard and the scheduler's retention job use it, as may a host's admin tooling. Each
method checks its input, then hands the work to its rule (:mod:`orders.rules.pausing`,
:mod:`orders.rules.retention`, :mod:`orders.rules.bulk`); like the service, it owns no SQL
and no Redis command.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime

from orders.config import Settings
from orders.domain import Actor
from orders.rules.bulk import (
    DEFAULT_BATCH_SIZE,
    BulkActions,
    BulkReport,
    BulkRun,
    OnBatch,
    check_batch_size,
    checked_filter,
)
from orders.rules.pausing import Pausing
from orders.rules.retention import ArchiveHook, Pruner, PruneReport
from orders.sql.pauses import Pause
from orders.validation import TEXT_MAX_LENGTH, check_count, check_optional_text, check_ttl_ms


@dataclass(eq=False)
class Operations:
    """The actions over many orders (module docstring), over the service's parts."""

    pausing: Pausing
    pruner: Pruner
    bulk: BulkActions
    settings: Settings

    # --- the incident pause --------------------------------------------------------------

    def pause(self, reason: str, *, actor: str | Actor | None = None) -> Pause:
        """Open an incident pause: nothing closes (or is reminded) by expiry until
        :meth:`resume`; creates, payments and cancels go on (see :mod:`orders.rules.pausing`)."""
        return self.pausing.pause(reason, Actor.of(actor))

    def resume(self, *, actor: str | Actor | None = None, batch_size: int = 500) -> Pause:
        """End the pause: every unpaid order's expiry moves later by the part of the pause it
        lived through, with an ``extended`` event each; then the sweep runs again."""
        return self.pausing.resume(Actor.of(actor), batch_size)

    def current_pause(self) -> Pause | None:
        """The open pause (or the one being resumed), if any."""
        return self.pausing.current()

    def recent_pauses(self, limit: int = 10) -> list[Pause]:
        """The latest pauses, newest first."""
        return self.pausing.pauses.recent(check_count("limit", limit, 1, 1000))

    # --- retention ---------------------------------------------------------------------

    def prune(
        self,
        older_than_s: float,
        *,
        dry_run: bool = False,
        batch_size: int = 500,
        max_batches: int | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> PruneReport:
        """Delete paid, cancelled and closed orders whose last transition is older than
        ``older_than_s``, with their events, but none still needed (see
        :mod:`orders.rules.retention`); ``dry_run``: count them only."""
        return self.pruner.prune(older_than_s, dry_run, batch_size, max_batches, on_batch)

    def set_archive_hook(self, hook: ArchiveHook | None) -> None:
        """Hand each batch of pruned orders (with their events) to ``hook`` before it is
        deleted; a hook that raises stops the prune, that batch kept."""
        self.pruner.archive = hook

    # --- bulk actions --------------------------------------------------------------------

    def cancel_matching(
        self,
        *,
        user_id: str | int | None = None,
        created_before: datetime | None = None,
        expiring_before: datetime | None = None,
        metadata: Mapping[str, str] | None = None,
        reason: str | None = None,
        actor: str | Actor | None = None,
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
        on_batch: OnBatch | None = None,
    ) -> BulkReport:
        """Cancel every unpaid order the filter matches, each by ``cancel_order``'s
        compare-and-set: a payment that commits first wins (the order is skipped).

        The filter's parts, all of which must hold: ``user_id``; ``created_before`` and
        ``expiring_before`` (aware datetimes, exclusive); ``metadata`` (keys whose string
        values must be equal). At least one is required (InvalidInput otherwise, as for a
        ``batch_size`` outside 1..10,000), and everything is checked before anything is
        written. ``dry_run``: read the same pages and change nothing. ``on_batch(orders,
        report)`` after each page of at most ``batch_size``. See :mod:`orders.rules.bulk`.
        """
        run = self._bulk_run(
            user_id, created_before, expiring_before, metadata, actor, dry_run, batch_size, on_batch
        )
        return self.bulk.cancel(run, check_optional_text("reason", reason, TEXT_MAX_LENGTH))

    def extend_matching(
        self,
        extra_s: float,
        *,
        user_id: str | int | None = None,
        created_before: datetime | None = None,
        expiring_before: datetime | None = None,
        metadata: Mapping[str, str] | None = None,
        actor: str | Actor | None = None,
        dry_run: bool = False,
        batch_size: int = DEFAULT_BATCH_SIZE,
        on_batch: OnBatch | None = None,
    ) -> BulkReport:
        """Move the expiry of every open order the filter matches ``extra_s`` later, each by
        ``extend_order``'s compare-and-set and within its policy's maximum lifetime (an
        order it would take past it is refused, and counted). The filter and the rest as
        for :meth:`cancel_matching`."""
        run = self._bulk_run(
            user_id, created_before, expiring_before, metadata, actor, dry_run, batch_size, on_batch
        )
        return self.bulk.extend(
            run, check_ttl_ms(extra_s, self.settings.default_policy.longest_ttl_s)
        )

    def _bulk_run(
        self,
        user_id: str | int | None,
        created_before: datetime | None,
        expiring_before: datetime | None,
        metadata: Mapping[str, str] | None,
        actor: str | Actor | None,
        dry_run: bool,
        batch_size: int,
        on_batch: OnBatch | None,
    ) -> BulkRun:
        """A bulk action's input, checked."""
        wanted = checked_filter(
            self.settings,
            user_id=user_id,
            created_before=created_before,
            expiring_before=expiring_before,
            metadata=metadata,
        )
        return BulkRun(wanted, Actor.of(actor), dry_run, check_batch_size(batch_size), on_batch)
