"""Closing expired orders: the sweep, and the pre-close check asked before it closes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from sqlalchemy import BigInteger, Connection, func, insert, literal, select, update

from orders import metrics
from orders.domain import EventKind, Order, OrderStatus, SweepResult, check_ttl_ms
from orders.errors import InvalidInput, StoreUnavailable
from orders.index import Admission, AdmitResult
from orders.models import events_table, orders_table
from orders.store import EXPIRED_REASON, IS_UNPAID, OC, ServiceBase, check_cutoff, to_order

log = logging.getLogger("orders.service")


class Sweeping(ServiceBase):
    """The sweep and what it asks first; :class:`orders.service.OrderService` builds on it."""

    def earliest_unpaid_expiry_ms(self) -> int | None:
        """The expiry of the unpaid order due first (overdue ones included), or None."""
        query = select(func.min(OC.expires_at_ms)).where(IS_UNPAID)
        with self._read() as conn:
            value: int | None = conn.scalar(query)
        return value

    def count_due(self, *, now_ms: int | None = None) -> int:
        """How many unpaid orders a sweep at ``now_ms`` (default: now) would close."""
        clock_now = self.clock()
        cutoff = clock_now if now_ms is None else check_cutoff(now_ms, clock_now)
        query = (
            select(func.count())
            .select_from(orders_table)
            .where(IS_UNPAID, OC.expires_at_ms <= cutoff)
        )
        with self._read() as conn:
            return int(conn.scalar(query) or 0)

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
        cutoff = clock_now if now_ms is None else check_cutoff(now_ms, clock_now)
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
    ) -> Sequence[Any]:
        """Close up to ``size`` due orders; their (id, user_id, expires_at_ms) rows."""
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
        close = (
            update(orders_table)
            .where(OC.id == claimed.c.id, IS_UNPAID)
            .values(
                status=OrderStatus.CLOSED.value,
                closed_at_ms=closed_at_ms,
                close_reason=EXPIRED_REASON,
                updated_at_ms=closed_at_ms,
            )
            .returning(OC.id, OC.user_id, OC.expires_at_ms)
        )
        if self._dialect != "postgresql":
            rows = conn.execute(close).all()
            self._record(
                conn, [(r.id, r.user_id) for r in rows], EventKind.CLOSED, closed_at_ms, None
            )
            return rows
        # PostgreSQL: claim, close and write the events in one statement. Row-by-row event
        # inserts (psycopg's executemany) took most of a sweep's time there.
        closed = close.cte("closed")
        record = (
            insert(events_table)
            .from_select(
                ["order_id", "user_id", "kind", "at_ms"],
                select(
                    closed.c.id,
                    closed.c.user_id,
                    literal(EventKind.CLOSED.value),
                    literal(closed_at_ms, BigInteger()),
                ),
            )
            .cte("recorded")
        )
        return conn.execute(
            select(closed.c.id, closed.c.user_id, closed.c.expires_at_ms).add_cte(record)
        ).all()

    def set_pre_close_check(self, check: Callable[[Order], float | None] | None) -> None:
        """Ask ``check(order)`` before an expired order is closed (None: no check).

        It returns seconds to extend the order by (at most ``max_extension_s``; once per
        order), or None to let the close go ahead. A check that raises, or takes longer
        than ``pre_close_timeout_s``, lets the close go ahead: it can never stop the sweep.
        The extension takes the order's slot again, so it is refused (and the order closed)
        when the user has meanwhile reached the limit.
        """
        self._pre_close = check

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
            due = [to_order(row, cutoff) for row in conn.execute(query)]
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
