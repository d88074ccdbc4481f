"""OrderService: the use cases, one method each.

SQL is the record and decides every order's fate; Redis is the admission index in front of
it. Rules that shape every method:

* input is checked before anything is written (``orders.domain``);
* the clock is read once per use case and passed down;
* one SQL transaction per use case; Redis writes that follow a SQL change run after commit;
* a transition out of ``unpaid`` is one compare-and-set ``UPDATE ... WHERE status =
  'unpaid'``, so exactly one of pay, cancel and close wins;
* only :class:`~orders.errors.OrdersError` leaves this module.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import redis
from sqlalchemy import Connection, Engine, Row, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from orders import metrics
from orders.config import Settings
from orders.domain import (
    MAX_TIMESTAMP_MS,
    Clock,
    EventKind,
    Order,
    OrderIdGenerator,
    OrderStatus,
    SweepResult,
    amount_to_text,
    check_amount,
    check_currency,
    check_limit,
    check_metadata,
    check_optional_text,
    check_order_id,
    check_ttl_ms,
    check_user_id,
    system_clock,
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
from orders.index import Admission, AdmitResult, UnpaidIndex

if TYPE_CHECKING:
    from orders.events import EventPosition, OrderEvent
    from orders.reconciler import ReconcileReport
from orders.models import (
    TEXT_COLUMN_LENGTH,
    UNPAID_PREDICATE,
    events_table,
    orders_table,
    sql_errors,
)

log = logging.getLogger(__name__)

OC = orders_table.c
UNPAID = OrderStatus.UNPAID.value
#: Inline, not a bound parameter: only a literal lets the planners of both engines match the
#: partial indexes declared WHERE status = 'unpaid' (PostgreSQL's generic plans included).
IS_UNPAID = UNPAID_PREDICATE
EXPIRED_REASON = "expired"


class _SqlRefused(Exception):
    """The SQL guard found the user at the limit (internal; becomes the public error)."""

    def __init__(self, open_count: int, earliest_ms: int | None) -> None:
        self.open_count = open_count
        self.earliest_ms = earliest_ms


def retry_after_s(earliest_ms: int | None, now_ms: int) -> float:
    if earliest_ms is None:
        return 0.0
    return max(0, earliest_ms - now_ms) / 1000


class OrderService:
    """The order-expiry service over a SQLAlchemy engine and a redis-py client.

    A host application builds it from the engine and client it already has::

        service = OrderService(engine, redis.Redis.from_url(url), Settings(unpaid_limit=3))

    The schema must exist (``orders db upgrade`` or ``alembic upgrade head``).
    ``clock`` returns integer milliseconds; tests pass one they control.
    """

    def __init__(
        self,
        engine: Engine,
        redis_client: redis.Redis,
        settings: Settings | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.engine = engine
        self.clock: Clock = clock or system_clock
        self.index = UnpaidIndex(
            redis_client,
            key_prefix=self.settings.key_prefix,
            key_margin_ms=self.settings.key_margin_ms,
        )
        self._new_id = OrderIdGenerator(self.clock)
        self._dialect = engine.dialect.name
        #: Test hook: called between the Redis admission and the SQL insert.
        self.after_admit: Callable[[str, str], None] | None = None
        #: Take the per-user lock around the SQL limit guard on PostgreSQL. Only a test
        #: turns it off, to show the race the lock prevents (count-then-insert at READ
        #: COMMITTED lets two creates both see room for one more).
        self.lock_users = True
        self._pre_close: Callable[[Order], float | None] | None = None
        self.closed_handlers: list[Callable[[OrderEvent], None]] = []
        self._hook_executor: ThreadPoolExecutor | None = None

    # --- create ----------------------------------------------------------------------

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
                select(func.count(), func.min(OC.expires_at_ms)).where(
                    OC.user_id == uid, IS_UNPAID, OC.expires_at_ms > now_ms
                )
            ).one()
            if open_count >= limit:
                raise _SqlRefused(open_count, earliest)
            row = conn.execute(
                insert(orders_table).values(**values).returning(*orders_table.c)
            ).one()
            self._record(conn, [(values["id"], uid)], EventKind.CREATED, now_ms, None)
            conn.commit()
        return _to_order(row, now_ms)

    # --- pay and cancel --------------------------------------------------------------

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
        order = _to_order(current, now_ms)
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
        order = _to_order(current, now_ms)
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
        order = _to_order(current, now_ms)
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

    def set_pre_close_check(self, check: Callable[[Order], float | None] | None) -> None:
        """Ask ``check(order)`` before an expired order is closed (None: no check).

        It returns seconds to extend the order by (at most ``max_extension_s``; once per
        order), or None to let the close go ahead. A check that raises, or takes longer
        than ``pre_close_timeout_s``, lets the close go ahead: it can never stop the sweep.
        The extension takes the order's slot again, so it is refused (and the order closed)
        when the user has meanwhile reached the limit.
        """
        self._pre_close = check

    # --- reads -----------------------------------------------------------------------

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
        return [_to_order(row, now_ms) for row in rows]

    def earliest_unpaid_expiry_ms(self) -> int | None:
        """The expiry of the unpaid order due first (overdue ones included), or None."""
        query = select(func.min(OC.expires_at_ms)).where(IS_UNPAID)
        with self._read() as conn:
            value: int | None = conn.scalar(query)
        return value

    def count_due(self, *, now_ms: int | None = None) -> int:
        """How many unpaid orders a sweep at ``now_ms`` (default: now) would close."""
        clock_now = self.clock()
        cutoff = clock_now if now_ms is None else _check_cutoff(now_ms, clock_now)
        query = (
            select(func.count())
            .select_from(orders_table)
            .where(IS_UNPAID, OC.expires_at_ms <= cutoff)
        )
        with self._read() as conn:
            return int(conn.scalar(query) or 0)

    def iter_events(
        self, *, after: EventPosition | None = None, limit: int = 100
    ) -> list[OrderEvent]:
        """Up to ``limit`` committed events after ``after``, in commit order.

        For a durable, named cursor with retries, see :class:`orders.events.EventConsumer`.
        """
        from orders.events import EventPosition, read_events  # noqa: PLC0415

        return read_events(self.engine, after or EventPosition(), limit)

    def reconcile(
        self, *, user_id: str | None = None, dry_run: bool = False, chunk_size: int = 500
    ) -> ReconcileReport:
        """Make the Redis index equal to SQL (see :mod:`orders.reconciler`)."""
        from orders.reconciler import reconcile  # noqa: PLC0415  (it builds on this class)

        return reconcile(self, user_id=user_id, dry_run=dry_run, chunk_size=chunk_size)

    # --- sweep -----------------------------------------------------------------------

    def sweep_expired(
        self,
        *,
        now_ms: int | None = None,
        batch_size: int | None = None,
        max_batches: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> SweepResult:
        """Close every unpaid order whose expiry is at or before ``now_ms`` (default: now).

        Works in batches ordered by expiry, each one SQL transaction that closes its orders
        with a compare-and-set and records a ``closed`` event per order; after each commit
        the affected users' Redis sets drop their expired members in one pipeline. A batch
        that fails leaves its orders unpaid for the next sweep. Safe to run in several
        processes at once. ``should_stop`` is asked before each batch.
        """
        clock_now = self.clock()
        cutoff = clock_now if now_ms is None else _check_cutoff(now_ms, clock_now)
        size = self.settings.sweep_batch_size if batch_size is None else batch_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 10_000:
            raise InvalidInput("batch_size", "must be an integer between 1 and 10000")
        started = time.monotonic()
        if max_batches is not None and (
            isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1
        ):
            raise InvalidInput("max_batches", "must be a positive integer")
        closed = batches = redis_errors = 0
        users: set[str] = set()
        max_lag: int | None = None
        while max_batches is None or batches < max_batches:
            if should_stop is not None and should_stop():
                break
            if self._dialect == "sqlite" and not self._any_due(cutoff):
                break  # SQLite's write lock is the whole database's: take it only to close
            if self._pre_close is not None:
                self._run_pre_close(cutoff, size)
            closed_at_ms = self.clock()
            with self._write() as conn:
                rows = self._close_due(conn, cutoff, size, closed_at_ms)
                conn.commit()
            if not rows:
                break
            batches += 1
            closed += len(rows)
            metrics.CLOSES.inc(len(rows))
            for row in rows:
                metrics.CLOSE_LAG_SECONDS.observe((closed_at_ms - row.expires_at_ms) / 1000)
            batch_users = {row.user_id for row in rows}
            users |= batch_users
            lag = closed_at_ms - min(row.expires_at_ms for row in rows)
            max_lag = lag if max_lag is None else max(max_lag, lag)
            if redis_errors == 0:  # after one failure, spare later batches the timeouts
                try:
                    self.index.drop_expired(batch_users, cutoff)
                except StoreUnavailable:
                    redis_errors += 1
                    log.debug("sweep: redis cleanup failed; expired members go by score")
            if len(rows) < size:
                break
        if closed:
            metrics.SWEEP_SECONDS.observe(time.monotonic() - started)
        return SweepResult(
            closed=closed,
            batches=batches,
            users=len(users),
            cutoff_ms=cutoff,
            max_lag_ms=max_lag,
            redis_errors=redis_errors,
        )

    def _any_due(self, cutoff: int) -> bool:
        query = select(OC.id).where(IS_UNPAID, OC.expires_at_ms <= cutoff).limit(1)
        with self._read() as conn:
            return conn.execute(query).first() is not None

    def _close_due(
        self, conn: Connection, cutoff: int, size: int, closed_at_ms: int
    ) -> Sequence[Row[Any]]:
        due = (
            select(OC.id)
            .where(IS_UNPAID, OC.expires_at_ms <= cutoff)
            .order_by(OC.expires_at_ms)
            .limit(size)
        )
        if self._dialect == "postgresql":
            # Rows another sweeper has claimed are skipped, not waited for.
            due = due.with_for_update(skip_locked=True)
        # A CTE, not "id IN (subquery)": PostgreSQL may run such a subquery more than once,
        # and with SKIP LOCKED each run can pick other rows, closing more than a batch.
        claimed = due.cte("due")
        rows = conn.execute(
            update(orders_table)
            .where(OC.id == claimed.c.id, IS_UNPAID)
            .values(
                status=OrderStatus.CLOSED.value,
                closed_at_ms=closed_at_ms,
                close_reason=EXPIRED_REASON,
                updated_at_ms=closed_at_ms,
            )
            .returning(OC.id, OC.user_id, OC.expires_at_ms)
        ).all()
        self._record(conn, [(r.id, r.user_id) for r in rows], EventKind.CLOSED, closed_at_ms, None)
        return rows

    # --- helpers ---------------------------------------------------------------------

    def _run_pre_close(self, cutoff: int, size: int) -> None:
        """Ask the pre-close check about the next batch's orders not yet extended."""
        check = self._pre_close
        assert check is not None
        query = (
            select(*orders_table.c)
            .where(IS_UNPAID, OC.expires_at_ms <= cutoff, OC.extensions == 0)
            .order_by(OC.expires_at_ms)
            .limit(size)
        )
        with self._read() as conn:
            due = [_to_order(row, cutoff) for row in conn.execute(query)]
        # One time budget for the whole batch: a stuck check costs the batch that budget
        # once, and then every order it was asked about simply closes.
        futures = {self._hook_pool().submit(check, order): order for order in due}
        done, _ = wait(futures, timeout=self.settings.pre_close_timeout_s)
        max_extension_ms = round(self.settings.max_extension_s * 1000)
        for future, order in futures.items():
            if future not in done or future.exception() is not None:
                log.warning(
                    "pre-close check failed or timed out; closing",
                    extra={"order_id": order.id, "user_id": order.user_id},
                )
                continue
            answer = future.result()
            if answer is None:
                continue
            try:
                extra_ms = min(check_ttl_ms(answer, self.settings.max_ttl_ms), max_extension_ms)
            except InvalidInput:
                log.warning(
                    "pre-close check gave an invalid extension; closing",
                    extra={"order_id": order.id, "user_id": order.user_id},
                )
                continue
            self._reopen(order, extra_ms)

    def _reopen(self, order: Order, extra_ms: int) -> bool:
        """Give an expired, unclosed order ``extra_ms`` more from now, if its user has room.

        The expired order no longer holds a slot, so this is an admission: the Redis script
        and the SQL guard both count, and a refusal leaves the order to be closed.
        """
        now_ms = self.clock()
        expires_at_ms = now_ms + extra_ms
        max_life_ms = round(self.settings.max_lifetime_s * 1000)
        if expires_at_ms - order.created_at_ms > max_life_ms:
            return False
        limit = self.settings.unpaid_limit
        try:
            admitted = self.index.admit(
                order.user_id, order.id, expires_at_ms=expires_at_ms, now_ms=now_ms, limit=limit
            )
        except StoreUnavailable:
            admitted = AdmitResult(Admission.EXISTS, 0, expires_at_ms)  # SQL decides alone
        if admitted.outcome is Admission.REFUSED:
            return False
        with self._write(user_lock=order.user_id) as conn:
            open_count = conn.scalar(
                select(func.count()).where(
                    OC.user_id == order.user_id, IS_UNPAID, OC.expires_at_ms > now_ms
                )
            )
            row = None
            if (open_count or 0) < limit:
                row = self._transition(
                    conn,
                    conditions=[OC.id == order.id, IS_UNPAID, OC.extensions == 0],
                    kind=EventKind.EXTENDED,
                    now_ms=now_ms,
                    values={"expires_at_ms": expires_at_ms, "extensions": OC.extensions + 1},
                    event_data={"extra_ms": extra_ms, "trigger": "pre_close_check"},
                )
            conn.commit()
        if row is None:
            if admitted.outcome is Admission.ADMITTED:
                self._release_quietly(order.user_id, order.id)
            return False
        metrics.EXTENSIONS.labels("pre_close_check").inc()
        return True

    def _hook_pool(self) -> ThreadPoolExecutor:
        if self._hook_executor is None:
            self._hook_executor = ThreadPoolExecutor(8, thread_name_prefix="orders-hook")
        return self._hook_executor

    def _rescore_quietly(self, order: Order) -> None:
        """Move a member's score to the order's new expiry after SQL decided."""
        try:
            self.index.repair(
                order.user_id,
                now_ms=order.read_at_ms,
                remove=[],
                add={order.id: order.expires_at_ms},
            )
        except StoreUnavailable:
            log.warning(
                "redis rescore failed; reconcile will fix it",
                extra={"order_id": order.id, "user_id": order.user_id},
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

    def _transition(
        self,
        conn: Connection,
        *,
        conditions: list[Any],
        kind: EventKind,
        now_ms: int,
        values: dict[str, Any],
        event_data: dict[str, Any] | None,
    ) -> Row[Any] | None:
        """One compare-and-set UPDATE; records the event if it won. None if it lost."""
        row = conn.execute(
            update(orders_table)
            .where(*conditions)
            .values(updated_at_ms=now_ms, **values)
            .returning(*orders_table.c)
        ).one_or_none()
        if row is not None:
            self._record(conn, [(row.id, row.user_id)], kind, now_ms, event_data)
        return row

    def _record(
        self,
        conn: Connection,
        orders: list[tuple[str, str]],
        kind: EventKind,
        at_ms: int,
        data: dict[str, Any] | None,
    ) -> None:
        if orders:
            conn.execute(
                insert(events_table),
                [
                    {
                        "order_id": oid,
                        "user_id": uid,
                        "kind": kind.value,
                        "at_ms": at_ms,
                        "data": data,
                    }
                    for oid, uid in orders
                ],
            )

    def _select(self, conn: Connection, oid: str) -> Row[Any] | None:
        return conn.execute(select(*orders_table.c).where(OC.id == oid)).one_or_none()

    def _find(self, oid: str, now_ms: int) -> Order | None:
        with self._read() as conn:
            row = self._select(conn, oid)
        return None if row is None else _to_order(row, now_ms)

    def _release_quietly(self, user_id: str, order_id: str) -> None:
        """Remove a member after SQL decided; a Redis failure only delays the cleanup."""
        try:
            self.index.release(user_id, order_id)
        except StoreUnavailable:
            log.warning(
                "redis release failed; the member expires by its score or at reconcile",
                extra={"order_id": order_id, "user_id": user_id},
            )

    @contextmanager
    def _read(self) -> Iterator[Connection]:
        with sql_errors(), self.engine.connect() as conn:
            yield conn

    @contextmanager
    def _write(self, *, user_lock: str | None = None) -> Iterator[Connection]:
        """A write transaction; the caller commits. Leaving without commit rolls back.

        SQLite: ``BEGIN IMMEDIATE`` takes the database's write lock up front, so a
        read-then-write transaction never fails to upgrade, and it serialises the limit
        guard. PostgreSQL: ``user_lock`` takes a transaction-scoped advisory lock on the
        user, which serialises that user's creates.
        """
        with sql_errors(), self.engine.connect() as conn:
            if self._dialect == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            elif self._dialect == "postgresql" and user_lock is not None and self.lock_users:
                conn.execute(
                    select(func.pg_advisory_xact_lock(func.hashtextextended(user_lock, 0)))
                )
            yield conn


def _check_cutoff(now_ms: object, clock_now: int) -> int:
    if isinstance(now_ms, bool) or not isinstance(now_ms, int):
        raise InvalidInput("now_ms", "must be integer milliseconds")
    if now_ms > clock_now:
        raise InvalidInput("now_ms", "must not be ahead of the clock (it would close open orders)")
    if now_ms < 0:
        raise InvalidInput("now_ms", "must not be negative")
    return now_ms


def _to_order(row: Row[Any], read_at_ms: int) -> Order:
    m = row._mapping
    amount = m["amount"]
    return Order(
        id=m["id"],
        user_id=m["user_id"],
        status=OrderStatus(m["status"]),
        created_at_ms=m["created_at_ms"],
        expires_at_ms=m["expires_at_ms"],
        read_at_ms=read_at_ms,
        amount=None if amount is None else Decimal(amount),
        currency=m["currency"],
        paid_at_ms=m["paid_at_ms"],
        closed_at_ms=m["closed_at_ms"],
        close_reason=m["close_reason"],
        payment_ref=m["payment_ref"],
        metadata=dict(m["metadata"] or {}),
        extensions=m["extensions"],
    )


def _same_order(order: Order, user_id: str, amount: Decimal | None, currency: str | None) -> Order:
    """``order`` if a create with these arguments is a retry of it; else OrderConflict."""
    if order.user_id != user_id:
        raise OrderConflict(order.id, "this order id belongs to another user")
    if order.amount != amount or order.currency != currency:
        raise OrderConflict(order.id, "this order id exists with another amount or currency")
    return order
