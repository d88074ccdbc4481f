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

Then each caller finishes in its own thread, while the next batch runs: an order inserted
is returned; every other goes on by the single path from Redis's answer
(:meth:`Admitter.complete`): the refusal, the retry, the order that found no slot (make
room, or SQL's refusal with the index repaired), a transaction that failed (its insert
alone finds a row the commit did write, as a twin's). So each caller gets its own result
or its own typed error, by the code a create alone runs in every case but the common one.

Not combined (:class:`~orders.rules.replacing.Replacer` decides): a create in the host's
transaction (it commits with the host), and ``on_limit="replace_oldest"`` (its second
admission follows a cancel of its own).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection

from orders import tracing
from orders.domain import Actor, Order
from orders.errors import StoreUnavailable
from orders.index.admit_batch import admit_all
from orders.index.errors import ServerRefused
from orders.index.unpaid import Admission, AdmitRequest, AdmitResult
from orders.rules.admission import Admitter, interrupted
from orders.rules.batching import BatchQueue, CombinerStats, Seat
from orders.sql.records import to_order
from orders.sql.slot_batch import SlotBatch, SlotRequest

log = logging.getLogger(__name__)

#: The most creates one batch takes; the rest lead or join the next.
MAX_BATCH = 64


class Step(enum.Enum):
    """Where a member stands when its batch is over."""

    #: Inserted with its event in the shared commit.
    DONE = "done"
    #: Redis answered; the rest is the single path's (``Admitter.complete``).
    ANSWERED = "answered"
    #: Nothing shared was done for it: the single path from the start.
    ALONE = "alone"
    #: Its error is decided (``error``).
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Member:
    """One caller's create, and what its batch did for it."""

    values: Mapping[str, Any]
    amount: Decimal | None
    limit: int
    now_ms: int
    caller_id: bool
    actor: Actor
    event_data: dict[str, str] | None
    seat: Seat[Member] = field(default_factory=Seat)
    step: Step = Step.ALONE
    admitted: AdmitResult | None = None
    row: Mapping[str, Any] | None = None
    error: BaseException | None = None
    #: Cut off past its admission: make its member agree with its row before raising.
    unsettled: bool = False

    def request(self, admitter: Admitter) -> AdmitRequest:
        v = self.values
        return AdmitRequest(
            v["user_id"],
            v["id"],
            expires_at_ms=v["expires_at_ms"],
            now_ms=self.now_ms,
            limit=self.limit,
            rate=admitter.rate,
        )

    def fail(self, error: BaseException) -> None:
        self.step, self.error = Step.FAILED, error


class CreateCombiner:
    """Combines concurrent creates (module docstring)."""

    def __init__(self, admitter: Admitter, batch: SlotBatch, *, max_batch: int = MAX_BATCH) -> None:
        self.admitter = admitter
        self.slot_batch = batch
        self.queue: BatchQueue[Member] = BatchQueue(lambda member: member.seat, max_batch, "create")
        self.stats: CombinerStats = self.queue.stats

    @property
    def queued(self) -> int:
        """Creates waiting for the one in flight to end."""
        return self.queue.queued

    def create(
        self,
        values: Mapping[str, Any],
        *,
        amount: Decimal | None,
        limit: int,
        now_ms: int,
        caller_id: bool,
        actor: Actor,
        host: Connection | None = None,
    ) -> tuple[Order, bool]:
        """:meth:`Admitter.create`, combined with concurrent ones; never with ``host``: a
        create in the host's transaction commits with the host."""
        if host is not None:
            return self.admitter.create(
                values,
                amount=amount,
                limit=limit,
                now_ms=now_ms,
                caller_id=caller_id,
                actor=actor,
                host=host,
            )
        member = Member(values, amount, limit, now_ms, caller_id, actor, tracing.event_context())
        if self.queue.enter(member):
            try:
                return self._single(member)
            finally:
                self.queue.hand_over()
        stop = self.queue.wait(member)
        if member.seat.batch is not None:
            self._lead(member.seat.batch)
        if stop is not None:  # cut off while its batch ran: the order as SQL has it
            member.fail(stop)
            member.unsettled = True
        return self._finish(member)

    def _lead(self, batch: list[Member]) -> None:
        try:
            self.queue.lead(batch, self._run)
        except BaseException as stop:  # an interrupt of the leader's thread (or a bug)
            leader = batch[0]
            leader.fail(stop)
            leader.unsettled = True  # its admission may stand, its row may or may not

    def _run(self, batch: list[Member]) -> None:
        if self.admitter.abandoner.unsent:
            return  # each goes alone: the single path sends the abandons first
        try:
            results = admit_all(self.admitter.index, [m.request(self.admitter) for m in batch])
        except BaseException as stop:
            self._unanswered(batch, stop)
            return
        admitted: list[Member] = []
        for member, result in zip(batch, results, strict=True):
            if isinstance(result, ServerRefused):  # Redis answered: nothing was written
                member.fail(StoreUnavailable(result.store, result.detail))
                continue
            try:
                member.admitted = Admitter.not_abandoned(result)
            except StoreUnavailable as late:
                member.fail(late)
                continue
            member.step = Step.ANSWERED
            if result.outcome is Admission.ADMITTED:
                admitted.append(member)
        if admitted:
            self._insert(admitted)

    def _unanswered(self, batch: list[Member], stop: BaseException) -> None:
        """The admissions' round trip failed without an answer: as the single path does
        for its one (``Admitter._reserve_or_abandon``), for each member."""
        if isinstance(stop, ServerRefused):  # nothing was written
            for member in batch:
                member.fail(StoreUnavailable(stop.store, stop.detail))
            return
        cut_off = interrupted(stop)
        if (
            not cut_off
            and isinstance(stop, StoreUnavailable)
            and self.admitter.create_without_redis
        ):
            log.warning("redis unavailable: admitting a batch through the SQL guard only")
            for member in batch:
                # As if a retry found its member: nothing of ours to compensate; SQL decides.
                expires = member.values["expires_at_ms"]
                member.admitted = AdmitResult(Admission.EXISTS, 0, expires)
                member.step = Step.ANSWERED
            return
        for member in batch:
            v = member.values
            self.admitter.abandoner.abandon(v["user_id"], v["id"], member.now_ms, send_now=cut_off)
        detail = stop.detail if isinstance(stop, StoreUnavailable) else "admit cut off"
        for member in batch[1:]:
            member.fail(StoreUnavailable("redis", detail))
        batch[0].fail(stop)

    def _insert(self, admitted: list[Member]) -> None:
        """The shared transaction; a member it did not insert goes on alone from Redis's
        answer (a commit that went through after all is found by that insert)."""
        requests = [SlotRequest(m.values, m.limit, m.actor, m.event_data) for m in admitted]
        try:
            rows = self.slot_batch.insert_all(requests)
        except Exception:
            log.warning("a combined insert failed; its creates go on one by one", exc_info=True)
            return
        for member in admitted:
            row = rows.get(member.values["id"])
            if row is not None:
                member.step, member.row = Step.DONE, row

    def _finish(self, member: Member) -> tuple[Order, bool]:
        if member.step is Step.DONE and member.row is not None:
            return to_order(member.row, member.now_ms), True
        if member.step is Step.ANSWERED and member.admitted is not None:
            return self.admitter.complete(
                member.values,
                member.admitted,
                amount=member.amount,
                limit=member.limit,
                now_ms=member.now_ms,
                caller_id=member.caller_id,
                actor=member.actor,
            )
        if member.step is Step.FAILED and member.error is not None:
            if member.unsettled:
                v = member.values
                self.admitter.followups.settle(v["id"], member.now_ms, user_id=v["user_id"])
            raise member.error
        return self._single(member)

    def _single(self, member: Member) -> tuple[Order, bool]:
        return self.admitter.create(
            member.values,
            amount=member.amount,
            limit=member.limit,
            now_ms=member.now_ms,
            caller_id=member.caller_id,
            actor=member.actor,
        )
