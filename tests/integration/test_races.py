"""Races between real threads: the limit, payments against the sweep, idempotent creates.

Every thread either shares the ``service`` fixture (OrderService is thread-safe) or builds
its own OrderService over the same engine, Redis client and clock, the way several
checkout processes share the two stores. Time never moves on its own: the tests move the
manual clock. Every test checks the final state of both stores, SQL and Redis.
"""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
from sqlalchemy import Engine, select

from orders.domain import OrderStatus, SweepResult
from orders.errors import InvalidInput, OrderAlreadyPaid, OrderClosed, UnpaidOrderLimitReached
from orders.index.admissions import AdmitRequest
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from orders.validation import MAX_TIMESTAMP_MS
from tests.support.clocks import ManualClock
from tests.support.doubles import pausing_after_admit
from tests.support.monitor import LimitMonitor

pytestmark = pytest.mark.every_server

OC = orders_table.c
EC = events_table.c
JOIN_TIMEOUT_S = 60


# --- helpers ----------------------------------------------------------------------------------


def run_threads(targets: list[Callable[[], None]]) -> None:
    """Run each target in its own thread, wait for all, re-raise the first error."""
    errors: list[BaseException] = []
    lock = threading.Lock()

    def wrap(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                with lock:
                    errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def at_once(
    calls: list[Callable[[], object]], caught: type[Exception] | tuple[()] = ()
) -> list[object]:
    """Each call in a thread of its own, all released together: what each returned, or the
    ``caught`` error it raised, in the order of ``calls`` (any other error is raised)."""
    barrier = threading.Barrier(len(calls), timeout=30)
    outcomes: list[object] = [None] * len(calls)

    def call_at(n: int, call: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            try:
                outcomes[n] = call()
            except caught as exc:
                outcomes[n] = exc

        return run

    run_threads([call_at(n, call) for n, call in enumerate(calls)])
    return outcomes


def sql_unpaid_ids(engine: Engine, user_id: str) -> set[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(OC.id).where(OC.user_id == user_id, OC.status == OrderStatus.UNPAID.value)
        ).all()
    return {row.id for row in rows}


def sql_orders(engine: Engine, **where: Any) -> dict[str, Any]:
    """Order rows by id, filtered by column equality."""
    query = select(*orders_table.c).where(*(OC[name] == value for name, value in where.items()))
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(query).all()}


def sql_events(engine: Engine) -> dict[str, list[str]]:
    """Event kinds per order id, in insertion order."""
    with engine.connect() as conn:
        rows = conn.execute(select(EC.order_id, EC.kind).order_by(EC.id)).all()
    out: dict[str, list[str]] = {}
    for row in rows:
        out.setdefault(row.order_id, []).append(row.kind)
    return out


# --- the limit under contention -----------------------------------------------------------


def test_thirty_two_threads_racing_one_user_get_exactly_the_limit_in_both_stores(
    service: OrderService,
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: redis.Redis,
) -> None:
    user, limit, threads, attempts = "racer", 3, 32, 4
    barrier = threading.Barrier(threads, timeout=30)
    created: list[str] = []
    refused: list[UnpaidOrderLimitReached] = []
    lock = threading.Lock()

    def creator(own: OrderService) -> Callable[[], None]:
        def run() -> None:
            barrier.wait()
            for _ in range(attempts):
                try:
                    order = own.create_unpaid_order(user, limit=limit)
                except UnpaidOrderLimitReached as exc:
                    with lock:
                        refused.append(exc)
                else:
                    with lock:
                        created.append(order.id)

        return run

    # Half the threads share the fixture's service, half have one of their own.
    targets = [creator(service if n % 2 else make_service()) for n in range(threads)]
    key = service.index.key(user)
    with LimitMonitor(
        engine, redis_client, key, user, limit=limit, clock=service.clock, pause_s=0
    ) as monitor:
        run_threads(targets)

    assert len(created) == limit
    assert len(set(created)) == limit
    assert len(refused) == threads * attempts - limit
    assert all(exc.limit == limit and exc.open_count == limit for exc in refused)
    assert sql_unpaid_ids(engine, user) == set(created)
    assert set(service.index.members(user)) == set(created)
    assert monitor.samples > 0, "the monitor took no sample"
    assert monitor.violations == [], monitor.violations[:5]
    assert monitor.max_unpaid <= limit
    assert monitor.max_zcard <= limit
    final = monitor.sample()
    assert final.unpaid == final.zcard == limit


def test_limit_holds_in_both_stores_while_payers_free_slots_concurrently(
    service: OrderService,
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: redis.Redis,
) -> None:
    user, limit, creators, attempts, payers = "busy", 3, 32, 6, 2
    barrier = threading.Barrier(creators + payers, timeout=30)
    creators_done = threading.Event()
    created: list[str] = []
    refused = 0
    paid: dict[str, str] = {}  # order id -> payment ref of the mark_paid call that won
    lost_pay_races = 0
    lock = threading.Lock()

    def creator(own: OrderService) -> Callable[[], None]:
        def run() -> None:
            nonlocal refused
            barrier.wait()
            for _ in range(attempts):
                try:
                    order = own.create_unpaid_order(user, limit=limit)
                except UnpaidOrderLimitReached:
                    with lock:
                        refused += 1
                else:
                    with lock:
                        created.append(order.id)

        return run

    def payer(number: int, own: OrderService) -> Callable[[], None]:
        def run() -> None:
            nonlocal lost_pay_races
            barrier.wait()
            while not creators_done.is_set():
                for order in own.list_unpaid(user):
                    ref = f"payer{number}-{order.id}"
                    try:
                        result = own.mark_paid(order.id, payment_ref=ref)
                    except OrderAlreadyPaid:
                        with lock:
                            lost_pay_races += 1
                    else:
                        assert result.status is OrderStatus.PAID
                        assert result.payment_ref == ref
                        with lock:
                            assert order.id not in paid
                            paid[order.id] = ref

        return run

    creator_targets = [creator(service if n % 2 else make_service()) for n in range(creators)]
    creator_threads_done = threading.Barrier(creators, action=creators_done.set, timeout=60)

    def creator_then_signal(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            finally:
                creator_threads_done.wait()

        return run

    targets = [creator_then_signal(t) for t in creator_targets]
    targets += [payer(n, service if n == 0 else make_service()) for n in range(payers)]
    key = service.index.key(user)
    with LimitMonitor(
        engine, redis_client, key, user, limit=limit, clock=service.clock, pause_s=0
    ) as monitor:
        run_threads(targets)

    still_unpaid = sql_unpaid_ids(engine, user)
    sql_paid = sql_orders(engine, user_id=user, status=OrderStatus.PAID.value)
    assert len(created) == len(set(created))
    assert len(created) + refused == creators * attempts
    assert len(created) == len(paid) + len(still_unpaid)
    assert set(created) == set(paid) | still_unpaid
    assert set(sql_paid) == set(paid)
    assert {oid: row.payment_ref for oid, row in sql_paid.items()} == paid
    assert len(sql_orders(engine, user_id=user)) == len(created)
    members = service.index.members(user)
    assert set(members) == still_unpaid
    assert not set(members) & set(paid)
    assert len(still_unpaid) <= limit
    assert monitor.samples > 0, "the monitor took no sample"
    assert monitor.violations == [], monitor.violations[:5]
    assert monitor.max_unpaid <= limit
    assert monitor.max_zcard <= limit
    events = sql_events(engine)
    for oid in paid:
        # The payment that won, then one refusal (a refund owed) per payer that lost.
        assert events[oid][:2] == ["created", "paid"]
        assert set(events[oid][2:]) <= {"payment_refused"}
    assert sum(kinds.count("payment_refused") for kinds in events.values()) == lost_pay_races
    for oid in still_unpaid:
        assert events[oid] == ["created"]


def test_sql_guard_refuses_everyone_when_redis_lost_its_members_and_leaves_no_phantom(
    service: OrderService,
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: redis.Redis,
) -> None:
    user, limit, threads = "amnesia", 3, 16
    first = [service.create_unpaid_order(user, limit=limit) for _ in range(limit)]
    redis_client.flushdb()  # Redis forgets everything; SQL still holds three unpaid orders
    creators = [service if n % 2 else make_service() for n in range(threads)]
    creates = [functools.partial(own.create_unpaid_order, user, limit=limit) for own in creators]
    outcomes = at_once(creates, UnpaidOrderLimitReached)

    assert len(outcomes) == threads
    assert all(isinstance(o, UnpaidOrderLimitReached) for o in outcomes), outcomes
    assert all(o.limit == limit for o in outcomes if isinstance(o, UnpaidOrderLimitReached))
    assert sql_unpaid_ids(engine, user) == {o.id for o in first}
    assert len(sql_orders(engine, user_id=user)) == limit
    # No phantom of any refused create: the index holds exactly the members Redis had lost,
    # written back from SQL by the first refusal.
    assert service.index.members(user) == {o.id: o.expires_at_ms for o in first}


# --- payment against the sweep ------------------------------------------------------------


def pay_and_sweep_at_once(
    payments: list[tuple[OrderService, str, str]], sweeps: list[Callable[[], SweepResult]]
) -> tuple[dict[str, object], list[int]]:
    """Each payment (service, order id, reference) and each sweep :func:`at_once`: what each
    payment gave (the order, or its OrderClosed), and how many orders each sweep closed."""
    pays = [functools.partial(own.mark_paid, oid, payment_ref=ref) for own, oid, ref in payments]
    outcomes = at_once([*pays, *sweeps], OrderClosed)
    paid = {oid: outcome for (_, oid, _), outcome in zip(payments, outcomes, strict=False)}
    return paid, [cast(SweepResult, swept).closed for swept in outcomes[len(payments) :]]


# "combined": the payments of one service share transactions (Settings.combine_transitions,
# SQLite only), racing the sweepers as the single ones do.
@pytest.mark.parametrize("transitions", ["single", "combined"])
def test_concurrent_pay_and_sweep_give_each_expired_order_exactly_one_fate(
    make_service: Callable[..., OrderService],
    engine: Engine,
    clock: ManualClock,
    transitions: str,
) -> None:
    if transitions == "combined" and engine.dialect.name != "sqlite":
        pytest.skip("transitions are combined on SQLite only")
    service = make_service(combine_transitions=transitions == "combined")
    users, per_user, ttl_s, sweepers = 10, 5, 30, 3
    orders = [
        service.create_unpaid_order(f"payer-{u}", limit=per_user, ttl_s=ttl_s)
        for u in range(users)
        for _ in range(per_user)
    ]
    assert len({o.expires_at_ms for o in orders}) == 1  # all expire at the same instant
    assert all(len(service.index.members(f"payer-{u}")) == per_user for u in range(users))
    clock.advance(s=ttl_s, ms=1)

    payments = [
        (service if n % 2 else make_service(), o.id, f"psp-{o.id}") for n, o in enumerate(orders)
    ]
    sweeps = [
        functools.partial(make_service().sweep_expired, batch_size=4) for _ in range(sweepers)
    ]
    pay_results, sweep_results = pay_and_sweep_at_once(payments, sweeps)
    if transitions == "combined":  # every payment of ``service`` went through its queue
        queue = service.transitions.queue
        assert queue is not None
        stats = queue.stats
        assert stats.calls == len(orders) // 2, stats
        print(f"\n[combined transitions] {stats}")

    rows = sql_orders(engine)
    events = sql_events(engine)
    assert set(rows) == {o.id for o in orders}
    assert len(pay_results) == len(orders)
    closed_ids = set()
    for oid, outcome in pay_results.items():
        row = rows[oid]
        if isinstance(outcome, OrderClosed):
            assert outcome.status == OrderStatus.CLOSED.value
            assert row.status == OrderStatus.CLOSED.value
            assert row.close_reason == "expired"
            assert row.paid_at_ms is None
            assert row.payment_ref is None
            # The refused payment is a refund owed, recorded before the caller heard of it.
            assert events[oid] == ["created", "closed", "payment_refused"]
            assert outcome.refusal is not None
            closed_ids.add(oid)
        else:
            assert getattr(outcome, "status", None) is OrderStatus.PAID
            assert row.status == OrderStatus.PAID.value
            assert row.payment_ref == f"psp-{oid}"
            assert row.closed_at_ms is None
            assert events[oid] == ["created", "paid"]
    assert sum(sweep_results) == len(closed_ids)  # no order closed twice, none skipped
    for u in range(users):
        assert service.index.members(f"payer-{u}") == {}
        assert service.list_unpaid(f"payer-{u}") == []


@pytest.mark.parametrize("transitions", ["single", "combined"])
def test_strict_expiry_late_payments_racing_the_sweep_close_each_order_exactly_once(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock, transitions: str
) -> None:
    if transitions == "combined" and engine.dialect.name != "sqlite":
        pytest.skip("transitions are combined on SQLite only")
    strict = make_service(strict_expiry=True, combine_transitions=transitions == "combined")
    users, per_user, ttl_s, sweepers = 5, 6, 30, 2
    orders = [
        strict.create_unpaid_order(f"late-{u}", limit=per_user, ttl_s=ttl_s)
        for u in range(users)
        for _ in range(per_user)
    ]
    clock.advance(s=ttl_s)  # now == expires_at: expired (an order counts while expires > now)

    pay_results, sweep_results = pay_and_sweep_at_once(
        [(strict, o.id, f"late-{o.id}") for o in orders],
        # Each sweeper builds its service in its thread, after the release.
        [lambda: make_service(strict_expiry=True).sweep_expired(batch_size=3)] * sweepers,
    )
    queue = strict.transitions.queue
    if queue is not None:  # every payment went through the queue of combined transitions
        assert queue.stats.calls == len(orders)
        print(f"\n[combined transitions] {queue.stats}")

    rows = sql_orders(engine)
    events = sql_events(engine)
    assert all(isinstance(pay_results[o.id], OrderClosed) for o in orders), pay_results
    assert all(rows[o.id].status == OrderStatus.CLOSED.value for o in orders)
    assert all(rows[o.id].payment_ref is None for o in orders)
    assert all(events[o.id] == ["created", "closed", "payment_refused"] for o in orders)
    with engine.connect() as conn:
        close_events = conn.execute(select(EC.order_id, EC.data).where(EC.kind == "closed")).all()
    # A close is either the sweep's (no data) or a refused late payment's, which records
    # exactly what a refund needs to find: the reference the caller sent.
    late = [e for e in close_events if e.data is not None]
    assert all(
        e.data == {"trigger": "late_payment", "payment_ref": f"late-{e.order_id}"} for e in late
    ), [e.data for e in late]
    closed_by_late_payment = len(late)
    assert len(close_events) == len(orders)
    assert closed_by_late_payment + sum(sweep_results) == len(orders)  # nobody closed twice
    for u in range(users):
        assert strict.index.members(f"late-{u}") == {}


# --- idempotent creates -------------------------------------------------------------------


ROUNDS = 10


def create_same_order_at_once(services: list[OrderService], user: str, order_id: str) -> list[Any]:
    """Every service creates ``order_id`` for ``user``, all :func:`at_once`."""
    order = {"order_id": order_id, "amount": "9.90", "currency": "EUR"}
    return at_once([functools.partial(svc.create_unpaid_order, user, **order) for svc in services])


def test_threads_creating_the_same_order_id_at_once_get_one_order_in_both_stores(
    service: OrderService, make_service: Callable[..., OrderService], engine: Engine
) -> None:
    """Eight threads, one caller-supplied id; repeated a few rounds to catch the interleavings."""
    threads = 8
    services = [service if n % 2 else make_service() for n in range(threads)]
    for round_number in range(ROUNDS):
        user, order_id = f"twin-{round_number}", f"checkout-{round_number}"
        results = create_same_order_at_once(services, user, order_id)

        assert len(results) == threads
        assert {o.id for o in results} == {order_id}
        assert {o.user_id for o in results} == {user}
        assert len({o.expires_at_ms for o in results}) == 1
        assert len({o.created_at_ms for o in results}) == 1
        rows = sql_orders(engine, user_id=user)
        assert set(rows) == {order_id}
        assert rows[order_id].expires_at_ms == results[0].expires_at_ms
        assert sql_events(engine)[order_id] == ["created"]
        assert service.index.members(user) == {order_id: results[0].expires_at_ms}, (
            f"round {round_number}: the order is unpaid in SQL but its Redis member is gone"
        )


def test_twin_create_that_inserts_first_does_not_cost_the_order_its_redis_member(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    """The admitted create loses the SQL insert to its twin: the member must stay.

    Interleaving forced with a pausing index: A is admitted by Redis and pauses
    before its insert; B (same order id) finds the member (``exists``), inserts the row and
    returns; then A's insert hits the primary key and A returns the same order. The order
    is unpaid in SQL, so it must still count in Redis.
    """
    user, order_id = "twin", "checkout-forced"
    a_admitted, b_done = threading.Event(), threading.Event()

    def pause_after_admit(_user: str, _order: str) -> None:
        a_admitted.set()
        assert b_done.wait(30), "the twin did not finish"

    first = pausing_after_admit(make_service(), pause_after_admit)
    second = make_service()
    results: dict[str, Any] = {}

    def run_a() -> None:
        results["a"] = first.create_unpaid_order(user, order_id=order_id)

    def run_b() -> None:
        assert a_admitted.wait(30), "A was never admitted"
        try:
            results["b"] = second.create_unpaid_order(user, order_id=order_id)
        finally:
            b_done.set()

    run_threads([run_a, run_b])

    assert results["a"].id == results["b"].id == order_id
    assert results["a"].expires_at_ms == results["b"].expires_at_ms
    rows = sql_orders(engine, user_id=user)
    assert set(rows) == {order_id}
    assert rows[order_id].status == OrderStatus.UNPAID.value
    assert sql_events(engine) == {order_id: ["created"]}
    assert first.index.members(user) == {order_id: rows[order_id].expires_at_ms}


# --- precision ----------------------------------------------------------------------------


def test_index_keeps_the_largest_exact_score_to_the_millisecond(service: OrderService) -> None:
    top = 2**53 - 1
    admitted = service.index.admit(
        AdmitRequest("edge", "o-top", expires_at_ms=top, now_ms=1, limit=3)
    )

    assert admitted.score_ms == top
    assert service.index.members("edge") == {"o-top": top}
    raw = service.index.client.zscore(service.index.key("edge"), "o-top")
    assert raw is not None
    assert int(raw) == top
    assert service.index.client.pttl(service.index.key("edge")) == -1  # no key expiry


def test_service_accepts_expiry_at_two_to_the_53_minus_one_and_refuses_one_ms_more(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    clock.set(MAX_TIMESTAMP_MS - 1000)
    order = service.create_unpaid_order("edge", ttl_s=1)

    assert order.expires_at_ms == MAX_TIMESTAMP_MS == 2**53 - 1
    assert sql_orders(engine)[order.id].expires_at_ms == MAX_TIMESTAMP_MS
    assert service.index.members("edge") == {order.id: MAX_TIMESTAMP_MS}

    with pytest.raises(InvalidInput) as refused:
        service.create_unpaid_order("edge", ttl_s=1.001)
    assert refused.value.field == "ttl_s"
    assert set(sql_orders(engine)) == {order.id}
    assert set(service.index.members("edge")) == {order.id}


@pytest.mark.parametrize("ttl_s", [0.001, 1234.567])
def test_sql_expiry_and_redis_score_are_the_same_integer(
    service: OrderService, engine: Engine, clock: ManualClock, ttl_s: float
) -> None:
    now = clock()
    order = service.create_unpaid_order("scores", ttl_s=ttl_s)

    expected = now + round(ttl_s * 1000)
    sql_value = sql_orders(engine)[order.id].expires_at_ms
    score = service.index.members("scores")[order.id]
    assert type(sql_value) is int
    assert type(score) is int
    assert sql_value == score == order.expires_at_ms == expected


def test_eighteen_digit_order_ids_stay_exact_members_and_sql_ids(
    service: OrderService, engine: Engine
) -> None:
    user = 123456789012345678  # an int user id becomes its decimal string
    ids = ["123456789012345678", "123456789012345679", "999999999999999999"]
    orders = [service.create_unpaid_order(user, order_id=oid) for oid in ids]

    assert [o.id for o in orders] == ids
    assert {o.user_id for o in orders} == {str(user)}
    rows = sql_orders(engine, user_id=str(user))
    assert set(rows) == set(ids)
    members = service.index.members(str(user))
    assert set(members) == set(ids)
    assert len(members) == 3  # ids one apart are two members, not one rounded score
    assert all(members[oid] == rows[oid].expires_at_ms for oid in ids)
    assert Counter(service.index.client.zrange(service.index.key(str(user)), 0, -1)) == Counter(
        oid.encode() for oid in ids
    )
