"""Closing expired orders: the sweep, and the pre-close check it asks first; then the
reminders due (a policy's ``remind_before_s``), each an ``expiring`` event written once.

A sweep closes due orders in batches ordered by expiry. Each batch is one SQL transaction
that closes its orders with a compare-and-set and records a ``closed`` event per order;
after each commit the affected users' Redis sets drop their expired members in one round
trip. A batch that fails leaves its orders unpaid for the next sweep, and several sweepers
may run at once: none closes an order twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from orders import metrics
from orders.config import Settings
from orders.domain import Actor, Clock, Order, SweepResult
from orders.errors import InvalidInput, StoreUnavailable
from orders.hooks import HookRunner
from orders.rules.admission import Admitter
from orders.sql.closing import DueCloser
from orders.sql.records import OrderRecords
from orders.validation import check_count, check_cutoff, check_ttl_ms

log = logging.getLogger("orders.service")

PreCloseCheck = Callable[[Order], float | None]


class Sweep:
    """Closes due orders; see :meth:`sweep_expired`."""

    def __init__(
        self, records: OrderRecords, admitter: Admitter, settings: Settings, clock: Clock
    ) -> None:
        self.records = records
        self.closer = DueCloser(records)
        self.admitter = admitter
        self.settings = settings
        self.clock = clock
        self.pre_close: PreCloseCheck | None = None
        self.hooks = HookRunner("orders-hook")
        #: Told the resources a batch's closes released, after the batch's Redis work
        #: (the waiting lists' serve: :mod:`orders.rules.waiting`); None: nobody is told.
        self.freed: Callable[[list[str]], object] | None = None
        #: Run once per sweep, after its closes (the waiting lists' recovery pass).
        self.after_sweep: Callable[[], object] | None = None

    def cutoff(self, now_ms: int | None) -> int:
        clock_now = self.clock()
        return clock_now if now_ms is None else check_cutoff(now_ms, clock_now)

    def sweep_expired(
        self,
        now_ms: int | None,
        batch_size: int | None,
        max_batches: int | None,
        should_stop: Callable[[], bool] | None,
        actor: Actor,
    ) -> SweepResult:
        """Close every unpaid order whose expiry is at or before ``now_ms`` (default: now),
        then (when reminders are on: ``Settings.reminds``) remind of those whose reminder
        is due by then.

        ``should_stop`` is asked before each batch; ``actor``: who the close events name.
        """
        cutoff = self.cutoff(now_ms)
        size = self.settings.sweep_batch_size if batch_size is None else batch_size
        check_count("batch_size", size, 1, 10_000)
        if max_batches is not None:
            check_count("max_batches", max_batches, 1)
        started = time.monotonic()
        result = _Tally(cutoff)
        while max_batches is None or result.batches < max_batches:
            if should_stop is not None and should_stop():
                break
            closed = self._close_batch(cutoff, size, result, actor)
            if closed < size:
                break
        if result.closed:
            metrics.SWEEP_SECONDS.observe(time.monotonic() - started)
        if self.after_sweep is not None:
            self.after_sweep()
        if self.settings.reminds:
            self._remind(cutoff, size, max_batches, should_stop, result, actor)
        return result.done()

    def _remind(
        self,
        cutoff: int,
        size: int,
        max_batches: int | None,
        should_stop: Callable[[], bool] | None,
        result: _Tally,
        actor: Actor,
    ) -> None:
        """Write the reminders due at ``cutoff``, in batches (at most ``max_batches``), after
        the closes: an order due for closing was closed above, and is not reminded."""
        batches = 0
        while max_batches is None or batches < max_batches:
            if should_stop is not None and should_stop():
                return
            if self.records.dialect == "sqlite" and not self.records.any_reminder_due(cutoff):
                return  # as for closes: the write lock only to write
            rows = self.closer.remind_due(cutoff, size, self.clock(), actor)
            batches += 1
            result.reminded += len(rows)
            metrics.REMINDERS.inc(len(rows))
            if len(rows) < size:
                return

    def _close_batch(self, cutoff: int, size: int, result: _Tally, actor: Actor) -> int:
        """Close one batch; how many orders it closed."""
        if self.records.dialect == "sqlite" and not self.records.any_due(cutoff):
            return 0  # SQLite's write lock is the whole database's: take it only to close
        if self.pre_close is not None:
            self._run_pre_close(self.pre_close, cutoff, size)
        closed_at_ms = self.clock()
        rows = self.closer.close_due(cutoff, size, closed_at_ms, actor)
        if not rows:
            return 0
        metrics.CLOSES.inc(len(rows))
        observe = metrics.CLOSE_LAG_SECONDS.observe
        for row in rows:
            observe((closed_at_ms - row[1]) / 1000)
        batch_users = {row[0] for row in rows}
        result.add(len(rows), batch_users, closed_at_ms - min(row[1] for row in rows))
        holding = self.admitter.holding
        # Counted from SQL's answer: the holds are released whatever Redis does next.
        swept = [] if holding is None else holding.released_by_sweep((r[2], r[3]) for r in rows)
        if result.redis_errors == 0:  # after one failure, spare later batches the timeouts
            try:
                self.admitter.index.drop_expired(batch_users, cutoff)
                if holding is not None:
                    holding.release_swept(swept)
            except StoreUnavailable:
                result.redis_errors += 1
                log.debug("sweep: redis cleanup failed; expired members go by score")
        if swept and self.freed is not None:  # serve the released units before the next batch
            self.freed(sorted({rid for _, ids in swept for rid in ids}))
        return len(rows)

    def _run_pre_close(self, check: PreCloseCheck, cutoff: int, size: int) -> None:
        """Ask the pre-close check about the next batch's orders not yet extended."""
        due = self.records.due_not_extended(cutoff, size)
        # One time budget for the whole batch: a stuck check costs the batch that budget
        # once, and then every order it was asked about simply closes.
        answers = self.hooks.ask(check, due, self.settings.pre_close_timeout_s)
        max_extension_ms = round(self.settings.max_extension_s * 1000)
        max_ttl_s = self.settings.default_policy.longest_ttl_s
        for answered in answers:
            order, answer = answered.question, answered.value
            if answered.failed:
                _log_order(order, "pre-close check failed or timed out; closing")
                continue
            if answer is None:
                continue
            try:
                extra_ms = min(check_ttl_ms(answer, max_ttl_s), max_extension_ms)
            except InvalidInput:
                _log_order(order, "pre-close check gave an invalid extension; closing")
                continue
            self._reopen(order, extra_ms)

    def _reopen(self, order: Order, extra_ms: int) -> None:
        now_ms = self.clock()
        expires_at_ms = now_ms + extra_ms
        max_lifetime_ms = round(self.settings.order_policy(order.policy).max_lifetime_s * 1000)
        if expires_at_ms - order.created_at_ms > max_lifetime_ms:
            return
        reopened = self.admitter.reopen(
            order,
            expires_at_ms=expires_at_ms,
            now_ms=now_ms,
            limit=self.settings.unpaid_limit,
            extra_ms=extra_ms,
        )
        if reopened:
            metrics.EXTENSIONS.labels("pre_close_check").inc()

    def close(self) -> None:
        self.hooks.close()


def _log_order(order: Order, message: str) -> None:
    log.warning(message, extra={"order_id": order.id, "user_id": order.user_id})


class _Tally:
    """What a sweep has done so far."""

    def __init__(self, cutoff_ms: int) -> None:
        self.cutoff_ms = cutoff_ms
        self.closed = self.batches = self.redis_errors = self.reminded = 0
        self.users: set[str] = set()
        self.max_lag_ms: int | None = None

    def add(self, closed: int, users: set[str], lag_ms: int) -> None:
        self.batches += 1
        self.closed += closed
        self.users |= users
        self.max_lag_ms = lag_ms if self.max_lag_ms is None else max(self.max_lag_ms, lag_ms)

    def done(self) -> SweepResult:
        return SweepResult(
            closed=self.closed,
            batches=self.batches,
            users=len(self.users),
            cutoff_ms=self.cutoff_ms,
            max_lag_ms=self.max_lag_ms,
            redis_errors=self.redis_errors,
            reminded=self.reminded,
        )
