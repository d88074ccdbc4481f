"""The variants the figures compare: each, given n, prepares its data and times n ops.

A use case's variant (create, refusal) runs on either API: the synchronous service on
threads, or the :class:`~orders.aio.AsyncOrderService` as tasks on the bench's one event
loop (:mod:`benchmarks.loop`). The call is written once, against the method both share.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

from benchmarks.measure import Run, Variant, run_ops
from benchmarks.workload import Workload
from orders.aio import AsyncOrderService
from orders.domain import APPLICATION, EventKind, NewOrder
from orders.errors import OrderClosed, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql.records import LimitReachedInSql

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
    w: Workload, threads: int = 1, *, tasks: int | None = None, single: bool = False
) -> Variant:
    """``create_unpaid_order`` of a new user per op, on ``threads`` threads or (``tasks``)
    on the asyncio API; ``single``: on threads, by the service that combines nothing
    (``Workload.single``)."""

    def variant(n: int) -> Run:
        users = w.users("c" if tasks is None else "a", n)
        return _use_case(
            w,
            lambda s, i: s.create_unpaid_order(users[i]),
            n,
            threads=threads,
            tasks=tasks,
            service=w.single if single else None,
        )

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
    single: bool = False,
) -> Variant:
    """``mark_paid`` or ``cancel_order`` end to end, on open orders with their members, on
    ``threads`` threads or (``tasks``) on the asyncio API; ``single``: on threads, by the
    service that combines nothing (``Workload.single``; on SQLite the default combines)."""
    act = _ACTS[kind]

    def variant(n: int) -> Run:
        ids, _users = w.open_orders(kind.value[0], n, members=True)
        return _use_case(
            w,
            lambda s, i: act(s, ids[i]),
            n,
            threads=threads,
            tasks=tasks,
            service=w.single if single else None,
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


def sql_guard(w: Workload, *, refuse: bool) -> Variant:
    """The SQL guard alone: ``records.insert_guarded`` (count + insert under the user's lock)."""
    service, clock, ttl = w.service, w.service.clock, w.ttl_ms

    def variant(n: int) -> Run:
        users = w.full_users() if refuse else w.users("g", n)
        ids = w.order_ids(n)
        limit = 1 if refuse else service.settings.unpaid_limit

        def op(i: int) -> None:
            now = clock()
            new = NewOrder(ids[i], users[i % len(users)], now, now + ttl, limit, APPLICATION)
            try:
                service.records.insert_guarded(new)
            except LimitReachedInSql:
                if refuse:
                    return
                raise
            if refuse:
                raise RuntimeError("the SQL guard admitted an order at the limit")

        return run_ops(op, n)

    return variant
