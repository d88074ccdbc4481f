"""The shape every transition of one order shares: its compare-and-set, then Redis.

The compare-and-set (and its event) runs in one SQL transaction, ours or the host's; if
it won, the Redis follow-up runs after the commit: by default the order's member leaves
the index. In the host's transaction the follow-up waits for the host's commit (and does
not run if the host rolls back). A call cut off half-way (a cancelled task, an interrupt)
may have committed, so Redis is made to follow the row as it stands.

Combined transitions (``Settings.combine_transitions``, SQLite only): concurrent
transitions of one process (payments, cancels, extensions) share one write transaction and
its commit, so one fsync, in the queue of :mod:`orders.rules.batching` (a transition alone
never waits). Each attempt still runs its own compare-and-set in that transaction, one
after the other, so the rules are the single path's; then each caller, in its own thread,
makes Redis follow its own order. A batch whose transaction fails leaves each of its
transitions to run alone; one whose leader is cut off after the commit still hands each
member its outcome, so none runs twice (an extension run again would move the expiry
twice). Not combined: a transition in the host's transaction. On
PostgreSQL each transition is already one statement in autocommit, and the server shares
the WAL flushes of concurrent commits (``commit_delay``); a shared transaction there would
run its statements one after another and hold every order's row lock until its commit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy import Connection

from orders.config import Settings
from orders.domain import Actor, Order
from orders.errors import OrderNotFound
from orders.rules.admission import Admitter, interrupted
from orders.rules.batching import BatchQueue, Seat
from orders.sql.host import follow
from orders.sql.records import BatchCommit, OrderRecords, to_order
from orders.sql.transitions import Changed

log = logging.getLogger(__name__)

#: The most transitions one shared transaction takes.
MAX_BATCH = 64


def combines_on(dialect: str) -> bool:
    """Whether transitions are combined on this SQL engine (module docstring): SQLite."""
    return dialect == "sqlite"


#: One transition's SQL: the compare-and-sets to try in the transaction; the row after
#: the one that won, or None.
Attempt = Callable[[Connection], Changed | None]


@dataclass(slots=True, eq=False)
class Pending:
    """One caller's transition, and what its batch decided for it."""

    order_id: str
    now_ms: int
    attempt: Attempt
    seat: Seat[Pending] = field(default_factory=Seat)
    #: The row after its attempt (None: no such order) and whether it won, once decided.
    outcome: tuple[Changed | None, bool] | None = None
    #: Its batch's leader was cut off too close to the commit to tell whether it was
    #: made (not expected: see ``OrderRecords.transition_all``).
    unknown: bool = False


class Transitioner:
    """Runs one order's transitions over the records and the admission index;
    ``combine``: share concurrent transitions' commits (module docstring)."""

    def __init__(self, records: OrderRecords, admitter: Admitter, *, combine: bool = False) -> None:
        self.records = records
        self.admitter = admitter
        self.queue: BatchQueue[Pending] | None = (
            BatchQueue(lambda pending: pending.seat, MAX_BATCH, "transition") if combine else None
        )

    def run(
        self,
        order_id: str,
        now_ms: int,
        attempt: Attempt,
        *,
        redis_after: Callable[[Order], None] | None = None,
        host: Connection | None = None,
    ) -> tuple[Order, bool]:
        """The order after ``attempt`` and whether it won (when it lost: the order as it
        stands, for the caller to say what the loss means). Raises OrderNotFound."""
        try:
            order, won = self._decide(order_id, now_ms, attempt, host)
            if won:
                self.after_commit(order, host, redis_after or self.admitter.followups.release_of)
        except BaseException as stop:
            if interrupted(stop):  # it may have committed: Redis must follow the row
                self.admitter.followups.settle(order_id, now_ms)
            raise
        return order, won

    def _decide(
        self, order_id: str, now_ms: int, attempt: Attempt, host: Connection | None
    ) -> tuple[Order, bool]:
        """The compare-and-set, alone or in a shared transaction."""
        if self.queue is None or host is not None or self.queue.holds_lane():
            return self.records.transition_or_current(order_id, now_ms, attempt, host)
        pending = Pending(order_id, now_ms, attempt)
        if self.queue.enter(pending):
            try:
                return self.records.transition_or_current(order_id, now_ms, attempt)
            finally:
                self.queue.hand_over()
        stop = self.queue.wait(pending)
        if pending.seat.batch is not None:
            self.queue.lead(pending.seat.batch, self._run_batch)
        if stop is not None:  # cut off while its batch ran: settled by run()
            raise stop
        if pending.outcome is None:  # not decided by a batch: alone
            if pending.unknown:  # whatever it committed, Redis follows the row first
                self.admitter.followups.settle(order_id, now_ms)
            return self.records.transition_or_current(order_id, now_ms, attempt)
        current, won = pending.outcome
        if current is None:
            raise OrderNotFound(order_id)
        return to_order(current, now_ms), won

    def _run_batch(self, batch: list[Pending]) -> None:
        done = BatchCommit()
        try:
            self.records.transition_all([(p.order_id, p.attempt) for p in batch], done)
        except BaseException as stop:
            self._hand_out(batch, done)
            if not isinstance(stop, Exception):  # the leader was cut off
                raise
            if not done.committed:
                log.warning("a combined transition failed; its members go alone", exc_info=True)
            return
        self._hand_out(batch, done)

    @staticmethod
    def _hand_out(batch: list[Pending], done: BatchCommit) -> None:
        """Committed: each member's outcome stands (whatever the leader met after the
        commit). Not committed: nothing was done, each runs alone. Not known: each runs
        alone after making Redis follow its row."""
        if done.committed:
            for pending, outcome in zip(batch, done.outcomes, strict=True):
                pending.outcome = outcome
        elif done.committed is None:  # the leader too, when it goes on (an Exception)
            for pending in batch:
                pending.unknown = True

    @staticmethod
    def after_commit(order: Order, host: Connection | None, step: Callable[[Order], None]) -> None:
        """Run ``step(order)`` now (our transaction committed) or at the host's commit."""
        if host is None:
            step(order)
        else:
            follow(host, on_commit=functools.partial(step, order))


def extend_attempt(
    records: OrderRecords,
    settings: Settings,
    order_id: str,
    now_ms: int,
    extra_ms: int,
    actor: Actor,
) -> Attempt:
    """The compare-and-set of one extension (``extend_order``'s and the bulk extend's),
    within the maximum lifetime of the order's policy; it loses for a policy that does not
    expire."""

    def attempt(conn: Connection) -> Changed | None:
        # The order's policy never changes: reading it first cannot race.
        found = records.current(conn, order_id, now_ms)
        policy = settings.order_policy(None if found is None else found.policy)
        if not policy.expires:
            return None
        max_lifetime_ms = round(policy.max_lifetime_s * 1000)
        return records.extend_open(conn, order_id, now_ms, extra_ms, max_lifetime_ms, actor)

    return attempt
