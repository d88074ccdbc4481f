"""OrderService: the use cases, one method each.

SQL is the record and decides every order's fate; Redis is the admission index in front of
it. Rules that shape every method:

* input is checked before anything is written (``orders.domain``);
* the clock is read once per use case and passed down;
* one SQL transaction per use case; Redis writes that follow a SQL change run after commit;
* a transition out of ``unpaid`` is one compare-and-set ``UPDATE ... WHERE status =
  'unpaid'``, so exactly one of pay, cancel and close wins;
* only :class:`~orders.errors.OrdersError` leaves this module.

The shared plumbing lives in :mod:`orders.store`, the sweep in :mod:`orders.sweeping`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Row, bindparam, func, insert, select
from sqlalchemy.exc import IntegrityError

from orders import metrics
from orders.domain import (
    MAX_TIMESTAMP_MS,
    EventKind,
    Order,
    OrderStatus,
    amount_to_text,
    check_amount,
    check_currency,
    check_limit,
    check_metadata,
    check_optional_text,
    check_order_id,
    check_ttl_ms,
    check_user_id,
)
from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderExpired,
    OrderNotFound,
    OrdersError,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from orders.index import Admission, AdmitResult

if TYPE_CHECKING:
    from orders.events import EventPosition, OrderEvent
    from orders.reconciler import ReconcileReport
from orders.models import (
    TEXT_COLUMN_LENGTH,
    orders_table,
)
from orders.store import EXPIRED_REASON, IS_UNPAID, OC, UNPAID, to_order
from orders.sweeping import Sweeping

log = logging.getLogger(__name__)


# The create path's statements, built once: building them per call (coercions, cache keys)
# cost about as much client CPU as running them.
_GUARD_COUNT = select(func.count(), func.min(OC.expires_at_ms)).where(
    OC.user_id == bindparam("uid"),
    IS_UNPAID,
    OC.expires_at_ms > bindparam("now_ms"),
    OC.id != bindparam("oid"),  # a retry must not count its own order
)
_INSERT_ORDER = insert(orders_table).returning(*orders_table.c)


class _SqlRefused(Exception):
    """The SQL guard found the user at the limit (internal; becomes the public error)."""

    def __init__(self, open_count: int, earliest_ms: int | None) -> None:
        self.open_count = open_count
        self.earliest_ms = earliest_ms


def retry_after_s(earliest_ms: int | None, now_ms: int) -> float:
    if earliest_ms is None:
        return 0.0
    return max(0, earliest_ms - now_ms) / 1000


class OrderService(Sweeping):
    """The order-expiry service over a SQLAlchemy engine and a redis-py client.

    A host application builds it from the engine and client it already has::

        service = OrderService(engine, redis.Redis.from_url(url), Settings(unpaid_limit=3))

    The schema must exist (``orders db upgrade`` or ``alembic upgrade head``).
    ``clock`` returns integer milliseconds; tests pass one they control.
    """

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
    ) -> Order:
        """Admit a new unpaid order for ``user_id`` unless the user is at the limit.

        Costs one Redis round trip plus one SQL transaction; a refusal costs the Redis round
        trip only (plus one read by primary key when the caller supplied ``order_id``, to
        recognise a retry of an order that is no longer open). Retrying with the same
        ``order_id`` returns the same order; the same id with another user, amount or
        currency raises :class:`OrderConflict`.
        """
        try:
            order, created = self._create(
                user_id,
                order_id=order_id,
                ttl_s=ttl_s,
                limit=limit,
                amount=amount,
                currency=currency,
                metadata=metadata,
            )
        except UnpaidOrderLimitReached as refused:
            metrics.CREATES.labels(f"refused_{refused.source}").inc()
            raise
        except OrderConflict:
            metrics.CREATES.labels("conflict").inc()
            raise
        metrics.CREATES.labels("admitted" if created else "retry").inc()
        return order

    def _create(
        self,
        user_id: str | int,
        *,
        order_id: str | None,
        ttl_s: float | None,
        limit: int | None,
        amount: Decimal | int | str | None,
        currency: str | None,
        metadata: Mapping[str, Any] | None,
    ) -> tuple[Order, bool]:
        """create_unpaid_order; also says whether this call inserted the order."""
        s = self.settings
        uid = check_user_id(user_id, s.max_user_id_length)
        given_id = None if order_id is None else check_order_id(order_id, s.max_order_id_length)
        ttl_ms = s.ttl_ms if ttl_s is None else check_ttl_ms(ttl_s, s.max_ttl_ms)
        lim = s.unpaid_limit if limit is None else check_limit(limit)
        amt = check_amount(amount)
        cur = check_currency(currency)
        if cur is not None and amt is None:
            raise InvalidInput("currency", "given without an amount")
        meta = check_metadata(metadata, s.max_metadata_bytes)
        now_ms = self.clock()
        expires_at_ms = now_ms + ttl_ms
        if expires_at_ms > MAX_TIMESTAMP_MS:
            raise InvalidInput("ttl_s", "puts the expiry beyond 2**53 ms")
        oid = given_id or self._new_id()

        try:
            admitted = self.index.admit(
                uid, oid, expires_at_ms=expires_at_ms, now_ms=now_ms, limit=lim
            )
        except StoreUnavailable:
            if not s.create_without_redis:
                raise
            # Degraded mode: the SQL guard alone decides; reconcile adds the member later.
            log.warning(
                "redis unavailable: admitting through the SQL guard only",
                extra={"order_id": oid, "user_id": uid},
            )
            admitted = AdmitResult(Admission.EXISTS, 0, expires_at_ms)
        if admitted.outcome is Admission.REFUSED:
            if given_id is not None:
                earlier = self._find(oid, now_ms)
                if earlier is not None:
                    return _same_order(earlier, uid, amt, cur), False
            raise UnpaidOrderLimitReached(
                uid, lim, admitted.open_count, retry_after_s(admitted.score_ms, now_ms)
            )
        if admitted.outcome is Admission.EXISTS:
            # A retry (or a concurrent twin) of a create whose Redis step already ran:
            # finish it with the expiry that Redis holds.
            expires_at_ms = admitted.score_ms
        ours = admitted.outcome is Admission.ADMITTED
        if self.after_admit is not None:
            self.after_admit(uid, oid)

        values = {
            "id": oid,
            "user_id": uid,
            "status": UNPAID,
            "amount": amount_to_text(amt),
            "currency": cur,
            "created_at_ms": now_ms,
            "expires_at_ms": expires_at_ms,
            "updated_at_ms": now_ms,
            "metadata": meta or None,
        }
        try:
            return self._insert_guarded(values, lim, now_ms), True
        except _SqlRefused as refused:
            if ours:
                self._compensate(uid, oid, now_ms)
            raise UnpaidOrderLimitReached(
                uid,
                lim,
                refused.open_count,
                retry_after_s(refused.earliest_ms, now_ms),
                source="sql",
            ) from None
        except IntegrityError:
            # The id exists in SQL: a concurrent twin of this create won the insert, an
            # earlier create with this id has since been paid or closed, or another user
            # owns the id.
            earlier = self._compensate(uid, oid, now_ms) if ours else self._find(oid, now_ms)
            if earlier is None:
                raise StoreUnavailable("sql", "insert refused by a constraint") from None
            return _same_order(earlier, uid, amt, cur), False
        except OrdersError:
            if ours:
                self._compensate(uid, oid, now_ms)
            raise

    def _compensate(self, uid: str, oid: str, now_ms: int) -> Order | None:
        """Undo our admission after the insert failed, unless the member indexes a real order.

        A concurrent twin of this create (same id, same user) may have committed the row;
        its member must stay. Returns the row found, if any.
        """
        try:
            existing = self._find(oid, now_ms)
        except OrdersError:
            existing = None
        if not (existing is not None and existing.user_id == uid and existing.is_open):
            self._release_quietly(uid, oid)
        return existing

    def _insert_guarded(self, values: dict[str, Any], limit: int, now_ms: int) -> Order:
        """Insert the order unless SQL already counts ``limit`` open orders for the user.

        Runs under a per-user write lock, so the count and the insert are one decision even
        when Redis has lost members. Raises IntegrityError (not translated) on a duplicate id.
        """
        uid = values["user_id"]
        with self._write(user_lock=uid) as conn:
            open_count, earliest = conn.execute(
                _GUARD_COUNT, {"uid": uid, "now_ms": now_ms, "oid": values["id"]}
            ).one()
            if open_count >= limit:
                raise _SqlRefused(open_count, earliest)
            row = conn.execute(_INSERT_ORDER, values).one()
            self._record(conn, [(values["id"], uid)], EventKind.CREATED, now_ms, None)
            conn.commit()
        return to_order(row, now_ms)

    def mark_paid(self, order_id: str, *, payment_ref: str | None = None) -> Order:
        """Mark an unpaid order paid. Idempotent for the same (or no) ``payment_ref``.

        A payment that commits before the sweep closes the order wins, even after
        ``expires_at``, unless ``strict_expiry`` is set: then a late payment closes the
        order and raises :class:`OrderClosed`. Paying a closed or cancelled order raises
        :class:`OrderClosed` (refund it). Paying a paid order again without a reference, or
        with the stored one, returns it; any other reference (also when the first payment
        had none) raises :class:`OrderAlreadyPaid`. Redis being down never refuses a payment.
        """
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        ref = check_optional_text("payment_ref", payment_ref, TEXT_COLUMN_LENGTH)
        now_ms = self.clock()
        late_close = False
        with self._write() as conn:
            conditions = [OC.id == oid, IS_UNPAID]
            if self.settings.strict_expiry:
                conditions.append(OC.expires_at_ms > now_ms)
            row = self._transition(
                conn,
                conditions=conditions,
                kind=EventKind.PAID,
                now_ms=now_ms,
                values={"status": OrderStatus.PAID.value, "paid_at_ms": now_ms, "payment_ref": ref},
                event_data={"payment_ref": ref},
            )
            if row is None and self.settings.strict_expiry:
                row = self._close_expired(conn, oid, now_ms, ref)
                late_close = row is not None
            current = row if row is not None else self._select(conn, oid)
            conn.commit()
        if current is None:
            raise OrderNotFound(oid)
        order = to_order(current, now_ms)
        if row is not None:
            self._release_quietly(order.user_id, oid)
        if late_close:
            metrics.PAYMENTS.labels("refused_strict").inc()
            raise OrderClosed(oid, order.status.value)
        if order.status is OrderStatus.PAID:
            if row is not None:
                late = order.expires_at_ms <= now_ms
                metrics.PAYMENTS.labels("late_before_close" if late else "on_time").inc()
                return order
            if ref is None or ref == order.payment_ref:
                metrics.PAYMENTS.labels("repeat").inc()
                return order
            metrics.PAYMENTS.labels("other_ref").inc()
            raise OrderAlreadyPaid(oid, order.payment_ref)
        metrics.PAYMENTS.labels("refused_after_close").inc()
        raise OrderClosed(oid, order.status.value)

    def cancel_order(self, order_id: str, *, reason: str | None = None) -> Order:
        """Cancel an unpaid order. Idempotent on a cancelled order.

        Raises :class:`OrderAlreadyPaid` for a paid order and :class:`OrderClosed` for one
        the sweep closed.
        """
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        why = check_optional_text("reason", reason, TEXT_COLUMN_LENGTH)
        now_ms = self.clock()
        with self._write() as conn:
            row = self._transition(
                conn,
                conditions=[OC.id == oid, IS_UNPAID],
                kind=EventKind.CANCELLED,
                now_ms=now_ms,
                values={
                    "status": OrderStatus.CANCELLED.value,
                    "closed_at_ms": now_ms,
                    "close_reason": why or "cancelled",
                },
                event_data={"reason": why} if why else None,
            )
            current = row if row is not None else self._select(conn, oid)
            conn.commit()
        if current is None:
            raise OrderNotFound(oid)
        order = to_order(current, now_ms)
        if row is not None:
            metrics.CANCELS.inc()
            self._release_quietly(order.user_id, oid)
        if order.status is OrderStatus.CANCELLED:
            return order
        if order.status is OrderStatus.PAID:
            raise OrderAlreadyPaid(oid, order.payment_ref)
        raise OrderClosed(oid, order.status.value)

    def extend_order(self, order_id: str, extra_s: float) -> Order:
        """Move the expiry of an open unpaid order ``extra_s`` later, in SQL and in Redis.

        A compare-and-set against the sweep: an order closed (or paid, or cancelled) first
        cannot be extended (:class:`OrderClosed` / :class:`OrderAlreadyPaid`), nor can one
        whose time is already up (:class:`OrderExpired`: its slot may have been reused).
        The expiry never moves past ``created_at + max_lifetime_s`` (:class:`InvalidInput`).
        """
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        extra_ms = check_ttl_ms(extra_s, self.settings.max_ttl_ms)
        now_ms = self.clock()
        max_life_ms = round(self.settings.max_lifetime_s * 1000)
        with self._write() as conn:
            row = self._transition(
                conn,
                conditions=[
                    OC.id == oid,
                    IS_UNPAID,
                    OC.expires_at_ms > now_ms,
                    OC.expires_at_ms + extra_ms - OC.created_at_ms <= max_life_ms,
                ],
                kind=EventKind.EXTENDED,
                now_ms=now_ms,
                values={
                    "expires_at_ms": OC.expires_at_ms + extra_ms,
                    "extensions": OC.extensions + 1,
                },
                event_data={"extra_ms": extra_ms},
            )
            current = row if row is not None else self._select(conn, oid)
            conn.commit()
        if current is None:
            raise OrderNotFound(oid)
        order = to_order(current, now_ms)
        if row is not None:
            metrics.EXTENSIONS.labels("api").inc()
            self._rescore_quietly(order)
            return order
        if order.status is OrderStatus.PAID:
            raise OrderAlreadyPaid(oid, order.payment_ref)
        if order.status is not OrderStatus.UNPAID:
            raise OrderClosed(oid, order.status.value)
        if order.expires_at_ms <= now_ms:
            raise OrderExpired(oid)
        raise InvalidInput("extra_s", "would move the expiry past the maximum lifetime")

    def on_closed(self, handler: Callable[[OrderEvent], None]) -> Callable[[OrderEvent], None]:
        """Register ``handler(event)`` to run for each closed order, after the close commits.

        The scheduler process runs it through a durable event consumer (at least once per
        closed order, retried with backoff when it raises, never in the sweep's way).
        Usable as a decorator.
        """
        self.closed_handlers.append(handler)
        return handler

    def get_order(self, order_id: str) -> Order:
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        now_ms = self.clock()
        order = self._find(oid, now_ms)
        if order is None:
            raise OrderNotFound(oid)
        return order

    def list_unpaid(self, user_id: str | int) -> list[Order]:
        """The user's open unpaid orders (expiry still ahead), soonest expiry first."""
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        now_ms = self.clock()
        query = (
            select(*orders_table.c)
            .where(OC.user_id == uid, IS_UNPAID, OC.expires_at_ms > now_ms)
            .order_by(OC.expires_at_ms, OC.id)
        )
        with self._read() as conn:
            rows = conn.execute(query).all()
        return [to_order(row, now_ms) for row in rows]

    def iter_events(
        self, *, after: EventPosition | None = None, limit: int = 100
    ) -> list[OrderEvent]:
        """Up to ``limit`` committed events after ``after``, in commit order.

        For a durable, named cursor with retries, see :class:`orders.events.EventConsumer`.
        """
        from orders.events import EventPosition, read_events  # noqa: PLC0415

        return read_events(self.engine, after or EventPosition(), limit)

    def reconcile(
        self,
        *,
        user_id: str | None = None,
        dry_run: bool = False,
        chunk_size: int = 500,
        on_progress: Callable[[int], None] | None = None,
    ) -> ReconcileReport:
        """Make the Redis index equal to SQL (see :mod:`orders.reconciler`)."""
        from orders.reconciler import reconcile  # noqa: PLC0415  (it builds on this class)

        return reconcile(
            self, user_id=user_id, dry_run=dry_run, chunk_size=chunk_size, on_progress=on_progress
        )

    def _close_expired(
        self, conn: Connection, oid: str, now_ms: int, payment_ref: str | None
    ) -> Row[Any] | None:
        """Strict expiry: close one expired unpaid order inside the caller's transaction.

        The refused payment's reference goes into the event, so a refund can find it.
        """
        return self._transition(
            conn,
            conditions=[OC.id == oid, IS_UNPAID, OC.expires_at_ms <= now_ms],
            kind=EventKind.CLOSED,
            now_ms=now_ms,
            values={
                "status": OrderStatus.CLOSED.value,
                "closed_at_ms": now_ms,
                "close_reason": EXPIRED_REASON,
            },
            event_data={"trigger": "late_payment", "payment_ref": payment_ref},
        )


def _same_order(order: Order, user_id: str, amount: Decimal | None, currency: str | None) -> Order:
    """``order`` if a create with these arguments is a retry of it; else OrderConflict."""
    if order.user_id != user_id:
        raise OrderConflict(order.id, "this order id belongs to another user")
    if order.amount != amount or order.currency != currency:
        raise OrderConflict(order.id, "this order id exists with another amount or currency")
    return order
