"""Concurrent creates of one process share their Redis round trip and their SQL commit.

Leader and followers, no timer (:mod:`orders.rules.batching`): a create that finds nothing
in flight runs at once, alone, by the single path (:meth:`Admitter.create`); one that
arrives while a create or a batch is in flight waits, and goes in the next batch.

A batch does the shared work only, in the leader's thread:

1. The admissions, ``admit.lua`` for each member, in one round trip per Redis node
   (:mod:`orders.index.admit_batch`). Each script is atomic on its user's keys as alone;
   each reply decides its caller's fate as :meth:`Admitter.reserve` would. A round trip
   that failed without an answer abandons every member's attempt, as the single path
   abandons its one (:mod:`orders.rules.abandoning`); with abandons still to send, the
   members go alone (the single path sends them first).
2. The admitted orders' inserts with their ``created`` events, in one transaction and one
   commit (:mod:`orders.sql.slot_batch`): the same slot guard, but an order that finds no
   free slot or a taken id is skipped, never an error that aborts the others.

A caller that waited while Redis left a call unanswered takes the outage policy at once
rather than asking again: in a stall it waits no longer than a create alone, not twice.

Then each caller finishes in its own thread, while the next batch runs: an order inserted
is returned; every other goes on by the single path from Redis's answer
(:meth:`Admitter.complete`): the refusal, the retry, the order that found no slot (make
room, or SQL's refusal with the index repaired), a transaction that failed (its insert
alone finds a row the commit did write, as a twin's). So each caller gets its own result
or its own typed error, by the code a create alone runs in every case but the common one.

Not combined: a create in the host's transaction (it commits with the host), and one with
``on_limit="replace_oldest"`` (the service sends it alone: its second admission follows a
cancel of its own, :mod:`orders.rules.creating`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection

from orders.domain import NewOrder, Order
from orders.errors import StoreUnavailable
from orders.index.admissions import Admission, AdmitResult
from orders.index.admit_batch import admit_all
from orders.index.errors import ServerRefused
from orders.rules.admission import Admitter, interrupted
from orders.rules.batching import PATIENCE_S, BatchQueue, CombinerStats, Seat
from orders.sql.records import to_order
from orders.sql.slot_batch import SlotBatch

log = logging.getLogger(__name__)

#: The most creates one batch takes; the rest lead or join the next.
MAX_BATCH = 64


def combines_by_default(dialect: str) -> bool:
    """Whether creates are combined when ``Settings.combine_creates`` is None: on SQLite,
    whose writes take turns anyway; not on PostgreSQL, whose parallel commits served 8
    callers faster one by one (docs/bench.md, issue 45)."""
    return dialect == "sqlite"


@dataclass(slots=True, eq=False)
class Member:
    """One caller's create, and what its batch did for it: nothing (the single path from the
    start), Redis's answer (the rest is :meth:`Admitter.complete`'s), the row inserted in
    the shared commit, or its error decided (which goes before the rest)."""

    new: NewOrder
    entered: float = field(default_factory=time.monotonic)
    seat: Seat[Member] = field(default_factory=Seat)
    admitted: AdmitResult | None = None
    row: Mapping[str, Any] | None = None
    error: BaseException | None = None
    #: Cut off past its admission: make its member agree with its row before raising.
    unsettled: bool = False


class CreateCombiner:
    """Combines concurrent creates (module docstring)."""

    def __init__(
        self,
        admitter: Admitter,
        batch: SlotBatch,
        *,
        max_batch: int = MAX_BATCH,
        redis_socket_timeout_s: float = 0.5,
    ) -> None:
        self.admitter = admitter
        self.slot_batch = batch
        # A create in flight waits on Redis for two socket timeouts at most (one retry),
        # then fails, and the creates behind it take the outage policy at once: the
        # queue's patience starts after that, so that only a wait on SQL is gone past.
        patience_s = 2 * redis_socket_timeout_s + PATIENCE_S
        self.queue: BatchQueue[Member] = BatchQueue(
            lambda member: member.seat, max_batch, "create", patience_s
        )
        self.stats: CombinerStats = self.queue.stats

    @property
    def queued(self) -> int:
        """Creates waiting for the one in flight to end."""
        return self.queue.queued

    def create(self, new: NewOrder, host: Connection | None = None) -> tuple[Order, bool]:
        """:meth:`Admitter.create`, combined with concurrent ones; never with ``host`` (a
        create in the host's transaction commits with the host), nor from inside the call in
        flight (:meth:`BatchQueue.holds_lane`)."""
        if host is not None or self.queue.holds_lane():
            return self.admitter.create(new, host)
        if not self.queue.alone():  # a member is made only for a create that may wait
            member = Member(new)
            if not self.queue.enter(member):
                return self._wait(member)
        try:
            return self.admitter.create(new)
        finally:
            self.queue.hand_over()

    def _wait(self, member: Member) -> tuple[Order, bool]:
        """A queued create: its batch's outcome, or the single path after it."""
        stop = self.queue.wait(member)
        if member.seat.batch is not None:
            self._lead(member.seat.batch)
        if stop is not None:  # cut off while its batch ran: the order as SQL has it
            member.error, member.unsettled = stop, True
        return self._finish(member)

    def _lead(self, batch: list[Member]) -> None:
        try:
            self.queue.lead(batch, self._run)
        except BaseException as stop:  # an interrupt of the leader's thread (or a bug)
            # Its admission may stand, its row may or may not.
            batch[0].error, batch[0].unsettled = stop, True

    def _run(self, batch: list[Member]) -> None:
        if self.admitter.abandoner.unsent:
            return  # each goes alone: the single path sends the abandons first
        asking = [member for member in batch if not self._outage_seen(member)]
        if not asking:
            return
        try:
            results = admit_all(self.admitter.index, [self.admitter.request(m.new) for m in asking])
        except BaseException as stop:
            self._unanswered(asking, stop)
            if not isinstance(stop, StoreUnavailable):  # the leader's own interrupt (or a bug)
                batch[0].error = stop
            return
        admitted: list[Member] = []
        for member, result in zip(asking, results, strict=True):
            if isinstance(result, ServerRefused):  # Redis answered: nothing was written
                member.error = StoreUnavailable(result.store, result.detail)
                continue
            try:
                member.admitted = Admitter.not_abandoned(result)
            except StoreUnavailable as late:
                member.error = late
                continue
            if result.outcome is Admission.ADMITTED:
                admitted.append(member)
        if admitted:
            self._insert(admitted)

    def _unanswered(self, batch: list[Member], stop: BaseException) -> None:
        """The admissions' round trip failed without an answer: as the single path does
        for its one (``Admitter._reserve_or_abandon``), for each member."""
        if isinstance(stop, ServerRefused):  # nothing was written
            for member in batch:
                member.error = StoreUnavailable(stop.store, stop.detail)
            return
        cut_off = interrupted(stop)
        if not cut_off:
            self.admitter.unanswered_at = time.monotonic()
        if (
            not cut_off
            and isinstance(stop, StoreUnavailable)
            and self.admitter.create_without_redis
        ):
            log.warning("redis unavailable: admitting a batch through the SQL guard only")
            for member in batch:
                # As if a retry found its member: nothing of ours to compensate; SQL decides.
                member.admitted = AdmitResult(Admission.EXISTS, 0, member.new.expires_at_ms)
            return
        for member in batch:
            new = member.new
            self.admitter.abandoner.abandon(
                new.user_id, new.id, new.created_at_ms, send_now=cut_off
            )
        detail = stop.detail if isinstance(stop, StoreUnavailable) else "admit cut off"
        for member in batch:
            member.error = StoreUnavailable("redis", detail)

    def _outage_seen(self, member: Member) -> bool:
        """Redis left a call unanswered while the member waited: the outage policy, now."""
        if member.entered > self.admitter.unanswered_at:
            return False
        if self.admitter.create_without_redis:
            member.admitted = AdmitResult(Admission.EXISTS, 0, member.new.expires_at_ms)
        else:
            member.error = StoreUnavailable("redis", "no answer while this create waited")
        return True

    def _insert(self, admitted: list[Member]) -> None:
        """The shared transaction; a member it did not insert goes on alone from Redis's
        answer (a commit that went through after all is found by that insert)."""
        try:
            rows = self.slot_batch.insert_all([member.new for member in admitted])
        except Exception:
            log.warning("a combined insert failed; its creates go on one by one", exc_info=True)
            return
        for member in admitted:
            member.row = rows.get(member.new.id)

    def _finish(self, member: Member) -> tuple[Order, bool]:
        new = member.new
        if member.error is None and member.row is None and member.admitted is None:
            self._outage_seen(member)  # it was to go alone
        if member.error is not None:
            if member.unsettled:
                self.admitter.followups.settle(new.id, new.created_at_ms, user_id=new.user_id)
            raise member.error
        if member.row is not None:
            self.admitter.confirmations.committed(new.user_id, new.id)
            return to_order(member.row, new.created_at_ms), True
        if member.admitted is not None:
            return self.admitter.complete(new, member.admitted)
        return self.admitter.create(new)
