"""OrderService: the use cases, one method each, over composed parts.

SQL is the record and decides every order's fate; Redis is the admission index in front of
it. The service owns no SQL and no Redis command itself: it composes the parts of the layers
below it (docs/architecture.md), each method one use case over them.

Rules that shape every method: input is checked first (:mod:`orders.validation`); the
clock is read once per use case and passed down; one SQL transaction per use case (the
host's own, when a create, payment or cancel is given ``connection=``: see
:mod:`orders.sql.host`); Redis writes that follow a SQL change run after the commit (in
the host's transaction, at its commit event); only :class:`~orders.errors.OrdersError`
leaves. The operator's actions over many orders (the incident pause, retention, the bulk
cancel and extend) are :class:`~orders.operations.Operations`, at ``service.operations``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import Any

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from orders import metrics, tracing
from orders.config import Settings
from orders.domain import (
    Actor,
    ActorKind,
    Clock,
    Order,
    OrderIdGenerator,
    OrderStatus,
    SweepResult,
    refusal,
    system_clock,
)
from orders.errors import OrderNotFound
from orders.events.stream import EventPosition, OrderEvent, read_events
from orders.index.nodes import RedisClient
from orders.index.resources import ResourceIndex
from orders.index.unpaid import UnpaidIndex
from orders.inventory import Resource, WaitingEntry
from orders.operations import Operations
from orders.requests import CreateRequest, checked_payment
from orders.rules.admission import Admitter
from orders.rules.bulk import BulkActions
from orders.rules.combining import CreateCombiner, combines_by_default
from orders.rules.creating import Creating
from orders.rules.erasure import Eraser, Erasure
from orders.rules.extending import Extender
from orders.rules.holding import Holding
from orders.rules.pausing import Pausing
from orders.rules.payments import LatePaymentCheck, Payments
from orders.rules.reconcile import DEFAULT_CHUNK_SIZE, Reconciler, ReconcileReport
from orders.rules.resources import Capacities
from orders.rules.retention import Pruner
from orders.rules.serving import ServingThreads
from orders.rules.sweep import PreCloseCheck, Sweep
from orders.rules.transition import Transitioner, combines_on
from orders.rules.user_limits import UserLimits
from orders.rules.waiting import WaitingList
from orders.sql.host import host_connection
from orders.sql.pauses import Pauses
from orders.sql.records import OrderRecords
from orders.sql.refusals import PaymentRefusal, list_refusals, mark_handled
from orders.sql.resources import ResourceRecords
from orders.sql.retention import Retention
from orders.sql.slot_batch import SlotBatch
from orders.sql.user_limits import LimitChange, UserLimit
from orders.sql.waiting import WaitingRecords
from orders.validation import (
    ON_LIMIT_REFUSE,
    TEXT_MAX_LENGTH,
    check_optional_text,
    check_order_id,
    check_user_id,
)

log = logging.getLogger(__name__)

#: What a host passes as ``connection=``: its transaction's Connection, or its Session.
HostConnection = Connection | Session


class OrderService:
    """The order-expiry service over a SQLAlchemy engine and a redis-py client.

    A host application builds it from the engine and client it already has::

        service = OrderService(engine, redis.Redis.from_url(url), Settings(unpaid_limit=3))

    or with a ``redis.cluster.RedisCluster`` for a Redis Cluster.

    The schema must exist (``orders db upgrade`` or ``alembic upgrade head``).
    ``clock`` returns integer milliseconds; tests pass one they control, and may pass their
    own ``index`` or ``records`` (built on the same client and engine) to observe or pace
    the steps in between.
    """

    def __init__(
        self,
        engine: Engine,
        redis_client: RedisClient,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
        index: UnpaidIndex | None = None,
        records: OrderRecords | None = None,
    ) -> None:
        self.settings = s = settings or Settings()
        self.engine = engine
        self.clock: Clock = clock or system_clock
        self.index = index or UnpaidIndex(
            redis_client, key_prefix=s.key_prefix, window_ms=s.admission_window_ms
        )
        self.records = records or OrderRecords(engine)
        #: The counted resources' index in Redis and its SQL (issue 43).
        self.resource_index = ResourceIndex(redis_client, s.key_prefix)
        self.holding = Holding(
            self.resource_index,
            ResourceRecords(self.records.tx),
            create_without_redis=s.create_without_redis,
        )
        self.admitter = Admitter(
            self.index,
            self.records,
            create_without_redis=s.create_without_redis,
            rate=s.create_rate_limit,
            holding=self.holding,
        )
        # The parts read the time through now_ms, so a clock swapped later reaches them too.
        combine = s.combine_transitions and combines_on(engine.dialect.name)
        self.transitions = Transitioner(self.records, self.admitter, combine=combine)
        self.payments = Payments(self.transitions, s)
        self.sweep = Sweep(self.records, self.admitter, s, self.now_ms)
        #: Combines concurrent creates (``Settings.combine_creates``), or None.
        self.combiner = (
            CreateCombiner(
                self.admitter,
                SlotBatch(self.records.tx),
                redis_socket_timeout_s=s.redis_socket_timeout_s,
            )
            if s.combine_creates
            or (s.combine_creates is None and combines_by_default(engine.dialect.name))
            else None
        )
        self.creating = Creating(self.transitions, self.sweep, self.combiner)
        self.reconciler = Reconciler(
            self.records,
            self.index,
            self.now_ms,
            max_user_id_length=s.max_user_id_length,
            holding=self.holding,
        )
        self.user_limits = UserLimits(self.records.tx, self.index, s, self.now_ms)
        #: Counted resources; ``capacities.after_capacity`` writes the Redis index's copy.
        self.capacities = Capacities(
            self.holding.records,
            self.now_ms,
            after_capacity=lambda r: self.resource_index.set_capacity(r.id, r.capacity),
        )
        self.extender = Extender(self.transitions, s)
        self.pruner = Pruner(Retention(self.records.tx), self.now_ms)
        self.pausing = Pausing(Pauses(self.records.tx), self.admitter.followups, self.now_ms)
        bulk = BulkActions(self.transitions, s, self.now_ms)
        self.eraser = Eraser(self.records, bulk, self.index, s, self.now_ms)
        #: The operator's actions over many orders: the pause, retention, bulk actions.
        self.operations = Operations(self.pausing, self.pruner, bulk, s)
        self.new_order_id = OrderIdGenerator(self.now_ms)
        #: Waiting lists, served where units come free: a cancel or close, a sweep batch
        #: (and its recovery pass), a capacity raised (:mod:`orders.rules.waiting`).
        self.waiting_list = WaitingList(
            WaitingRecords(self.records.tx),
            self.holding.records,
            lambda user, oid, holds, meta, who: self.create_unpaid_order(
                user, order_id=oid, holds=holds, metadata=meta, actor=who, on_limit=ON_LIMIT_REFUSE
            ),
            self.now_ms,
            s.max_user_id_length,
        )
        #: The sweep's share of serving, off its thread (:mod:`orders.rules.serving`): a
        #: cancel serves in its own call.
        self.serving = ServingThreads(self.waiting_list.after_release)
        self.admitter.followups.freed = self.waiting_list.after_release
        self.sweep.freed = lambda ids: self.serving.submit(self.waiting_list.queued_quietly(ids))
        self.sweep.after_sweep = lambda: self.serving.submit(
            self.waiting_list.recovery_due_quietly()
        )
        self.closed_handlers: list[Callable[[OrderEvent], None]] = []
        self.refused_payment_handlers: list[Callable[[OrderEvent], None]] = []

    def now_ms(self) -> int:
        """The service's clock, read once per use case."""
        return self.clock()

    def close(self) -> None:
        """Release the stores' connections and the hook threads; the service is done."""
        self.serving.close()
        self.sweep.close()
        self.payments.close()
        self.admitter.confirmations.close()
        self.engine.dispose()
        self.index.client.close()

    # --- admission ---------------------------------------------------------------------

    def create_unpaid_order(
        self,
        user_id: str | int,
        *,
        order_id: str | None = None,
        ttl_s: float | None = None,
        limit: int | None = None,
        amount: Decimal | int | str | None = None,
        currency: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        actor: str | Actor | None = None,
        connection: HostConnection | None = None,
        on_limit: str | None = None,
        policy: str | None = None,
        expires_at: datetime | None = None,
        holds: Mapping[str, int | Sequence[str]] | None = None,
    ) -> Order:
        """Admit a new unpaid order for ``user_id`` unless the user is at the limit.

        Costs one Redis round trip plus one SQL transaction; a refusal costs the Redis round
        trip only (plus one read by primary key when the caller supplied ``order_id``, to
        recognise a retry of an order that is no longer open). Retrying with the same
        ``order_id`` returns the same order; the same id with another user, amount or
        currency raises :class:`OrderConflict`.

        ``connection``: the host's SQLAlchemy ``Connection`` or ``Session``, on this
        service's database. The order, its slot and its ``created`` event are then written
        in the host's transaction (begun by the host, or autobegun here) and this call
        neither commits nor rolls it back. The Redis admission is made first, as without
        it, so the limit is still decided in one round trip; it is taken back when the
        host's transaction (or the savepoint the create ran in) rolls back, and stays when
        it commits. :class:`InvalidInput` for a closed connection, an engine, another
        database, before anything is written.

        ``on_limit`` (default ``Settings.on_limit``): at the limit, ``"refuse"`` raises
        :class:`UnpaidOrderLimitReached`; ``"replace_oldest"`` cancels the user's oldest
        unpaid order (reason ``replaced``) and admits this one instead, unless that order
        was paid first or the pre-close check says its payment is in flight (then the
        create is refused as usual; see :mod:`orders.rules.creating`). Not with
        ``connection``: the cancel needs a transaction of its own, so the create is refused.

        ``policy``: the name of one of ``Settings.policies`` (:mod:`orders.policies`): its
        time to pay, reminder, late-payment window and maximum lifetime, or no expiry. The
        order keeps the name. ``expires_at``: an absolute deadline instead of ``ttl_s``
        (an aware datetime, ahead of now, capped at the maximum lifetime).

        ``holds``: units of counted resources the order keeps from other buyers (resource
        id -> units, see :meth:`set_capacity`), taken with the order or not at all:
        :class:`HoldRefused` names the first resource short and why, and nothing is
        written. Paid, they are sold; cancelled, replaced, closed or erased, released in
        the same transaction. Not combined with concurrent creates.
        """
        host = self._host(connection)
        with tracing.span("orders.create_unpaid_order") as traced:
            asked = CreateRequest.checked(
                self.settings,
                user_id,
                order_id=order_id,
                ttl_s=ttl_s,
                limit=limit,
                amount=amount,
                currency=currency,
                metadata=metadata,
                actor=actor,
                on_limit=on_limit,
                policy=policy,
                expires_at=expires_at,
                holds=holds,
            )
            traced.set(user_id=asked.user_id)
            now_ms = self.clock()
            oid = asked.order_id or self.new_order_id(now_ms)
            new = asked.new_order(oid, now_ms, tracing.event_context())
            order, created = self.creating.create(new, asked.on_limit, host)
            traced.set(order_id=order.id, outcome="admitted" if created else "retry")
            return order

    # --- per-user limits ---------------------------------------------------------------

    def set_user_limit(
        self, user_id: str | int, limit: int, *, actor: str | Actor | None = None
    ) -> UserLimit:
        """Give the user a limit of its own (0 to 1,000,000; 0: no unpaid order at all),
        in place of the settings' one and of a create's ``limit=``: SQL first, then its Redis
        copy (:mod:`orders.rules.user_limits`). Orders already held stay; a lowered limit refuses
        creates until the user is under it again.
        """
        return self.user_limits.set(user_id, limit, actor)

    def clear_user_limit(
        self, user_id: str | int, *, actor: str | Actor | None = None
    ) -> UserLimit:
        """Remove the user's own limit: the settings' one applies again (idempotent)."""
        return self.user_limits.clear(user_id, actor)

    def erase_user(self, user_id: str | int, *, actor: str | Actor | None = None) -> Erasure:
        """Erase the user: unpaid orders cancelled (a payment that commits first wins), the
        user id replaced by a pseudonym keyed by ``Settings.erasure_key`` in orders, events
        and refusals, metadata and payment references cleared, the own limit and the Redis
        keys deleted, one ``erased`` event. Idempotent. :class:`RefundOwed` while a refund of
        the user's is owed, :class:`UnknownUser` for a user never seen. A create racing it
        may land after it: stop taking orders for the user first (:mod:`orders.rules.erasure`)."""
        return self.eraser.erase(user_id, actor)

    def user_limit(self, user_id: str | int) -> UserLimit:
        """The limit that applies to the user, whether it is its own, and when and by whom
        it was set."""
        return self.user_limits.read(user_id)

    def user_limit_history(self, user_id: str | int, *, limit: int = 100) -> list[LimitChange]:
        """Who set or cleared the user's own limit, and when: its latest ``limit`` changes,
        newest first (kept until the user's erasure)."""
        return self.user_limits.history(user_id, limit)

    # --- counted resources -----------------------------------------------------------

    def set_capacity(
        self,
        resource_id: str,
        capacity: int,
        *,
        per_user: int | None = None,
        actor: str | Actor | None = None,
    ) -> Resource:
        """Create the counted resource ``resource_id`` (``sku:42``, ``coupon:SPRING``; checked
        like a user id) or change its ``capacity`` (0 to 10^12) and ``per_user`` cap (None,
        or 1 to the capacity): SQL first, then the Redis index's copy
        (:mod:`orders.rules.resources`). Returns it as stored, with what is held and sold.
        A capacity lowered below what is held and sold takes nothing back; new holds are
        refused until enough is released. :class:`InvalidInput` before anything is written.
        Units it frees serve the resource's waiting list at once (:meth:`wait_for`).
        """
        return self._serve_freed(self.capacities.set(resource_id, capacity, per_user, actor))

    def set_units(
        self, resource_id: str, units: Sequence[str], *, actor: str | Actor | None = None
    ) -> Resource:
        """Give the resource ``resource_id`` named units (seats, numbered spaces; up to
        100,000, in the order a create picks them: the lowest free first) and make its
        capacity their count; created if new. Units may be added and removed later, but a
        unit held or sold cannot be removed (:class:`InvalidInput`, nothing written). Units
        added serve the resource's waiting list at once (:meth:`wait_for`)."""
        return self._serve_freed(self.capacities.set_units(resource_id, units, actor))

    def _serve_freed(self, resource: Resource) -> Resource:
        """After a capacity or unit change: its free units serve the waiting list; the
        resource as it is then."""
        if resource.free and self.waiting_list.after_release([resource.id]):
            return self.capacities.read(resource.id)  # what the served entries now hold
        return resource

    def units(self, resource_id: str) -> dict[str, list[str]]:
        """The named units of the resource by state: ``free``, ``held``, ``sold``."""
        return self.capacities.units(resource_id)

    def resource(self, resource_id: str) -> Resource:
        """The resource's capacity, units held and sold, ``free`` and ``per_user``, as SQL
        has them; :class:`UnknownResource` when there is no resource of that id."""
        return self.capacities.read(resource_id)

    def resources(self, *, after: str | None = None, limit: int = 100) -> list[Resource]:
        """Up to ``limit`` resources (1 to 10,000) by id, after the id ``after`` (the last
        of the previous page)."""
        return self.capacities.page(after, limit)

    # --- waiting lists ---------------------------------------------------------------------

    def wait_for(
        self,
        user_id: str | int,
        resource_id: str,
        quantity: int = 1,
        *,
        until: datetime | None = None,
        actor: str | Actor | None = None,
    ) -> WaitingEntry:
        """Queue the user for ``quantity`` units of the resource, until ``until`` (an aware
        datetime ahead of now; None: no end); the user's entry already waiting there is
        returned instead of a second. Served first come, first served the moment units
        come free, by an unpaid order made for the user through the normal create path
        (its limit and caps; order id ``waiting-<entry id>``, its ``created`` event's
        actor ``waiting_list``): see :mod:`orders.rules.waiting`. Units free now serve the
        queue at once, so the entry returned may be ``served`` already. Bad input is
        :class:`InvalidInput` (``quantity`` below 1 or above the capacity or per-user cap,
        ``until`` naive or past), an unknown resource :class:`UnknownResource`; nothing
        is written then."""
        return self.waiting_list.wait_for(user_id, resource_id, quantity, until, actor)

    def waiting(self, resource_id: str) -> list[WaitingEntry]:
        """The entries waiting for the resource, first come first."""
        return self.waiting_list.waiting(resource_id)

    def waiting_entry(self, entry_id: int) -> WaitingEntry:
        """One entry, in the queue or out of it; :class:`WaitingEntryNotFound` for none."""
        return self.waiting_list.get(entry_id)

    def leave_waiting(self, entry_id: int) -> WaitingEntry:
        """Take the entry out of its queue (status ``left``); one already out of it (served,
        expired, left) is returned as it is. :class:`WaitingEntryNotFound` for none."""
        return self.waiting_list.leave(entry_id)

    # --- transitions ---------------------------------------------------------------------

    def mark_paid(
        self,
        order_id: str,
        *,
        payment_ref: str | None = None,
        amount: Decimal | int | str | None = None,
        currency: str | None = None,
        actor: str | Actor | None = None,
        connection: HostConnection | None = None,
    ) -> Order:
        """Mark an unpaid order paid. Idempotent for the same (or no) ``payment_ref``.

        A payment that commits before the sweep closes the order wins, even after
        ``expires_at``, unless ``strict_expiry`` is set: then it closes the order instead.
        Within ``late_payment_window_s`` of its expiry, a closed order is paid after all
        (its event says ``late``) unless the late-payment check refuses
        (:meth:`set_late_payment_check`). Paying a paid order again without a reference,
        or with the stored one, returns it.

        Any other payment is refused, and the refusal is recorded before the error is
        raised: a ``payment_refused`` event and a row of the refunds owed
        (:meth:`refused_payments`), once per order and reference. The error says why:
        :class:`OrderClosed` (closed or cancelled), :class:`OrderAlreadyPaid` (another
        reference paid it), :class:`PaymentMismatch` (``amount`` or ``currency`` is not
        the order's: compared only when both the order and the payment state an amount;
        the order stays unpaid). Its ``refusal`` is the event's position. Redis being down
        never refuses a payment. ``actor``: who reports the payment (text, or an
        :class:`~orders.domain.Actor`), recorded in the events.

        ``connection``: as for :meth:`create_unpaid_order`: the payment or its refusal is
        written in the host's transaction, and the order leaves the Redis index when the
        host commits.
        """
        host = self._host(connection)
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        payment = checked_payment(payment_ref, amount, currency)
        cause = Actor.of(actor)
        with tracing.span("orders.mark_paid", order_id=oid) as traced:
            order = self.payments.pay(oid, payment, cause, self.clock(), host)
            traced.set(user_id=order.user_id, outcome=order.status.value)
            return order

    def set_late_payment_check(self, check: LatePaymentCheck | None) -> None:
        """Ask ``check(order, payment)`` before a late payment turns a closed order paid
        (None: accept every payment within ``late_payment_window_s``).

        True accepts it. False refuses it, and so does a check that raises, answers
        anything but a bool, or takes longer than ``pre_close_timeout_s`` (the pre-close
        check's budget): the payment is then refused and its refund recorded.
        """
        self.payments.late_check = check

    def cancel_order(
        self,
        order_id: str,
        *,
        reason: str | None = None,
        actor: str | Actor | None = None,
        connection: HostConnection | None = None,
    ) -> Order:
        """Cancel an unpaid order. Idempotent on a cancelled order.

        Raises :class:`OrderAlreadyPaid` for a paid order and :class:`OrderClosed` for one
        the sweep closed. ``connection``: as for :meth:`mark_paid`, in the host's
        transaction; the order leaves the Redis index when the host commits.
        """
        host = self._host(connection)
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        why = check_optional_text("reason", reason, TEXT_MAX_LENGTH)
        cause = Actor.of(actor)
        now_ms = self.clock()
        with tracing.span("orders.cancel_order", order_id=oid) as traced:
            order, won = self.transitions.run(
                oid,
                now_ms,
                lambda conn: self.records.cancel(conn, oid, now_ms, why, cause),
                host=host,
            )
            traced.set(user_id=order.user_id, outcome=order.status.value)
            if won:
                metrics.CANCELS.inc()
            if order.status is OrderStatus.CANCELLED:
                return order
            raise refusal(order)

    def extend_order(
        self, order_id: str, extra_s: float, *, actor: str | Actor | None = None
    ) -> Order:
        """Move the expiry of an open unpaid order ``extra_s`` later, in SQL and in Redis.

        A compare-and-set against the sweep: an order closed (or paid, or cancelled) first
        cannot be extended (:class:`OrderClosed` / :class:`OrderAlreadyPaid`), nor can one
        whose time is already up (:class:`OrderExpired`: its slot may have been reused).
        The expiry never moves past ``created_at`` plus the maximum lifetime of the order's
        policy (the default policy's without one), nor does an order whose policy does not
        expire (both :class:`InvalidInput`).
        """
        oid = check_order_id(order_id, self.settings.max_order_id_length)  # before the span
        with tracing.span("orders.extend_order", order_id=oid) as traced:
            order = self.extender.extend(oid, extra_s, Actor.of(actor), self.clock())
            traced.set(user_id=order.user_id, outcome="extended")
            return order

    def _host(self, connection: HostConnection | None) -> Connection | None:
        """The host's transaction to write in, checked (see :mod:`orders.sql.host`)."""
        return None if connection is None else host_connection(connection, self.engine)

    # --- reading -------------------------------------------------------------------------

    def get_order(self, order_id: str) -> Order:
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        order = self.records.find(oid, self.clock())
        if order is None:
            raise OrderNotFound(oid)
        return order

    def list_unpaid(self, user_id: str | int) -> list[Order]:
        """The user's open unpaid orders (expiry still ahead), soonest expiry first."""
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        return self.records.list_open(uid, self.clock())

    def iter_events(
        self, *, after: EventPosition | None = None, limit: int = 100
    ) -> list[OrderEvent]:
        """Up to ``limit`` committed events after ``after``, in commit order.

        For a durable, named cursor with retries, see :class:`orders.events.consumer.EventConsumer`.
        """
        return read_events(self.engine, after or EventPosition(), limit)

    def on_closed(self, handler: Callable[[OrderEvent], None]) -> Callable[[OrderEvent], None]:
        """Register ``handler(event)`` to run for each closed order, after the close commits.

        The scheduler process runs it through a durable event consumer (at least once per
        closed order, retried with backoff when it raises, never in the sweep's way).
        Usable as a decorator.
        """
        self.closed_handlers.append(handler)
        return handler

    def on_payment_refused(
        self, handler: Callable[[OrderEvent], None]
    ) -> Callable[[OrderEvent], None]:
        """Register ``handler(event)`` for each refused payment (a refund owed), after the
        refusal commits; run like :meth:`on_closed` handlers (parked after
        ``event_max_attempts``). The event's data holds
        ``payment_ref``, ``reason`` and, when the payment stated them, ``amount`` and
        ``currency``; a handler that issued the refund marks it with
        :meth:`mark_refund_handled`. Usable as a decorator.
        """
        self.refused_payment_handlers.append(handler)
        return handler

    def refused_payments(
        self, *, since_ms: int | None = None, pending_only: bool = False, limit: int = 100
    ) -> list[PaymentRefusal]:
        """Refused payments (the refunds owed), oldest first; see :mod:`orders.sql.refusals`."""
        return list_refusals(self.engine, since_ms=since_ms, pending_only=pending_only, limit=limit)

    def mark_refund_handled(
        self, order_id: str, payment_ref: str | None = None, *, actor: str | Actor | None = None
    ) -> PaymentRefusal:
        """Say the refund of a refused payment was dealt with (by ``actor``): it leaves the
        pending list. Idempotent: the first handler is kept. InvalidInput when that order
        and reference were never refused."""
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        ref = check_optional_text("payment_ref", payment_ref, TEXT_MAX_LENGTH)
        return mark_handled(self.engine, oid, ref, Actor.of(actor), self.clock())

    # --- the sweep and the index -----------------------------------------------------------

    def sweep_expired(
        self,
        *,
        now_ms: int | None = None,
        batch_size: int | None = None,
        max_batches: int | None = None,
        should_stop: Callable[[], bool] | None = None,
        actor: str | Actor | None = None,
    ) -> SweepResult:
        """Close every unpaid order whose expiry is at or before ``now_ms`` (default: now).

        Batches of ``batch_size``, each one transaction; see :mod:`orders.rules.sweep`. The
        close events name the sweeper as their actor (``actor``: its name, or another
        :class:`~orders.domain.Actor`, as the CLI's operator).
        """
        with tracing.span("orders.sweep_expired") as traced:
            who = Actor.of(actor, ActorKind.SWEEPER)
            result = self.sweep.sweep_expired(now_ms, batch_size, max_batches, should_stop, who)
            traced.set(closed=result.closed, batches=result.batches, outcome="swept")
            return result

    def count_due(self, *, now_ms: int | None = None) -> int:
        """How many unpaid orders a sweep at ``now_ms`` (default: now) would close."""
        return self.records.count_due(self.sweep.cutoff(now_ms))

    def earliest_unpaid_expiry_ms(self) -> int | None:
        """The expiry of the unpaid order due first (overdue ones included), or None."""
        return self.records.earliest_unpaid_expiry_ms()

    def earliest_reminder_ms(self) -> int | None:
        """When the first reminder still to be written is due (past ones included), or None."""
        return self.records.earliest_reminder_ms()

    def set_pre_close_check(self, check: PreCloseCheck | None) -> None:
        """Ask ``check(order)`` before an expired order is closed (None: no check).

        It returns seconds to extend the order by (at most ``max_extension_s``; once per
        order), or None to let the close go ahead. A check that raises, or takes longer
        than ``pre_close_timeout_s``, lets the close go ahead: it can never stop the sweep.
        The extension takes the order's slot again, so it is refused (and the order closed)
        when the user has meanwhile reached the limit, or when Redis is down and
        ``create_without_redis`` is off (the one outage policy of :mod:`orders.rules.admission`).

        A create with ``on_limit="replace_oldest"`` asks it too, about the order it would
        cancel, and keeps that order on any answer but None (:mod:`orders.rules.creating`).
        """
        self.sweep.pre_close = check

    def reconcile(
        self,
        *,
        user_id: str | None = None,
        dry_run: bool = False,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        on_progress: Callable[[int], None] | None = None,
    ) -> ReconcileReport:
        """Make the Redis index equal to SQL (see :mod:`orders.rules.reconcile`); a full run
        then serves the waiting lists a crash may have left unserved."""
        report = self.reconciler.reconcile(user_id, dry_run, chunk_size, on_progress)
        if user_id is None and not dry_run:
            self.waiting_list.recover_quietly(force=True)
        return report
