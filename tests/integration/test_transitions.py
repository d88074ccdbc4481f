"""mark_paid, cancel_order, get_order and list_unpaid against a real Redis and SQLite.

Every test checks both stores: the SQL row and its ``order_events`` (the record) and the
user's sorted set in Redis (the admission index). Time moves only through ``clock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, event, func, select

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import Order, OrderStatus
from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderNotFound,
    StoreUnavailable,
)
from orders.service import OrderService
from orders.sql.models import events_table, orders_table, refusals_table
from tests.support.clocks import ManualClock
from tests.support.stores import DriverStatements, redis_commands

#: The contract holds on one Redis server and on a Redis Cluster alike.
pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too, pytest.mark.both_apis]

MISSING_SOCKET_URL = "unix:///tmp/definitely-missing.sock"
TTL_S = 60
TTL_MS = TTL_S * 1000


# --- helpers ---------------------------------------------------------------------------------


def sql_row(engine: Engine, order_id: str) -> Any:
    with engine.connect() as conn:
        return conn.execute(select(orders_table).where(orders_table.c.id == order_id)).one_or_none()


def sql_events(engine: Engine, order_id: str, kind: str | None = None) -> list[Any]:
    query = select(events_table).where(events_table.c.order_id == order_id)
    if kind is not None:
        query = query.where(events_table.c.kind == kind)
    with engine.connect() as conn:
        return list(conn.execute(query.order_by(events_table.c.id)).all())


def table_counts(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        orders = conn.execute(select(func.count()).select_from(orders_table)).scalar_one()
        events = conn.execute(select(func.count()).select_from(events_table)).scalar_one()
    return orders, events


def service_without_redis(
    engine: Engine, clock: ManualClock, url: str = MISSING_SOCKET_URL, **overrides: Any
) -> OrderService:
    """An OrderService on the test's SQL database whose Redis cannot be reached."""
    settings = Settings(redis_url=url, **overrides)
    return OrderService(engine, build_redis(settings), settings, clock=clock)


# --- mark_paid -------------------------------------------------------------------------------


def test_mark_paid_moves_unpaid_to_paid_in_sql_and_removes_the_redis_member(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    paid_at = clock.advance(s=5)

    paid = service.mark_paid(order.id, payment_ref="psp-1")

    assert paid.status is OrderStatus.PAID
    assert paid.paid_at_ms == paid_at
    assert paid.payment_ref == "psp-1"
    row = sql_row(engine, order.id)
    assert row.status == "paid"
    assert row.paid_at_ms == paid_at
    assert row.payment_ref == "psp-1"
    assert row.closed_at_ms is None
    paid_events = sql_events(engine, order.id, "paid")
    assert len(paid_events) == 1
    assert paid_events[0].at_ms == paid_at
    assert paid_events[0].user_id == "u1"
    assert paid_events[0].data == {"payment_ref": "psp-1"}
    assert service.index.members("u1") == {}


def test_second_payment_with_same_ref_returns_the_order_without_a_second_event(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    first = service.mark_paid(order.id, payment_ref="psp-1")
    clock.advance(s=3)

    again = service.mark_paid(order.id, payment_ref="psp-1")

    assert again.status is OrderStatus.PAID
    assert again.paid_at_ms == first.paid_at_ms
    assert again.payment_ref == "psp-1"
    assert len(sql_events(engine, order.id, "paid")) == 1
    assert sql_row(engine, order.id).paid_at_ms == first.paid_at_ms


def test_second_payment_without_ref_returns_the_paid_order(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    first = service.mark_paid(order.id, payment_ref="psp-1")

    again = service.mark_paid(order.id)

    assert again.status is OrderStatus.PAID
    assert again.payment_ref == "psp-1"
    assert again.paid_at_ms == first.paid_at_ms
    assert len(sql_events(engine, order.id, "paid")) == 1


def test_second_payment_with_other_ref_raises_already_paid_with_the_stored_ref(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    service.mark_paid(order.id, payment_ref="psp-1")

    with pytest.raises(OrderAlreadyPaid) as caught:
        service.mark_paid(order.id, payment_ref="psp-2")

    assert caught.value.payment_ref == "psp-1"
    assert caught.value.order_id == order.id
    assert sql_row(engine, order.id).payment_ref == "psp-1"
    assert len(sql_events(engine, order.id, "paid")) == 1


@pytest.mark.parametrize("closed_by", ["cancelled", "closed"])
def test_paying_a_cancelled_or_swept_order_raises_order_closed_and_records_the_refusal(
    service: OrderService, engine: Engine, clock: ManualClock, closed_by: str
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    if closed_by == "cancelled":
        service.cancel_order(order.id)
    else:
        clock.advance(s=TTL_S)
        assert service.sweep_expired().closed == 1

    with pytest.raises(OrderClosed) as caught:
        service.mark_paid(order.id, payment_ref="psp-1")

    assert caught.value.status == closed_by
    row = sql_row(engine, order.id)
    assert (row.status, row.paid_at_ms, row.payment_ref) == (closed_by, None, None)
    assert sql_events(engine, order.id, "paid") == []
    # A refund owed, under the reason the order's end gives (the status's name).
    with engine.connect() as conn:
        [refusal] = conn.execute(select(refusals_table)).all()
    assert (refusal.reason, refusal.payment_ref, refusal.amount) == (closed_by, "psp-1", None)


def test_late_payment_before_sweep_wins_and_the_sweep_leaves_it_paid(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    paid_at = clock.advance(s=TTL_S + 10)

    paid = service.mark_paid(order.id, payment_ref="psp-late")

    assert paid.status is OrderStatus.PAID
    assert paid.paid_at_ms == paid_at
    assert service.index.members("u1") == {}
    clock.advance(s=1)
    result = service.sweep_expired()
    assert result.closed == 0
    row = sql_row(engine, order.id)
    assert row.status == "paid"
    assert row.closed_at_ms is None
    assert sql_events(engine, order.id, "closed") == []


def test_strict_expiry_refuses_a_late_payment_and_closes_the_order(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(strict_expiry=True)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    late = clock.advance(s=TTL_S + 1)

    with pytest.raises(OrderClosed) as caught:
        service.mark_paid(order.id, payment_ref="psp-late")

    assert caught.value.status == "closed"
    row = sql_row(engine, order.id)
    assert row.status == "closed"
    assert row.close_reason == "expired"
    assert row.closed_at_ms == late
    assert row.paid_at_ms is None
    assert row.payment_ref is None
    closed_events = sql_events(engine, order.id, "closed")
    assert len(closed_events) == 1
    assert closed_events[0].at_ms == late
    # The refused payment's reference is recorded with the close, so a refund can find it.
    assert closed_events[0].data == {"trigger": "late_payment", "payment_ref": "psp-late"}
    assert sql_events(engine, order.id, "paid") == []
    assert service.index.members("u1") == {}
    assert service.sweep_expired().closed == 0


def test_strict_expiry_refuses_a_payment_at_exactly_expires_at(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(strict_expiry=True)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    clock.set(order.expires_at_ms)

    with pytest.raises(OrderClosed):
        service.mark_paid(order.id)

    assert sql_row(engine, order.id).status == "closed"


def test_strict_expiry_accepts_a_payment_one_ms_before_expiry(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(strict_expiry=True)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    clock.set(order.expires_at_ms - 1)

    paid = service.mark_paid(order.id, payment_ref="psp-1")

    assert paid.status is OrderStatus.PAID
    assert sql_row(engine, order.id).status == "paid"
    assert len(sql_events(engine, order.id, "paid")) == 1
    assert sql_events(engine, order.id, "closed") == []
    assert service.index.members("u1") == {}


def test_strict_expiry_repeat_payment_after_expiry_returns_the_paid_order_and_closes_nothing(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    # The provider repeats its callback after the expiry: the refused-payment close applies
    # to unpaid orders only, never to one this very payment already paid.
    service = make_service(strict_expiry=True)
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    paid = service.mark_paid(order.id, payment_ref="psp-1")
    clock.advance(s=TTL_S + 1)

    again = service.mark_paid(order.id, payment_ref="psp-1")

    assert again.status is OrderStatus.PAID
    assert again.paid_at_ms == paid.paid_at_ms
    row = sql_row(engine, order.id)
    assert (row.status, row.closed_at_ms, row.close_reason) == ("paid", None, None)
    assert len(sql_events(engine, order.id, "paid")) == 1
    assert sql_events(engine, order.id, "closed") == []


def test_successful_payment_costs_one_sql_transaction_and_one_redis_command(
    service: OrderService,
    engine: Engine,
    redis_client: redis.Redis,
    redis_nodes: int,
) -> None:
    order = service.create_unpaid_order("u1")
    commits: list[object] = []

    def on_commit(conn: object) -> None:
        commits.append(conn)

    event.listen(engine, "commit", on_commit)
    # At the driver: the transition goes straight to it, unseen by cursor events.
    try:
        with DriverStatements() as sent:
            before = redis_commands(redis_client)
            service.mark_paid(order.id, payment_ref="psp-1")
            after = redis_commands(redis_client)
    finally:
        event.remove(engine, "commit", on_commit)

    statements = sent.statements
    writes = [s.split()[0] for s in statements]
    if engine.dialect.name == "sqlite":
        # BEGIN IMMEDIATE takes the write lock.
        assert writes == ["BEGIN", "UPDATE", "INSERT", "COMMIT"]
        assert statements[0] == "BEGIN IMMEDIATE"
        assert len(commits) == 1
    else:
        # One statement in autocommit: the compare-and-set and its event, one transaction.
        assert writes == ["WITH"]
        assert " ".join(statements[0].split()).startswith(
            f"WITH changed AS (UPDATE {orders_table.name}"
        )
        assert f"INSERT INTO {events_table.name}" in statements[0]
        assert sent.autocommit == [True]  # SQLAlchemy's commit() then sends nothing
    # One ZREM, plus the second INFO call itself (on each node).
    assert after - before == 1 + redis_nodes
    assert service.index.members("u1") == {}


REFUSE_EVENTS = {
    "sqlite": [
        f"CREATE TRIGGER refuse_events BEFORE INSERT ON {events_table.name} "
        "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
        f"CREATE TRIGGER refuse_events BEFORE INSERT ON {events_table.name} "
        "FOR EACH ROW EXECUTE FUNCTION refuse_events()",
    ],
}


@pytest.mark.parametrize("call", ["mark_paid", "cancel_order"])
def test_a_transition_the_database_refuses_raises_store_unavailable_and_changes_nothing(
    service: OrderService, engine: Engine, call: str
) -> None:
    """The transition goes straight to the driver: its error still leaves typed."""
    order = service.create_unpaid_order("u1")
    with engine.begin() as conn:
        for statement in REFUSE_EVENTS[engine.dialect.name]:
            conn.exec_driver_sql(statement)

    with pytest.raises(StoreUnavailable) as caught:
        getattr(service, call)(order.id)

    assert caught.value.store == "sql"
    assert sql_row(engine, order.id).status == "unpaid"
    assert service.index.members("u1") == {order.id: order.expires_at_ms}


# --- Redis unreachable -------------------------------------------------------------------------


def test_payment_succeeds_when_redis_is_down_and_the_stale_member_expires_by_score(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    broken = service_without_redis(engine, clock)

    paid = broken.mark_paid(order.id, payment_ref="psp-1")

    assert paid.status is OrderStatus.PAID
    assert sql_row(engine, order.id).status == "paid"
    assert len(sql_events(engine, order.id, "paid")) == 1
    # The release could not run: the member is stale until its score passes.
    assert service.index.members("u1") == {order.id: order.expires_at_ms}

    clock.set(order.expires_at_ms)
    newer = service.create_unpaid_order("u1", ttl_s=TTL_S)
    assert service.index.members("u1") == {newer.id: newer.expires_at_ms}


def test_cancel_succeeds_when_redis_is_down_and_the_stale_member_expires_by_score(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    broken = service_without_redis(engine, clock)

    cancelled = broken.cancel_order(order.id)

    assert cancelled.status is OrderStatus.CANCELLED
    assert sql_row(engine, order.id).status == "cancelled"
    assert len(sql_events(engine, order.id, "cancelled")) == 1
    assert service.index.members("u1") == {order.id: order.expires_at_ms}

    clock.set(order.expires_at_ms + 1)
    newer = service.create_unpaid_order("u1", ttl_s=TTL_S)
    assert service.index.members("u1") == {newer.id: newer.expires_at_ms}


def test_create_when_redis_is_down_raises_store_unavailable_and_writes_nothing(
    engine: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    broken = service_without_redis(engine, clock)

    with pytest.raises(StoreUnavailable) as caught:
        broken.create_unpaid_order("u1", order_id="order-1")

    assert caught.value.store == "redis"
    assert table_counts(engine) == (0, 0)
    assert redis_client.dbsize() == 0


def test_store_unavailable_never_shows_the_redis_password(
    engine: Engine, clock: ManualClock
) -> None:
    broken = service_without_redis(engine, clock, url="redis://user:s3cret@127.0.0.1:1/0")

    with pytest.raises(StoreUnavailable) as caught:
        broken.create_unpaid_order("u1")

    exc = caught.value
    assert exc.store == "redis"
    assert "s3cret" not in str(exc)
    assert "s3cret" not in repr(exc.args)
    assert "s3cret" not in exc.detail
    assert "s3cret" not in str(exc.__cause__)
    assert table_counts(engine) == (0, 0)


# --- cancel_order ------------------------------------------------------------------------------


def test_cancel_moves_unpaid_to_cancelled_with_default_reason_and_removes_member(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    at = clock.advance(s=2)

    cancelled = service.cancel_order(order.id)

    assert cancelled.status is OrderStatus.CANCELLED
    assert cancelled.closed_at_ms == at
    assert cancelled.close_reason == "cancelled"
    row = sql_row(engine, order.id)
    assert (row.status, row.closed_at_ms, row.close_reason) == ("cancelled", at, "cancelled")
    assert row.paid_at_ms is None
    cancel_events = sql_events(engine, order.id, "cancelled")
    assert len(cancel_events) == 1
    assert cancel_events[0].at_ms == at
    assert service.index.members("u1") == {}


def test_cancel_with_a_reason_stores_that_reason(service: OrderService, engine: Engine) -> None:
    order = service.create_unpaid_order("u1")

    cancelled = service.cancel_order(order.id, reason="customer changed mind")

    assert cancelled.close_reason == "customer changed mind"
    assert sql_row(engine, order.id).close_reason == "customer changed mind"
    [cancel_event] = sql_events(engine, order.id, "cancelled")
    assert cancel_event.data == {"reason": "customer changed mind"}


def test_cancelling_twice_returns_the_order_unchanged(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    first = service.cancel_order(order.id)
    clock.advance(s=10)

    again = service.cancel_order(order.id, reason="other reason")

    assert again.status is OrderStatus.CANCELLED
    assert again.closed_at_ms == first.closed_at_ms
    assert again.close_reason == "cancelled"
    assert len(sql_events(engine, order.id, "cancelled")) == 1


def test_cancelling_a_paid_order_raises_already_paid(service: OrderService, engine: Engine) -> None:
    order = service.create_unpaid_order("u1")
    service.mark_paid(order.id, payment_ref="psp-1")

    with pytest.raises(OrderAlreadyPaid) as caught:
        service.cancel_order(order.id)

    assert caught.value.payment_ref == "psp-1"
    row = sql_row(engine, order.id)
    assert row.status == "paid"
    assert row.closed_at_ms is None
    assert sql_events(engine, order.id, "cancelled") == []


def test_cancelling_a_swept_order_raises_order_closed(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S)
    clock.advance(s=TTL_S)
    service.sweep_expired()

    with pytest.raises(OrderClosed) as caught:
        service.cancel_order(order.id)

    assert caught.value.status == "closed"
    row = sql_row(engine, order.id)
    assert (row.status, row.close_reason) == ("closed", "expired")
    assert sql_events(engine, order.id, "cancelled") == []


def test_pay_then_cancel_leaves_the_payment_as_the_only_winner(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    service.mark_paid(order.id, payment_ref="psp-1")

    with pytest.raises(OrderAlreadyPaid):
        service.cancel_order(order.id)

    assert sql_row(engine, order.id).status == "paid"
    kinds = [e.kind for e in sql_events(engine, order.id)]
    assert kinds == ["created", "paid"]


def test_cancel_then_pay_leaves_the_cancel_as_the_only_winner(
    service: OrderService, engine: Engine
) -> None:
    order = service.create_unpaid_order("u1")
    service.cancel_order(order.id)

    with pytest.raises(OrderClosed):
        service.mark_paid(order.id, payment_ref="psp-1")

    assert sql_row(engine, order.id).status == "cancelled"
    kinds = [e.kind for e in sql_events(engine, order.id)]
    # The cancel is the only transition; the payment is recorded as a refund owed.
    assert kinds == ["created", "cancelled", "payment_refused"]


# --- unknown and malformed ids ---------------------------------------------------------------

OPERATIONS: dict[str, Callable[[OrderService, Any], object]] = {
    "get_order": lambda svc, oid: svc.get_order(oid),
    "mark_paid": lambda svc, oid: svc.mark_paid(oid, payment_ref="psp-1"),
    "cancel_order": lambda svc, oid: svc.cancel_order(oid),
}

MALFORMED_IDS: dict[str, object] = {
    "empty": "",
    "glob": "a*b",
    "huge": "x" * 10_000,
    "none": None,
    "int": 12345,
}


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_unknown_order_id_raises_not_found_and_changes_nothing(
    service: OrderService, engine: Engine, redis_client: redis.Redis, operation: str
) -> None:
    service.create_unpaid_order("u1")
    before = (table_counts(engine), redis_client.dbsize())

    with pytest.raises(OrderNotFound):
        OPERATIONS[operation](service, "no-such-order")

    assert (table_counts(engine), redis_client.dbsize()) == before


@pytest.mark.rotate("database_url", "api", "redis_kind")
@pytest.mark.parametrize("bad_id", sorted(MALFORMED_IDS))
@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_malformed_order_id_raises_invalid_input_and_changes_nothing(
    service: OrderService, engine: Engine, redis_client: redis.Redis, operation: str, bad_id: str
) -> None:
    order = service.create_unpaid_order("u1")
    before = (table_counts(engine), redis_client.dbsize(), service.index.members("u1"))

    with pytest.raises(InvalidInput) as caught:
        OPERATIONS[operation](service, MALFORMED_IDS[bad_id])

    assert caught.value.field == "order_id"
    assert (table_counts(engine), redis_client.dbsize(), service.index.members("u1")) == before
    assert sql_row(engine, order.id).status == "unpaid"


# --- list_unpaid -----------------------------------------------------------------------------


def test_list_unpaid_returns_only_open_unpaid_orders_soonest_first(
    service: OrderService, clock: ManualClock
) -> None:
    start = clock()
    later = service.create_unpaid_order("7", ttl_s=300, limit=10)
    sooner = service.create_unpaid_order(7, ttl_s=120, limit=10)
    paid = service.create_unpaid_order("7", ttl_s=200, limit=10)
    cancelled = service.create_unpaid_order("7", ttl_s=200, limit=10)
    expiring = service.create_unpaid_order("7", ttl_s=10, limit=10)
    service.create_unpaid_order("8", ttl_s=100, limit=10)
    service.mark_paid(paid.id)
    service.cancel_order(cancelled.id)
    now = clock.advance(s=30)
    assert now - start == 30_000

    as_text = service.list_unpaid("7")
    as_int = service.list_unpaid(7)

    assert [o.id for o in as_text] == [sooner.id, later.id]
    assert as_int == as_text
    assert all(o.user_id == "7" and o.status is OrderStatus.UNPAID for o in as_text)
    assert [o.time_left_ms for o in as_text] == [
        sooner.expires_at_ms - now,
        later.expires_at_ms - now,
    ]
    # The expired one is still unpaid in SQL (not swept yet) but no longer listed.
    assert service.get_order(expiring.id).status is OrderStatus.UNPAID


def test_list_unpaid_for_a_user_without_orders_is_empty(service: OrderService) -> None:
    service.create_unpaid_order("u1")
    assert service.list_unpaid("someone-else") == []


def test_get_order_returns_the_stored_order(service: OrderService, clock: ManualClock) -> None:
    order = service.create_unpaid_order("u1", ttl_s=TTL_S, amount="12.50", currency="EUR")
    now = clock.advance(s=20)

    found = service.get_order(order.id)

    assert found.id == order.id
    assert found.user_id == "u1"
    assert found.status is OrderStatus.UNPAID
    assert found.expires_at_ms == order.expires_at_ms
    assert str(found.amount) == "12.50"
    assert found.currency == "EUR"
    assert found.time_left_ms == order.expires_at_ms - now


# --- concurrency -----------------------------------------------------------------------------


def test_sixteen_concurrent_payments_record_one_paid_event_and_all_return_paid(
    service: OrderService, engine: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    order = service.create_unpaid_order("u1")
    # Every call reads a different instant, so a loser reporting its own time would show.
    ticking = OrderService(
        engine, redis_client, service.settings, clock=lambda: clock.advance(ms=1)
    )
    threads = 16
    barrier = threading.Barrier(threads)

    def pay() -> Order:
        barrier.wait(timeout=30)
        return ticking.mark_paid(order.id, payment_ref="psp-1")

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(pay) for _ in range(threads)]
        results = [f.result(timeout=60) for f in futures]

    assert len(results) == threads
    assert all(r.status is OrderStatus.PAID for r in results)
    assert {r.paid_at_ms for r in results} == {sql_row(engine, order.id).paid_at_ms}
    assert {r.payment_ref for r in results} == {"psp-1"}
    assert len(sql_events(engine, order.id, "paid")) == 1
    assert sql_row(engine, order.id).status == "paid"
    assert service.index.members("u1") == {}
