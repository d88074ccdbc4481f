"""The variants the figures compare: each, given n, prepares its data and times n ops.

A use case's variant (create, refusal) runs on either API: the synchronous service on
threads, or the :class:`~orders.aio.AsyncOrderService` as tasks on the bench's one event
loop (:mod:`orders.bench.loop`). The call is written once, against the method both share.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import TracebackType
from typing import Any

from sqlalchemy import insert

from orders.aio import AsyncOrderService
from orders.bench.driver import RawDriver, writer_queue
from orders.bench.measure import Run, Variant, run_ops
from orders.bench.workload import Workload
from orders.domain import APPLICATION, EventKind
from orders.errors import OrderClosed, UnpaidOrderLimitReached
from orders.index.unpaid import admit_args
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from orders.sql.records import LimitReachedInSql

_INSERT_ORDER = insert(orders_table)
_INSERT_EVENT = insert(events_table)


#: A use case's call on either API, given the service and the op's index: it returns the
#: result (``OrderService``) or an awaitable of it (``AsyncOrderService``).
UseCase = Callable[[Any, int], Any]


class _Expect:
    """What every call must end in: success, or with ``refused`` that error (swallowed)."""

    __slots__ = ("refused",)

    def __init__(self, refused: type[Exception] | None) -> None:
        self.refused = refused

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self.refused is None:
            return False
        if kind is None:
            raise RuntimeError(f"expected {self.refused.__name__}, the call succeeded")
        return issubclass(kind, self.refused)


def _use_case(
    w: Workload,
    call: UseCase,
    n: int,
    *,
    threads: int = 1,
    tasks: int | None = None,
    refused: type[Exception] | None = None,
    service: OrderService | None = None,
) -> Run:
    """``call`` n times: on the synchronous service (``service``, else the bench's) on
    ``threads`` threads or, given ``tasks``, awaited on the async service as that many
    tasks on the bench's loop."""
    expect = _Expect(refused)
    if tasks is None:
        chosen = service or w.service

        def op(i: int) -> None:
            with expect:
                call(chosen, i)

        return run_ops(op, n, threads)

    async def awaited(service: AsyncOrderService, i: int) -> None:
        with expect:
            await call(service, i)

    return w.loop.run(awaited, n, tasks)


def create(
    w: Workload, threads: int = 1, *, tasks: int | None = None, combined: bool = False
) -> Variant:
    """``create_unpaid_order`` of a new user per op, on ``threads`` threads or (``tasks``)
    on the asyncio API; ``combined``: on threads, by the service that combines concurrent
    creates (``Workload.combined``)."""

    def variant(n: int) -> Run:
        users = w.users("c" if tasks is None else "a", n)
        return _use_case(
            w,
            lambda s, i: s.create_unpaid_order(users[i]),
            n,
            threads=threads,
            tasks=tasks,
            service=w.combined if combined else None,
        )

    return variant


def _admission_args(w: Workload) -> Callable[[str, int], list[str | int]]:
    """The admission script's ARGV for a new order of a new user at ``now``."""
    ttl, limit = w.service.settings.ttl_ms, w.service.settings.unpaid_limit
    window_ms = w.service.index.window_ms

    def args(order_id: str, now: int) -> list[str | int]:
        return admit_args(
            order_id, expires_at_ms=now + ttl, now_ms=now, limit=limit, window_ms=window_ms
        )

    return args


def _check_admitted(reply: Any) -> None:
    if int(reply[0]) == -1:
        raise RuntimeError("raw admission refused a new user")


def _admit(w: Workload) -> Callable[[list[str], str, int], None]:
    """One raw EVALSHA of the admission script that must admit (a new user each time)."""
    client, sha, args = w.client, w.admit_sha, _admission_args(w)

    def admit(keys: list[str], order_id: str, now: int) -> None:
        _check_admitted(client.evalsha(sha, len(keys), *keys, *args(order_id, now)))

    return admit


def _admitted(
    w: Workload,
    kind: str,
    threads: int,
    write: Callable[[str, str, int, int], None],
    after_run: Callable[[], None] = lambda: None,
) -> Variant:
    """A raw EVALSHA that admits, then ``write(order_id, user_id, now_ms, expires_at_ms)``."""
    admit, clock, ttl = _admit(w), w.service.clock, w.service.settings.ttl_ms

    def variant(n: int) -> Run:
        users, ids = w.users(kind, n), w.order_ids(n)
        keys = [w.admit_keys(u) for u in users]

        def op(i: int) -> None:
            now = clock()
            admit(keys[i], ids[i], now)
            write(ids[i], users[i], now, now + ttl)

        try:
            return run_ops(op, n, threads)
        finally:
            after_run()

    return variant


def floor(w: Workload, threads: int = 1) -> Variant:
    """The honest floor of a create: one EVALSHA of the admission script, then the raw
    driver writing the order row and its ``created`` event in one committed transaction."""
    driver = RawDriver(w.engine, w.connections(threads))
    return _admitted(w, "f", threads, driver.create, driver.release)


def floor_core(w: Workload, threads: int = 1) -> Variant:
    """The same work as :func:`floor` through SQLAlchemy Core: ``engine.begin()`` (a pooled
    connection) and two compiled-once INSERTs (on SQLite, queued as the floor's are)."""
    engine, writer = w.engine, writer_queue(w.engine)

    def write(order_id: str, user_id: str, now: int, expires_at_ms: int) -> None:
        with writer, engine.begin() as conn:
            conn.execute(_INSERT_ORDER, w.minimal_row(order_id, user_id, now, expires_at_ms))
            conn.execute(_INSERT_EVENT, w.created_event(order_id, user_id, now))

    return _admitted(w, "k", threads, write)


def _insert_one(w: Workload) -> Callable[[dict[str, Any]], None]:
    engine = w.engine

    def insert_one(row: dict[str, Any]) -> None:
        with engine.connect() as conn:
            conn.execute(_INSERT_ORDER, row)
            conn.commit()

    return insert_one


def naive(w: Workload, threads: int = 1) -> Variant:
    """The original article's create: ZCARD, then ZADD from the client, then INSERT."""
    client, insert_one, clock = w.client, _insert_one(w), w.service.clock
    ttl, limit = w.service.settings.ttl_ms, w.service.settings.unpaid_limit

    def variant(n: int) -> Run:
        users, ids = w.users("n", n), w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            key = w.key(users[i])
            if int(client.zcard(key)) >= limit:
                raise RuntimeError("naive create refused a new user")
            client.zadd(key, {ids[i]: now + ttl})
            insert_one(w.row(ids[i], users[i], now, now + ttl))

        return run_ops(op, n, threads)

    return variant


def to_thread_create(w: Workload, tasks: int) -> Variant:
    """``create_unpaid_order`` of the synchronous service through ``asyncio.to_thread``, as
    ``tasks`` tasks on the bench's loop (the loop's default executor runs them)."""
    service = w.service

    def variant(n: int) -> Run:
        users = w.users("t", n)
        return w.loop.time(
            lambda i: asyncio.to_thread(service.create_unpaid_order, users[i]), n, tasks
        )

    return variant


def native_floor(w: Workload, tasks: int) -> Variant:
    """The native floor (:mod:`orders.bench.native`) as ``tasks`` tasks on the bench's loop:
    one EVALSHA that admits, then the order row and its event in one transaction."""
    args, clock, ttl, sha = (
        _admission_args(w),
        w.service.clock,
        w.service.settings.ttl_ms,
        w.admit_sha,
    )

    def variant(n: int) -> Run:
        stores = w.loop.native
        users, ids = w.users("v", n), w.order_ids(n)
        keys = [w.admit_keys(u) for u in users]

        async def op(i: int) -> None:
            now = clock()
            _check_admitted(await stores.evalsha(sha, keys[i], args(ids[i], now)))
            await stores.insert(
                w.minimal_row(ids[i], users[i], now, now + ttl),
                w.created_event(ids[i], users[i], now),
            )

        return w.loop.time(op, n, tasks)

    return variant


def refusal(
    w: Workload, *, given_id: bool = False, threads: int = 1, tasks: int | None = None
) -> Variant:
    """``create_unpaid_order`` refused at the limit (users holding 1 of 1); with
    ``given_id``, the caller supplies a new order id (a refusal may then read it by key);
    on ``threads`` threads or, with ``tasks``, on the asyncio API."""
    users = w.full_users()

    def variant(n: int) -> Run:
        ids: list[str | None] = list(w.order_ids(n)) if given_id else [None] * n

        def call(s: Any, i: int) -> Any:
            return s.create_unpaid_order(users[i % len(users)], order_id=ids[i], limit=1)

        return _use_case(w, call, n, threads=threads, tasks=tasks, refused=UnpaidOrderLimitReached)

    return variant


def evalsha_refused(w: Workload, threads: int = 1) -> Variant:
    """One EVALSHA of the admission script that refuses (the same full users), on
    ``threads`` threads."""
    client, sha, clock = w.client, w.admit_sha, w.service.clock
    ttl, window_ms = w.service.settings.ttl_ms, w.service.index.window_ms
    keys = [w.admit_keys(u) for u in w.full_users()]

    def variant(n: int) -> Run:
        ids = w.order_ids(n)

        def op(i: int) -> None:
            now = clock()
            args = admit_args(
                ids[i], expires_at_ms=now + ttl, now_ms=now, limit=1, window_ms=window_ms
            )
            user_keys = keys[i % len(keys)]
            reply = client.evalsha(sha, len(user_keys), *user_keys, *args)
            if int(reply[0]) != -1:
                raise RuntimeError("raw admission at the limit was not refused")

        return run_ops(op, n, threads)

    return variant


#: ``mark_paid`` or ``cancel_order`` of one order id, on either API.
_ACTS: dict[EventKind, Callable[[Any, str], Any]] = {
    EventKind.PAID: lambda s, order_id: s.mark_paid(order_id),
    EventKind.CANCELLED: lambda s, order_id: s.cancel_order(order_id),
}


def transition(
    w: Workload,
    kind: EventKind,
    threads: int = 1,
    *,
    tasks: int | None = None,
    combined: bool = False,
) -> Variant:
    """``mark_paid`` or ``cancel_order`` end to end, on open orders with their members, on
    ``threads`` threads or (``tasks``) on the asyncio API; ``combined``: on threads, by the
    service that combines concurrent transitions (``Workload.combined``; SQLite)."""
    act = _ACTS[kind]

    def variant(n: int) -> Run:
        ids, _users = w.open_orders(kind.value[0], n, members=True)
        return _use_case(
            w,
            lambda s, i: act(s, ids[i]),
            n,
            threads=threads,
            tasks=tasks,
            service=w.combined if combined else None,
        )

    return variant


def paid_stating_amount(w: Workload) -> Variant:
    """``mark_paid`` of a payment that states its amount and currency: the order's amount
    is read first (one SELECT by key) before the compare-and-set."""
    service = w.service

    def variant(n: int) -> Run:
        ids, _users = w.open_orders("a", n, members=True)
        return run_ops(lambda i: service.mark_paid(ids[i], amount="9.90", currency="EUR"), n)

    return variant


def refused_payment(w: Workload) -> Variant:
    """``mark_paid`` for a cancelled order: the lost compare-and-set, then the refusal's
    own transaction (the order's row locked, its payment_refused event and refusal row)."""
    service = w.service

    def variant(n: int) -> Run:
        ids, _users = w.open_orders("x", n, members=False)
        w.cancel_rows(ids)

        def op(i: int) -> None:
            try:
                service.mark_paid(ids[i], payment_ref="bench-refused")
            except OrderClosed:
                return
            raise RuntimeError("a payment for a cancelled order was not refused")

        return run_ops(op, n)

    return variant


def raw_transition(w: Workload, kind: EventKind, threads: int = 1) -> Variant:
    """Its floor: the raw driver's ``UPDATE ... WHERE status = 'unpaid'`` and the event row,
    in one committed transaction (no Redis: the orders have no members)."""
    driver, clock = RawDriver(w.engine, w.connections(threads)), w.service.clock

    def variant(n: int) -> Run:
        ids, users = w.open_orders("r", n, members=False)
        try:
            return run_ops(lambda i: driver.transition(kind, ids[i], users[i], clock()), n, threads)
        finally:
            driver.release()

    return variant


def sql_guard(w: Workload, *, refuse: bool) -> Variant:
    """The SQL guard alone: ``records.insert_guarded`` (count + insert under the user's lock)."""
    service, clock, ttl = w.service, w.service.clock, w.service.settings.ttl_ms

    def variant(n: int) -> Run:
        users = w.full_users() if refuse else w.users("g", n)
        ids = w.order_ids(n)
        limit = 1 if refuse else service.settings.unpaid_limit

        def op(i: int) -> None:
            now = clock()
            values = w.row(ids[i], users[i % len(users)], now, now + ttl)
            try:
                service.records.insert_guarded(values, limit, now, APPLICATION)
            except LimitReachedInSql:
                if refuse:
                    return
                raise
            if refuse:
                raise RuntimeError("the SQL guard admitted an order at the limit")

        return run_ops(op, n)

    return variant
