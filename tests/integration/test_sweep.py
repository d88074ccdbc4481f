"""sweep_expired against a real Redis and SQLite: what it closes, in what order, and how it
behaves when a batch fails, Redis is gone, or several sweepers run at once.

SQL (rows and ``order_events``) is checked for every outcome, and the users' sorted sets in
Redis where the sweep is meant to clean them. Time moves only through ``clock``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, event, select
from sqlalchemy.exc import OperationalError

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import Order, SweepResult
from orders.errors import InvalidInput, StoreUnavailable
from orders.index.nodes import group_by_node
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.stores import (
    RoundTripCounter,
    closed_event_counts,
    create_orders,
    keys_but_admissions,
    refuse_inserts,
    sql_rows,
)

#: The contract holds on one Redis server and on a Redis Cluster alike.
pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]

MISSING_SOCKET_URL = "unix:///tmp/definitely-missing.sock"
#: Where a test makes a batch's statement fail. SQLite: after it ran, inside the batch's
#: transaction, which must roll back. PostgreSQL: before it runs, since the batch is one
#: statement in autocommit, committed once it has run (a statement that fails on the
#: server rolls back by itself: test_a_constraint_refusing_a_transition_...).
FAILURE_POINT = {"sqlite": "after_cursor_execute", "postgresql": "before_cursor_execute"}


# --- helpers ---------------------------------------------------------------------------------


def closed_events(engine: Engine) -> list[Any]:
    query = select(events_table).where(events_table.c.kind == "closed")
    with engine.connect() as conn:
        return list(conn.execute(query.order_by(events_table.c.id)).all())


def ids_with_status(engine: Engine, status: str) -> set[str]:
    return {oid for oid, row in sql_rows(engine).items() if row.status == status}


def by_expiry(orders: Sequence[Order]) -> list[Order]:
    return sorted(orders, key=lambda o: o.expires_at_ms)


def service_without_redis(engine: Engine, clock: ManualClock) -> OrderService:
    settings = Settings(redis_url=MISSING_SOCKET_URL)
    return OrderService(engine, build_redis(settings), settings, clock=clock)


# --- what the sweep closes -------------------------------------------------------------------


def test_sweep_closes_orders_due_at_or_before_now_and_keeps_later_ones(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    start = clock()
    due_exactly_now = service.create_unpaid_order("u1", ttl_s=10)
    due_earlier = service.create_unpaid_order("u2", ttl_s=5)
    clock.advance(ms=1)
    due_in_one_ms = service.create_unpaid_order("u1", ttl_s=10)
    far_off = service.create_unpaid_order("u2", ttl_s=100)
    now = start + 10_000
    clock.set(now)
    assert due_exactly_now.expires_at_ms == now
    assert due_in_one_ms.expires_at_ms == now + 1

    result = service.sweep_expired()

    assert (result.closed, result.batches, result.users) == (2, 1, 2)
    assert result.cutoff_ms == now
    rows = sql_rows(engine)
    for order in (due_exactly_now, due_earlier):
        row = rows[order.id]
        assert (row.status, row.close_reason, row.closed_at_ms) == ("closed", "expired", now)
        assert row.paid_at_ms is None
    for order in (due_in_one_ms, far_off):
        assert rows[order.id].status == "unpaid"
        assert rows[order.id].closed_at_ms is None
    events = closed_events(engine)
    assert sorted(e.order_id for e in events) == sorted([due_exactly_now.id, due_earlier.id])
    assert {e.at_ms for e in events} == {now}
    assert {e.order_id: e.user_id for e in events} == {
        due_exactly_now.id: "u1",
        due_earlier.id: "u2",
    }
    assert service.index.members("u1") == {due_in_one_ms.id: due_in_one_ms.expires_at_ms}
    assert service.index.members("u2") == {far_off.id: far_off.expires_at_ms}


def test_sweep_closes_ten_due_orders_in_four_batches_of_three(
    service: OrderService, engine: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    orders = create_orders(service, [7, 3, 9, 1, 5, 10, 2, 8, 4, 6], users=["a", "b", "c"])
    clock.advance(s=10)

    result = service.sweep_expired(batch_size=3)

    assert (result.closed, result.batches, result.users) == (10, 4, 3)
    assert ids_with_status(engine, "closed") == {o.id for o in orders}
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})
    assert keys_but_admissions(redis_client, service.settings.admission_window_ms) == []


def test_sweep_closes_orders_in_expiry_order_one_batch_at_a_time(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    # Created in an order that differs from their expiry order (and from their id order).
    orders = create_orders(service, [7, 3, 9, 1, 5, 10, 2, 8, 4, 6], users=["a", "b", "c"])
    clock.advance(s=10)
    expected = by_expiry(orders)

    closed_so_far: set[str] = set()
    for start in range(0, 9, 3):
        result = service.sweep_expired(batch_size=3, max_batches=1)
        assert (result.closed, result.batches) == (3, 1)
        closed_so_far |= {o.id for o in expected[start : start + 3]}
        assert ids_with_status(engine, "closed") == closed_so_far
        assert ids_with_status(engine, "unpaid") == {o.id for o in expected[start + 3 :]}


def test_second_sweep_closes_nothing_and_records_no_new_event(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = create_orders(service, [1, 2, 3], users=["a", "b"])
    clock.advance(s=5)
    assert service.sweep_expired().closed == 3
    events_after_first = closed_events(engine)
    rows_after_first = sql_rows(engine)
    clock.advance(s=5)

    again = service.sweep_expired()

    assert (again.closed, again.batches, again.users, again.max_lag_ms) == (0, 0, 0, None)
    assert closed_events(engine) == events_after_first
    assert sql_rows(engine) == rows_after_first
    assert all(rows_after_first[o.id].status == "closed" for o in orders)


def test_sweep_never_touches_paid_or_cancelled_orders(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    paid, cancelled, expiring = create_orders(service, [10, 10, 10])
    clock.advance(s=1)
    service.mark_paid(paid.id, payment_ref="psp-1")
    cancel_at = clock.advance(s=1)
    service.cancel_order(cancelled.id)
    before = sql_rows(engine)
    sweep_at = clock.advance(s=60)

    result = service.sweep_expired()

    assert result.closed == 1
    rows = sql_rows(engine)
    assert rows[paid.id] == before[paid.id]
    assert rows[paid.id].status == "paid"
    assert rows[paid.id].closed_at_ms is None
    assert rows[cancelled.id] == before[cancelled.id]
    assert (rows[cancelled.id].status, rows[cancelled.id].closed_at_ms) == ("cancelled", cancel_at)
    assert rows[expiring.id].status == "closed"
    assert rows[expiring.id].closed_at_ms == sweep_at
    assert closed_event_counts(engine) == Counter({expiring.id: 1})


# --- the now_ms argument ---------------------------------------------------------------------


def test_sweep_with_a_past_cutoff_closes_only_orders_due_by_then(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    first, second, third = create_orders(service, [1, 2, 3])
    now = clock.advance(s=5)

    result = service.sweep_expired(now_ms=second.expires_at_ms)

    assert result.closed == 2
    assert result.cutoff_ms == second.expires_at_ms
    rows = sql_rows(engine)
    assert rows[first.id].status == rows[second.id].status == "closed"
    assert rows[first.id].closed_at_ms == now
    assert rows[third.id].status == "unpaid"
    assert closed_event_counts(engine) == Counter({first.id: 1, second.id: 1})
    # The cleanup uses the cutoff too: the third (expired by now, not by the cutoff) stays.
    assert service.index.members("u1") == {third.id: third.expires_at_ms}


def test_sweep_with_a_cutoff_ahead_of_the_clock_raises_and_closes_nothing(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = create_orders(service, [1, 2])
    now = clock.advance(s=5)
    before_rows = sql_rows(engine)
    before_members = service.index.members("u1")

    with pytest.raises(InvalidInput) as caught:
        service.sweep_expired(now_ms=now + 1)

    assert caught.value.field == "now_ms"
    assert sql_rows(engine) == before_rows
    assert all(before_rows[o.id].status == "unpaid" for o in orders)
    assert closed_events(engine) == []
    assert service.index.members("u1") == before_members


# --- failures --------------------------------------------------------------------------------


def test_batch_that_fails_midway_leaves_its_orders_unpaid_for_the_next_sweep(
    service: OrderService, engine: Engine, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    orders = by_expiry(create_orders(service, [1, 2, 3, 4, 5, 6, 7], users=["a", "b"]))
    clock.advance(s=10)
    calls = 0

    def fail_after_second_close(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        nonlocal calls
        if f"UPDATE {orders_table.name} SET status" not in statement:
            return
        calls += 1
        if calls == 2:
            # SQLite: the batch's UPDATE has run in its transaction, which must roll back.
            raise OperationalError(statement[:40], {}, Exception("disk I/O error"))

    event.listen(engine, FAILURE_POINT[engine.dialect.name], fail_after_second_close)

    with pytest.raises(StoreUnavailable) as caught:
        service.sweep_expired(batch_size=3)

    assert caught.value.store == "sql"
    first_batch = {o.id for o in orders[:3]}
    rest = {o.id for o in orders[3:]}
    assert ids_with_status(engine, "closed") == first_batch
    assert ids_with_status(engine, "unpaid") == rest
    rows = sql_rows(engine)
    assert all(rows[oid].closed_at_ms is None for oid in rest)
    assert closed_event_counts(engine) == Counter(dict.fromkeys(first_batch, 1))

    event.remove(engine, FAILURE_POINT[engine.dialect.name], fail_after_second_close)
    result = service.sweep_expired(batch_size=3)

    assert result.closed == len(rest)
    assert ids_with_status(engine, "closed") == first_batch | rest
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})


def test_batch_whose_event_insert_fails_leaves_its_orders_unpaid(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    # The closes and their events are one transaction (an outbox): a batch whose events
    # cannot be written must not close anything, or a consumer would never hear of it.
    orders = create_orders(service, [1, 2, 3], users=["a", "b"])
    clock.advance(s=10)

    def fail_on_closed_events(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        # PostgreSQL writes them in the closing statement itself; SQLite in one of its own.
        if f"INSERT INTO {events_table.name}" in statement:
            raise OperationalError(statement[:40], {}, Exception("disk I/O error"))

    event.listen(engine, FAILURE_POINT[engine.dialect.name], fail_on_closed_events)
    try:
        with pytest.raises(StoreUnavailable):
            service.sweep_expired()
    finally:
        event.remove(engine, FAILURE_POINT[engine.dialect.name], fail_on_closed_events)

    assert ids_with_status(engine, "unpaid") == {o.id for o in orders}
    assert closed_events(engine) == []
    assert service.sweep_expired().closed == len(orders)
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})


@pytest.mark.parametrize("action", ["sweep", "pay", "cancel", "extend"])
def test_a_constraint_refusing_a_transition_is_a_store_failure_and_changes_nothing(
    service: OrderService, engine: Engine, clock: ManualClock, action: str
) -> None:
    """A check or trigger refusing the event row (an IntegrityError from the driver) must
    reach the caller as StoreUnavailable, never as a SQLAlchemy exception, and the
    transition must not commit without its event (on PostgreSQL both are one statement)."""
    order = create_orders(service, [1])[0]
    refuse_inserts(engine, events_table.name, "check constraint failed")
    if action == "sweep":
        clock.advance(s=10)
    run = {
        "sweep": service.sweep_expired,
        "pay": lambda: service.mark_paid(order.id),
        "cancel": lambda: service.cancel_order(order.id),
        "extend": lambda: service.extend_order(order.id, 5),
    }[action]

    with pytest.raises(StoreUnavailable):
        run()

    row = sql_rows(engine)[order.id]
    assert (row.status, row.expires_at_ms) == ("unpaid", order.expires_at_ms)
    with engine.connect() as conn:
        kinds = conn.execute(select(events_table.c.kind)).scalars().all()
    assert kinds == ["created"]


def test_sweep_with_redis_down_closes_everything_in_sql_and_counts_redis_errors(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = create_orders(service, [1, 2, 3, 4, 5], users=["a", "b"])
    now = clock.advance(s=10)
    broken = service_without_redis(engine, clock)

    result = broken.sweep_expired(batch_size=2)

    assert result.closed == 5
    assert result.batches == 3
    # One failed cleanup is counted; later batches do not try again (and wait again).
    assert result.redis_errors == 1
    rows = sql_rows(engine)
    assert all(rows[o.id].status == "closed" for o in orders)
    assert all(rows[o.id].closed_at_ms == now for o in orders)
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})
    # The members stay behind, already expired by score: the admit script drops them.
    assert set(service.index.members("a")) == {o.id for o in orders if o.user_id == "a"}
    newer = service.create_unpaid_order("a", ttl_s=60, limit=1)
    assert service.index.members("a") == {newer.id: newer.expires_at_ms}


def test_sweep_cleanup_meeting_a_key_of_another_type_counts_an_error_and_cleans_the_rest(
    service: OrderService, engine: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    orders = create_orders(service, [1, 2, 3], users=["a", "b", "c"])
    clock.advance(s=10)
    redis_client.delete(service.index.key("b"))
    redis_client.set(service.index.key("b"), "not a sorted set")

    result = service.sweep_expired()

    assert (result.closed, result.redis_errors) == (3, 1)
    assert ids_with_status(engine, "closed") == {o.id for o in orders}
    # Every user's command ran: the error reply of one did not stop the others.
    assert redis_client.exists(service.index.key("a"), service.index.key("c")) == 0


def test_sweep_cleans_each_batch_in_one_redis_round_trip(
    service: OrderService, clock: ManualClock, redis_round_trips: RoundTripCounter
) -> None:
    users = [f"u{i}" for i in range(10)]
    create_orders(service, list(range(1, 11)), users=users)
    clock.advance(s=20)
    trips_before = redis_round_trips.count

    result = service.sweep_expired(batch_size=5)

    assert (result.closed, result.batches, result.redis_errors) == (10, 2, 0)
    # One round trip per batch, to each node holding one of its users' keys (one server:
    # 1 per batch; a cluster: the batch is grouped by node).
    batches = [users[:5], users[5:]]  # the orders fall due in this order
    nodes = [
        len(group_by_node(service.index.client, [service.index.key(u).encode() for u in batch]))
        for batch in batches
    ]
    assert redis_round_trips.count - trips_before == sum(nodes)


def test_a_failing_batch_raises_only_after_the_previous_batch_cleanup_finished(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The cleanup of a committed batch is done before the next batch's failure reaches the
    # caller: nothing of the sweep runs on after it was told (a slow Redis shows it).
    orders = by_expiry(create_orders(service, [1, 2, 3, 4], users=["a", "b", "c", "d"]))
    clock.advance(s=10)
    finished: list[bool] = []
    drop_expired = service.index.drop_expired

    def slow_drop_expired(user_ids: Any, now_ms: int) -> None:
        threading.Event().wait(0.3)  # a slow Redis
        drop_expired(user_ids, now_ms)
        finished.append(True)

    monkeypatch.setattr(service.index, "drop_expired", slow_drop_expired)
    closes = 0

    def fail_second_close(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        nonlocal closes
        if f"UPDATE {orders_table.name} SET status" in statement:
            closes += 1
            if closes == 2:
                raise OperationalError(statement[:40], {}, Exception("disk I/O error"))

    event.listen(engine, FAILURE_POINT[engine.dialect.name], fail_second_close)
    try:
        with pytest.raises(StoreUnavailable):
            service.sweep_expired(batch_size=2)
        assert finished == [True]
    finally:
        event.remove(engine, FAILURE_POINT[engine.dialect.name], fail_second_close)

    assert ids_with_status(engine, "closed") == {o.id for o in orders[:2]}
    assert redis_client.exists(*(service.index.key(o.user_id) for o in orders[:2])) == 0
    assert ids_with_status(engine, "unpaid") == {o.id for o in orders[2:]}


# --- concurrency -----------------------------------------------------------------------------


def test_four_concurrent_sweepers_close_each_of_200_orders_exactly_once(
    service: OrderService,
    engine: Engine,
    redis_client: redis.Redis,
    clock: ManualClock,
) -> None:
    users = [f"user-{n}" for n in range(20)]
    ttls = [1 + (n * 37 % 200) / 10 for n in range(200)]
    orders = create_orders(service, ttls, users=users)
    clock.advance(s=60)
    sweepers = 4
    barrier = threading.Barrier(sweepers)

    def sweep(worker: OrderService) -> SweepResult:
        barrier.wait(timeout=30)
        return worker.sweep_expired(batch_size=7)

    workers = [
        OrderService(engine, redis_client, service.settings, clock=clock) for _ in range(sweepers)
    ]
    with ThreadPoolExecutor(max_workers=sweepers) as pool:
        results = list(pool.map(sweep, workers, timeout=100))

    assert sum(r.closed for r in results) == 200
    assert all(r.redis_errors == 0 for r in results)
    assert ids_with_status(engine, "closed") == {o.id for o in orders}
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders})
    assert keys_but_admissions(redis_client, service.settings.admission_window_ms) == []


def test_sweep_skips_a_due_order_locked_by_another_transaction(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite has no row locks: a sweep takes the database's write lock")
    locked, *others = create_orders(service, [1, 2, 3], users=["a", "b"])
    clock.advance(s=10)

    # Another transaction (a payment in flight, another sweeper) holds one due row: the
    # sweep closes the others without waiting for it (FOR UPDATE SKIP LOCKED).
    with engine.connect() as holder, ThreadPoolExecutor(max_workers=1) as pool:
        holder.execute(
            select(orders_table.c.id).where(orders_table.c.id == locked.id).with_for_update()
        )
        sweep = pool.submit(service.sweep_expired)
        try:
            result = sweep.result(timeout=10)
        finally:
            holder.rollback()

    assert result.closed == len(others)
    assert ids_with_status(engine, "closed") == {o.id for o in others}
    assert ids_with_status(engine, "unpaid") == {locked.id}
    assert service.sweep_expired().closed == 1
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in [locked, *others]})


# --- result fields and stopping --------------------------------------------------------------


def test_max_lag_is_close_time_minus_the_earliest_expiry_closed(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = create_orders(service, [10, 11, 13], users=["a", "b"])
    earliest = min(o.expires_at_ms for o in orders)
    clock.set(earliest + 2_500)

    result = service.sweep_expired()

    assert result.max_lag_ms == 2_500
    rows = sql_rows(engine)
    closed = [rows[o.id] for o in orders if rows[o.id].status == "closed"]
    assert len(closed) == 2
    assert result.max_lag_ms == max(r.closed_at_ms for r in closed) - min(
        r.expires_at_ms for r in closed
    )


def test_should_stop_after_the_first_batch_leaves_the_rest_unpaid(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = by_expiry(create_orders(service, [1, 2, 3, 4, 5]))
    clock.advance(s=10)
    asked: list[int] = []

    def stop_after_first_batch() -> bool:
        asked.append(len(ids_with_status(engine, "closed")))
        return len(asked) > 1

    result = service.sweep_expired(batch_size=2, should_stop=stop_after_first_batch)

    assert (result.closed, result.batches) == (2, 1)
    assert asked == [0, 2]
    assert ids_with_status(engine, "closed") == {o.id for o in orders[:2]}
    assert ids_with_status(engine, "unpaid") == {o.id for o in orders[2:]}
    assert closed_event_counts(engine) == Counter({o.id: 1 for o in orders[:2]})


def test_should_stop_true_from_the_start_closes_nothing(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    orders = create_orders(service, [1, 2])
    clock.advance(s=10)
    stop: Callable[[], bool] = lambda: True  # noqa: E731

    result = service.sweep_expired(should_stop=stop)

    assert (result.closed, result.batches) == (0, 0)
    assert ids_with_status(engine, "unpaid") == {o.id for o in orders}
    assert closed_events(engine) == []
