"""The admission path: Redis admit -> SQL guard -> compensation, with one Redis-outage policy.

Every way an order comes to count against its user's limit goes through here: a create,
and the pre-close check's extension of an expired order (which no longer held a slot).

1. The Redis script (``admit.lua``) drops expired members, counts, and refuses at the limit
   (or at the create rate, ``Settings.create_rate``, asked first) or adds the member,
   atomically: a refusal costs one round trip and no SQL (unless it names members whose
   create started a few seconds ago unconfirmed: SQL is asked about those, and a slot
   freed by a create that died is taken, :meth:`Abandoner.clear_dead`; a create that
   committed is confirmed off its caller's thread, :mod:`orders.rules.confirming`, so
   only the creates that died or whose process did are asked about). The rate counts
   creates, not open orders, so only a create is counted: a retry that finds its member is
   not, nor is the pre-close check's reopen. It lives in Redis alone: a Redis that lost its
   data has forgotten the creates it counted.
2. SQL inserts the order and its event into a free slot of the user (``orders.sql.slots``):
   a unique index, not a count, so Redis may have lost members and the limit still holds.
3. If SQL refuses or fails, the member this call added is removed again (compensation).
   A refusal by SQL after Redis admitted means Redis had lost the user's members: they are
   written back from SQL's holders, so the next create is refused by Redis alone.

When the Redis step itself fails without an answer (a timeout, a broken connection, an
interrupt), the script may have run, or may still be queued in a stalled server: the
attempt is abandoned (:mod:`orders.rules.abandoning`).

The outage policy, once: when Redis cannot be reached, admission fails with
:class:`StoreUnavailable`, unless ``create_without_redis`` is set, in which case the SQL
guard alone decides (it stays exact) and reconcile adds the member later.

Redis writes that follow a SQL decision live in :mod:`orders.rules.followups`: they never
undo it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from sqlalchemy import Connection

from orders.config.values import CreateRate
from orders.domain import PRE_CLOSE_CHECK, NewOrder, Order
from orders.errors import (
    CreateRateLimited,
    OrdersError,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from orders.index.admissions import Admission, AdmitRequest, AdmitResult
from orders.index.errors import ServerRefused
from orders.index.unpaid import UnpaidIndex
from orders.rules.abandoning import Abandoner
from orders.rules.confirming import Confirmations
from orders.rules.followups import Followups
from orders.rules.holding import Holding
from orders.sql.host import follow
from orders.sql.records import InsertConflict, LimitReachedInSql, OrderRecords

log = logging.getLogger(__name__)


def interrupted(stop: BaseException) -> bool:
    """A call cut off half-way (its task cancelled, an interrupt), not a failure it reported:
    whatever it had sent may or may not have taken effect."""
    return not isinstance(stop, Exception)


def retry_after_s(earliest_ms: int | None, now_ms: int) -> float:
    """Seconds until the earliest open order frees its slot (0 if none is known)."""
    if earliest_ms is None:
        return 0.0
    return max(0, earliest_ms - now_ms) / 1000


class Admitter:
    """Admits orders against a user's limit in Redis and in SQL (see the module docstring)."""

    def __init__(
        self,
        index: UnpaidIndex,
        records: OrderRecords,
        *,
        create_without_redis: bool,
        rate: CreateRate | None = None,
        holding: Holding | None = None,
    ) -> None:
        self.index = index
        self.records = records
        self.create_without_redis = create_without_redis
        #: The create rate (``Settings.create_rate``), counted by creates only.
        self.rate = rate
        self.abandoner = Abandoner(index, records)
        #: Committed creates' admission entries, dropped off this thread
        #: (:mod:`orders.rules.confirming`): a later refusal names them no more.
        self.confirmations = Confirmations(index)
        #: The Redis writes after a commit (also the transitions' and extensions').
        self.followups = Followups(index, records, holding)
        #: The resources' index (:mod:`orders.rules.holding`), asked before the user's.
        self.holding = holding
        #: When (``time.monotonic``) Redis last left an admission unanswered: a create
        #: combined behind it does not ask again (:mod:`orders.rules.combining`).
        self.unanswered_at = -math.inf

    def reserve(self, request: AdmitRequest) -> AdmitResult:
        """The Redis step, under the one outage policy; ``request.rate``: count it as a
        create.

        Once Redis answers, the abandons it did not take before go; when one removed a
        member of this user, an answer other than "admitted" is asked again (the member
        refused or found may have been the one removed).
        """
        try:
            admitted = self.index.admit(request)
            freed = bool(self.abandoner.unsent) and self.abandoner.send(request.user_id)
            if freed and admitted.outcome is not Admission.ADMITTED:
                admitted = self.index.admit(request)
            return admitted
        except StoreUnavailable as failed:
            if not isinstance(failed, ServerRefused):
                self.unanswered_at = time.monotonic()
            if not self.create_without_redis:
                raise
            log.warning(
                "redis unavailable: admitting through the SQL guard only",
                extra={"order_id": request.order_id, "user_id": request.user_id},
            )
            # As if a retry found its member: nothing of ours to compensate; SQL decides.
            return AdmitResult(Admission.EXISTS, 0, request.expires_at_ms)

    def _reserve_or_abandon(self, request: AdmitRequest) -> AdmitResult:
        try:
            admitted = self.reserve(request)
        except ServerRefused as refused:  # Redis answered: nothing was written
            raise StoreUnavailable(refused.store, refused.detail) from refused.__cause__
        except BaseException as stop:
            # Cut off, timed out, or the connection broke: the script may have run with its
            # reply unread, or may still be waiting in a stalled server, to run later.
            if interrupted(stop) or isinstance(stop, StoreUnavailable):
                # After a timeout Redis is likely still stalled: the abandon waits for an
                # admission Redis answers rather than doubling this caller's wait.
                self.abandoner.abandon(
                    request.user_id,
                    request.order_id,
                    request.now_ms,
                    send_now=interrupted(stop),
                )
            raise
        return self.not_abandoned(admitted)

    @staticmethod
    def not_abandoned(admitted: AdmitResult) -> AdmitResult:
        """The script's answer, unless it was "abandoned" (StoreUnavailable)."""
        if admitted.outcome is Admission.ABANDONED:
            # An attempt at this order that started later (by its host's clock) was given
            # up: a new attempt starts after it.
            raise StoreUnavailable("redis", "admit refused: a later attempt was abandoned")
        return admitted

    def request(self, new: NewOrder) -> AdmitRequest:
        """The Redis step a create asks: counted against the create rate."""
        return AdmitRequest(
            new.user_id,
            new.id,
            expires_at_ms=new.expires_at_ms,
            now_ms=new.created_at_ms,
            limit=new.limit,
            rate=self.rate,
        )

    def create(self, new: NewOrder, host: Connection | None = None) -> tuple[Order, bool]:
        """Admit and insert the order; also says whether this call did.

        ``host``: insert in the host's transaction; the member this call added leaves
        again if that transaction (or the savepoint the insert ran in) rolls back, and
        stays when it commits.
        """
        if not new.holds or self.holding is None:
            return self.complete(new, self._reserve_or_abandon(self.request(new)), host)
        holding = self.holding
        unknown = holding.reserve(new)  # HoldRefused: nothing written anywhere
        try:
            order, created = self.complete(new, self._reserve_or_abandon(self.request(new)), host)
        except BaseException:
            holding.release(new)  # if it committed after all (cut off): too few taken, safe
            raise
        finally:
            # Refused by SQL too: else every later refusal of a sold-out resource would ask
            # SQL until reconcile.
            if unknown:
                holding.rebuild_quietly(unknown, new.created_at_ms)
        if not created and not order.is_open:  # a retry of an order paid or closed since
            holding.release(new)
        else:
            holding.held(order)
            if host is not None and created:
                follow(host, on_rollback=lambda: holding.release(new))
        return order, created

    def complete(
        self, new: NewOrder, admitted: AdmitResult, host: Connection | None = None
    ) -> tuple[Order, bool]:
        """:meth:`create` from Redis's answer on: the refusal, or the SQL step (also where a
        combined create whose order the shared transaction did not insert goes on)."""
        now_ms = new.created_at_ms
        if admitted.suspects and self.abandoner.clear_dead(new.user_id, admitted.suspects):
            admitted = self._reserve_or_abandon(self.request(new))  # it freed a slot
        if admitted.outcome in (Admission.REFUSED, Admission.RATE_LIMITED):
            # The caller's own id: the refusal may be a retry of an order no longer open.
            earlier = self.records.find(new.id, now_ms, host) if new.caller_id else None
            if earlier is not None:
                return new.retry_of(earlier), False
            raise self._refusal(new.user_id, admitted, new.limit, now_ms)
        if admitted.outcome is Admission.EXISTS:
            # A retry (or a concurrent twin) of a create whose Redis step already ran:
            # finish it with the expiry that Redis holds.
            new = replace(new, expires_at_ms=admitted.score_ms)
        ours = admitted.outcome is Admission.ADMITTED
        try:
            order, created = self._insert(new, ours, host)
        except BaseException as stop:
            if interrupted(stop):  # anywhere past the script: SQL may or may not have it
                self.followups.settle(new.id, now_ms, user_id=new.user_id)
            raise
        if host is None and created:
            self.confirmations.committed(new.user_id, new.id)
        elif host is not None and ours and created:
            # The compensation, should the host's transaction not keep the row.
            follow(
                host,
                on_rollback=lambda: self.followups.release_after_commit(
                    new.user_id, new.id, forget_admission=True
                ),
            )
        return order, created

    def _refusal(self, user_id: str, refused: AdmitResult, limit: int, now_ms: int) -> OrdersError:
        """The error for the script's refusal: the limit's, or the create rate's."""
        if refused.outcome is Admission.REFUSED or self.rate is None:
            wait_s = retry_after_s(refused.score_ms or None, now_ms)
            applied = limit if refused.limit is None else refused.limit
            return UnpaidOrderLimitReached(user_id, applied, refused.open_count, wait_s)
        count, window_ms = self.rate
        wait_s = retry_after_s(refused.score_ms + window_ms, now_ms)
        return CreateRateLimited(user_id, count, window_ms / 1000, wait_s)

    def _insert(self, new: NewOrder, ours: bool, host: Connection | None) -> tuple[Order, bool]:
        """The SQL step of :meth:`create`; ``ours``: this call added the Redis member."""
        try:
            return self.records.insert_guarded(new, host), True
        except LimitReachedInSql as refused:
            if ours:
                self._compensate(new, host)
            self._restore(new, refused, host)
            wait_s = retry_after_s(refused.earliest_ms, new.created_at_ms)
            raise UnpaidOrderLimitReached(
                new.user_id, refused.limit, refused.open_count, wait_s, source="sql"
            ) from None
        except InsertConflict:
            # The id exists in SQL: a concurrent twin of this create won the insert, an
            # earlier create with this id has since been paid or closed, or another user
            # owns the id.
            earlier = (
                self._compensate(new, host)
                if ours
                else self.records.find(new.id, new.created_at_ms, host)
            )
            if earlier is None:
                raise StoreUnavailable("sql", "insert refused by a constraint") from None
            return new.retry_of(earlier), False
        except OrdersError:
            if ours:
                self._compensate(new, host)
            raise

    def reopen(
        self, order: Order, *, expires_at_ms: int, now_ms: int, limit: int, extra_ms: int
    ) -> bool:
        """Give an expired, unclosed order a new expiry, if its user has room for it.

        The expired order no longer counts in Redis, so this is an admission like a
        create's: a refusal (or Redis down, under the outage policy) leaves the order to be
        closed. In SQL it still holds its slot, which no create can take while it is unpaid.
        """
        try:
            admitted = self.reserve(
                AdmitRequest(
                    order.user_id, order.id, expires_at_ms=expires_at_ms, now_ms=now_ms, limit=limit
                )
            )
        except StoreUnavailable:
            return False
        if admitted.outcome not in (Admission.ADMITTED, Admission.EXISTS):
            return False
        # The order still holds its SQL slot (it is unpaid): only Redis needed the check.
        # One statement with its event (autocommit on PostgreSQL): a process frozen here
        # holds no lock on the order.
        with self.records.tx.statements() as conn:
            row = self.records.reopen_expired(
                conn, order.id, expires_at_ms, now_ms, extra_ms, PRE_CLOSE_CHECK
            )
            conn.commit()
        if row is None and admitted.outcome is Admission.ADMITTED:
            self.followups.release_after_commit(order.user_id, order.id)
        return row is not None

    def _compensate(self, new: NewOrder, host: Connection | None) -> Order | None:
        """Undo our admission after the insert failed, unless the member indexes a real order.

        A concurrent twin of this create (same id, same user) may have committed the row
        (or, with ``host``, an earlier create in the host's transaction written it); its
        member must stay. Returns the row found, if any.
        """
        user_id, order_id = new.user_id, new.id
        try:
            existing = self.records.find(order_id, new.created_at_ms, host)
        except OrdersError:
            existing = None
        if not (existing is not None and existing.user_id == user_id and existing.is_open):
            self.followups.release_after_commit(user_id, order_id, forget_admission=True)
        return existing

    def _restore(self, new: NewOrder, refused: LimitReachedInSql, host: Connection | None) -> None:
        """Write SQL's view of the user back into the index (Redis had lost it): its own
        limit first, then its live orders.

        Through the admission script, soonest expiry first: the index never holds more than
        the limit's members, also while other creates of the user are in flight. A holder
        paid, cancelled or closed since SQL listed it may have had its member removed
        before the write-back put it back, so each is read again after the write and loses
        its member unless still open (one that leaves later removes its own, after its
        commit).
        """
        user_id, now_ms, limit = new.user_id, new.created_at_ms, new.limit
        try:
            self.index.limits.write({user_id: refused.own_limit})
            for order_id, expires_at_ms in sorted(refused.holders.items(), key=lambda h: h[1]):
                admitted = self.index.admit(
                    AdmitRequest(
                        user_id, order_id, expires_at_ms=expires_at_ms, now_ms=now_ms, limit=limit
                    )
                )
                if admitted.outcome is Admission.REFUSED:
                    break
            for order_id in refused.holders:
                order = self.records.find(order_id, now_ms, host)
                if order is None or not order.is_open:
                    self.followups.release_after_commit(user_id, order_id)
        except StoreUnavailable:
            log.warning("redis repair failed; reconcile will fix it", extra={"user_id": user_id})
