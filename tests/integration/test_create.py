"""create_unpaid_order on a real redis-server and a real SQLite file."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, event, func, select

from orders import (
    InvalidInput,
    OrderConflict,
    OrderService,
    OrderStatus,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from orders.bootstrap import build_redis
from orders.config import Settings
from orders.index.admissions import SUSPECT_AFTER_MS, AdmitRequest
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.stores import (
    DriverStatements,
    RoundTripCounter,
    refuse_inserts,
)

#: The contract holds on one Redis server and on a Redis Cluster alike.
pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too, pytest.mark.both_apis]


def sql_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(orders_table)).all())


def event_kinds(engine: Engine, order_id: str) -> list[str]:
    with engine.connect() as conn:
        query = select(events_table.c.kind).where(events_table.c.order_id == order_id)
        return list(conn.scalars(query.order_by(events_table.c.id)))


def test_admitted_order_is_in_sql_and_in_the_users_sorted_set_with_the_same_integer_expiry(
    service: OrderService, engine: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    order = service.create_unpaid_order(
        "u1", ttl_s=30, amount="19.90", currency="EUR", metadata={"cart": "c-1"}
    )

    assert order.status is OrderStatus.UNPAID
    assert order.created_at_ms == clock()
    assert order.expires_at_ms == clock() + 30_000
    assert order.amount == Decimal("19.90")
    assert order.metadata == {"cart": "c-1"}
    assert redis_client.zscore("UnpaidOrder-u1", order.id) == order.expires_at_ms
    [row] = sql_rows(engine)
    assert (row.id, row.user_id, row.status) == (order.id, "u1", "unpaid")
    assert row.expires_at_ms == order.expires_at_ms
    assert row.amount == "19.90"
    assert event_kinds(engine, order.id) == ["created"]
    assert service.get_order(order.id) == order


def test_the_users_key_has_no_expiry_and_goes_with_its_last_member(
    service: OrderService, redis_client: redis.Redis
) -> None:
    paid = service.create_unpaid_order("u1", ttl_s=100)
    cancelled = service.create_unpaid_order("u1", ttl_s=300)
    assert redis_client.pttl("UnpaidOrder-u1") == -1  # exists, no expiry

    service.mark_paid(paid.id)
    assert redis_client.pttl("UnpaidOrder-u1") == -1
    service.cancel_order(cancelled.id)
    assert redis_client.exists("UnpaidOrder-u1") == 0


def test_default_ttl_and_limit_come_from_settings(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service(ttl_s=45, unpaid_limit=2)
    first = service.create_unpaid_order("u1")
    service.create_unpaid_order("u1")
    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1")
    assert first.expires_at_ms - first.created_at_ms == 45_000
    assert info.value.limit == 2


def test_refusal_at_the_limit_carries_count_and_retry_after_and_costs_one_redis_call_no_sql(
    service: OrderService,
    redis_client: redis.Redis,
    clock: ManualClock,
    sql_statements: DriverStatements,
    redis_round_trips: RoundTripCounter,
) -> None:
    first = service.create_unpaid_order("u1", ttl_s=10)
    clock.advance(s=1)
    service.create_unpaid_order("u1", ttl_s=20)
    service.create_unpaid_order("u1", ttl_s=20)
    clock.advance(s=2)
    statements_before = sql_statements.count
    trips_before = redis_round_trips.count

    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1")

    assert redis_round_trips.count - trips_before == 1
    assert sql_statements.count == statements_before
    refusal = info.value
    assert (refusal.user_id, refusal.limit, refusal.open_count) == ("u1", 3, 3)
    assert refusal.retry_after_s == (first.expires_at_ms - clock()) / 1000 == 7.0
    assert redis_client.zcard("UnpaidOrder-u1") == 3


def test_a_refusal_asks_sql_once_about_admissions_seconds_old_then_costs_one_redis_call_again(
    service: OrderService,
    clock: ManualClock,
    sql_statements: DriverStatements,
    redis_round_trips: RoundTripCounter,
) -> None:
    held = {service.create_unpaid_order("u1", limit=2).id for _ in range(2)}
    clock.advance(ms=SUSPECT_AFTER_MS)
    statements_before = sql_statements.count

    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", limit=2)  # might they be creates that died?
    assert sql_statements.count > statements_before  # no: SQL has them, now confirmed
    statements_before = sql_statements.count
    trips_before = redis_round_trips.count
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", limit=2)

    assert redis_round_trips.count - trips_before == 1
    assert sql_statements.count == statements_before
    assert set(service.index.members("u1")) == held


def test_admission_costs_one_redis_call_and_one_sql_transaction(
    service: OrderService,
    engine: Engine,
    redis_client: redis.Redis,
    redis_round_trips: RoundTripCounter,
) -> None:
    # Loads the script, and opens the connection to u1's node (a cluster's node too).
    service.create_unpaid_order("u1")
    commits: list[object] = []

    def on_commit(conn: object) -> None:
        commits.append(conn)

    event.listen(engine, "commit", on_commit)
    trips_before = redis_round_trips.count
    # At the driver: the insert goes straight to it, unseen by cursor events.
    try:
        with DriverStatements() as sent:
            service.create_unpaid_order("u1")
    finally:
        event.remove(engine, "commit", on_commit)

    assert redis_round_trips.count - trips_before == 1
    statements = [" ".join(s.split()) for s in sent.statements]
    if engine.dialect.name == "sqlite":
        # The write lock, the order into its slot, its event, one commit.
        assert [s.split(" (")[0] for s in statements] == [
            "BEGIN IMMEDIATE",
            f"INSERT INTO {orders_table.name}",
            f"INSERT INTO {events_table.name}",
            "COMMIT",
        ]
        assert len(commits) == 1
    else:
        # One statement in autocommit: the slot, the order and its event, one transaction.
        assert len(statements) == 1
        assert statements[0].startswith(f"WITH created AS (INSERT INTO {orders_table.name}")
        assert f"INSERT INTO {events_table.name}" in statements[0]
        assert "ON CONFLICT (user_id, slot) WHERE status = 'unpaid' DO NOTHING" in statements[0]
        assert sent.autocommit == [True]  # SQLAlchemy's commit() then sends nothing
        assert commits == []


def test_expired_orders_stop_counting_without_any_sweep(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    old = [service.create_unpaid_order("u1", ttl_s=5) for _ in range(3)]
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1")

    clock.advance(s=5)  # expires_at == now: no longer ahead, so no longer counted
    new = service.create_unpaid_order("u1")

    members = service.index.members("u1")
    assert set(members) == {new.id}
    assert [o.id for o in service.list_unpaid("u1")] == [new.id]
    # Their SQL slots were still held: the create closed them (as the sweep would have,
    # with a closed event each) to take one.
    for order in old:
        closed = service.get_order(order.id)
        assert (closed.status, closed.close_reason) == (OrderStatus.CLOSED, "expired")
    with engine.connect() as conn:
        events = conn.execute(
            select(events_table.c.order_id, events_table.c.data).where(
                events_table.c.kind == "closed"
            )
        ).all()
    assert sorted(events) == sorted((o.id, {"trigger": "slot_reuse"}) for o in old)


def test_a_holder_paid_while_a_create_closes_due_holders_stays_paid(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    """The create read its user's holders as due; a payment of one commits before the
    create's close runs: the close is a compare-and-set, so the payment stands."""
    if engine.dialect.name != "postgresql":
        pytest.skip("SQLite's write transaction keeps the payment out until the close is done")
    service = make_service(unpaid_limit=2)
    old = [service.create_unpaid_order("u1", ttl_s=5) for _ in range(2)]
    clock.advance(s=5)
    paid: list[str] = []

    def pay_before_the_close(*args: Any) -> None:
        statement, parameters = args[2], args[3]
        if not paid and "slot_reuse" in str(parameters) and "UPDATE" in statement:
            paid.append(service.mark_paid(old[0].id).id)

    event.listen(engine, "before_cursor_execute", pay_before_the_close)
    try:
        service.create_unpaid_order("u1")
    finally:
        event.remove(engine, "before_cursor_execute", pay_before_the_close)

    assert paid == [old[0].id]
    assert service.get_order(old[0].id).status == OrderStatus.PAID
    assert service.get_order(old[1].id).status == OrderStatus.CLOSED


def test_a_per_call_limit_overrides_the_setting(service: OrderService) -> None:
    service.create_unpaid_order("u1", limit=1)
    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1", limit=1)
    assert info.value.limit == 1
    service.create_unpaid_order("u1", limit=2)


def test_int_and_string_user_ids_are_one_user(service: OrderService) -> None:
    service.create_unpaid_order(7, limit=2)
    service.create_unpaid_order("7", limit=2)
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order(7, limit=2)
    assert {o.user_id for o in service.list_unpaid(7)} == {"7"}


def test_retry_with_the_same_order_id_returns_the_same_order_and_takes_no_second_slot(
    service: OrderService, engine: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    first = service.create_unpaid_order("u1", order_id="ord-1", amount=10, currency="EUR")
    clock.advance(s=1)
    again = service.create_unpaid_order("u1", order_id="ord-1", amount="10.00", currency="EUR")

    assert again.id == first.id
    assert again.expires_at_ms == first.expires_at_ms
    assert len(sql_rows(engine)) == 1
    assert event_kinds(engine, "ord-1") == ["created"]
    assert redis_client.zcard("UnpaidOrder-u1") == 1
    # The retry leaves the member's score alone: the slot frees when the order expires.
    assert service.index.members("u1") == {"ord-1": first.expires_at_ms}


def test_retry_of_an_order_already_paid_returns_it_even_at_the_limit(
    service: OrderService,
) -> None:
    service.create_unpaid_order("u1", order_id="ord-1", limit=1)
    service.mark_paid("ord-1")
    service.create_unpaid_order("u1", order_id="ord-2", limit=1)

    again = service.create_unpaid_order("u1", order_id="ord-1", limit=1)

    assert again.status is OrderStatus.PAID
    assert set(service.index.members("u1")) == {"ord-2"}


def test_retry_of_a_paid_order_below_the_limit_returns_it_and_frees_the_slot_again(
    service: OrderService, engine: Engine
) -> None:
    service.create_unpaid_order("u1", order_id="ord-1")
    service.mark_paid("ord-1")

    again = service.create_unpaid_order("u1", order_id="ord-1")

    assert again.status is OrderStatus.PAID
    assert service.index.members("u1") == {}
    assert len(sql_rows(engine)) == 1


def test_the_same_order_id_for_another_user_is_a_conflict_and_leaves_no_member(
    service: OrderService, redis_client: redis.Redis
) -> None:
    service.create_unpaid_order("u1", order_id="ord-1")
    with pytest.raises(OrderConflict, match="another user"):
        service.create_unpaid_order("u2", order_id="ord-1")
    assert redis_client.exists("UnpaidOrder-u2") == 0
    assert service.get_order("ord-1").user_id == "u1"


@pytest.mark.parametrize(
    "changed", [{"amount": "11.00", "currency": "EUR"}, {"amount": 10, "currency": "USD"}, {}]
)
def test_the_same_order_id_with_another_amount_or_currency_is_a_conflict(
    service: OrderService, changed: dict[str, Any]
) -> None:
    service.create_unpaid_order("u1", order_id="ord-1", amount=10, currency="EUR")
    with pytest.raises(OrderConflict, match="amount"):
        service.create_unpaid_order("u1", order_id="ord-1", **changed)
    assert set(service.index.members("u1")) == {"ord-1"}


def test_a_retry_after_a_crash_between_redis_and_sql_finishes_the_order_with_the_redis_expiry(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    # The first attempt got as far as the admission, then died before its SQL insert.
    service.index.admit(
        AdmitRequest("u1", "ord-1", expires_at_ms=clock() + 60_000, now_ms=clock(), limit=3)
    )
    clock.advance(s=2)

    order = service.create_unpaid_order("u1", order_id="ord-1")

    assert order.expires_at_ms == clock() - 2_000 + 60_000
    assert service.index.members("u1") == {"ord-1": order.expires_at_ms}
    assert [r.id for r in sql_rows(engine)] == ["ord-1"]


def test_sql_guard_refuses_when_redis_lost_its_members_and_leaves_no_phantom(
    service: OrderService, engine: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    first = service.create_unpaid_order("u1", ttl_s=10)
    service.create_unpaid_order("u1")
    service.create_unpaid_order("u1")
    redis_client.flushdb()

    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1")

    assert info.value.open_count == 3
    assert info.value.retry_after_s == (first.expires_at_ms - clock()) / 1000
    assert len(sql_rows(engine)) == 3
    # No phantom of the refused create; the members Redis lost are back, from SQL.
    assert service.index.members("u1") == {r.id: r.expires_at_ms for r in sql_rows(engine)}
    with pytest.raises(UnpaidOrderLimitReached) as again:
        service.create_unpaid_order("u1")
    assert again.value.source == "redis"


def test_sql_failure_on_insert_removes_the_member_again(
    service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    service.create_unpaid_order("u1", order_id="kept")
    refuse_inserts(engine, orders_table.name, "disk on fire")

    with pytest.raises(StoreUnavailable) as info:
        service.create_unpaid_order("u1", order_id="doomed")

    assert info.value.store == "sql"
    assert set(service.index.members("u1")) == {"kept"}
    assert [r.id for r in sql_rows(engine)] == ["kept"]


def test_redis_down_refuses_creation_with_store_unavailable_and_writes_no_row(
    engine: Engine, database_url: str, clock: ManualClock
) -> None:
    settings = Settings(database_url=database_url, redis_url="redis://:s3cret@127.0.0.1:1/0")
    client = build_redis(settings)
    try:
        broken = OrderService(engine, client, settings, clock=clock)
        with pytest.raises(StoreUnavailable) as info:
            broken.create_unpaid_order("u1")
    finally:
        client.close()
    assert info.value.store == "redis"
    assert "s3cret" not in str(info.value)
    assert sql_rows(engine) == []


BAD_CREATE_ARGUMENTS: list[dict[str, Any]] = [
    {"user_id": None},
    {"user_id": True},
    {"user_id": ""},
    {"user_id": "  "},
    {"user_id": "x" * 129},
    {"user_id": "a\x00b"},
    {"user_id": "a\r\nFLUSHALL"},
    {"user_id": "{slot}"},
    {"user_id": "user*"},
    {"user_id": "a?b"},
    {"user_id": "[ab]"},
    {"order_id": ""},
    {"order_id": "x" * 65},
    {"order_id": 12},
    {"ttl_s": 0},
    {"ttl_s": -1},
    {"ttl_s": float("nan")},
    {"ttl_s": float("inf")},
    {"ttl_s": 10**9},
    {"ttl_s": True},
    {"limit": 0},
    {"limit": 1001},
    {"limit": 2.5},
    {"amount": 1.5},
    {"amount": "-3"},
    {"amount": "NaN"},
    {"currency": "eur", "amount": 1},
    {"currency": "EUR"},
    {"metadata": {"bad": float("nan")}},
    {"metadata": "not a mapping"},
]


@pytest.mark.rotate("database_url", "api", "redis_kind")
@pytest.mark.parametrize("bad", BAD_CREATE_ARGUMENTS, ids=",".join)
def test_bad_input_raises_invalid_input_and_writes_nothing(
    service: OrderService, engine: Engine, redis_client: redis.Redis, bad: dict[str, Any]
) -> None:
    arguments: dict[str, Any] = {"user_id": "u1", **bad}
    user_id = arguments.pop("user_id")

    with pytest.raises(InvalidInput):
        service.create_unpaid_order(user_id, **arguments)

    assert redis_client.dbsize() == 0
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(orders_table)) == 0
        assert conn.scalar(select(func.count()).select_from(events_table)) == 0


@pytest.mark.rotate("database_url", "api", "redis_kind")
@pytest.mark.parametrize("user_id", ["ünïcödé", "e\u0301", "👩‍💻", "'; DROP TABLE oes_orders; --"])
def test_unusual_but_valid_user_ids_are_stored_and_returned_exactly(
    service: OrderService, redis_client: redis.Redis, user_id: str
) -> None:
    order = service.create_unpaid_order(user_id)
    assert service.get_order(order.id).user_id == user_id
    assert redis_client.zscore(f"UnpaidOrder-{user_id}", order.id) == order.expires_at_ms
    assert [o.id for o in service.list_unpaid(user_id)] == [order.id]


def test_generated_ids_are_unique_and_sort_in_creation_order(
    service: OrderService, clock: ManualClock
) -> None:
    ids = []
    for i in range(20):
        ids.append(service.create_unpaid_order(f"u{i}").id)
        if i % 3 == 0:
            clock.advance(ms=1)
    assert len(set(ids)) == 20
    assert ids == sorted(ids)


def test_a_retry_at_the_limit_returns_the_order_it_retries(service: OrderService) -> None:
    first = service.create_unpaid_order("u1", order_id="a", limit=1)

    again = service.create_unpaid_order("u1", order_id="a", limit=1)

    assert again == first
    assert set(service.index.members("u1")) == {"a"}
