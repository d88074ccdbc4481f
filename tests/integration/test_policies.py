"""Named expiry policies (``Settings.policies``, ``create_unpaid_order(policy=...)``) and
absolute deadlines (``expires_at=``), on both engines, one Redis server and a cluster, and
both APIs.

Each outcome is read from SQL (the order's row) and from Redis (its member's score); time
moves only through ``clock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, func, select

from orders import ExpiryPolicy
from orders.domain import OrderStatus
from orders.errors import InvalidInput, OrderClosed, UnpaidOrderLimitReached
from orders.index.nodes import RedisClient
from orders.policies import NEVER_EXPIRES_MS
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.stores import sql_rows

pytestmark = [pytest.mark.cluster_too, pytest.mark.both_apis]

HOUR_S = 3600
HOUR_MS = HOUR_S * 1000
DAY_S = 24 * HOUR_S
#: Deliberately unlike the settings' own values (30 min to pay, no reminder, no late
#: window, 7 days' lifetime), so a test cannot pass on the defaults.
POLICIES = {
    "bank_transfer": ExpiryPolicy(
        ttl_s=3 * DAY_S,
        remind_before_s=DAY_S,
        late_payment_window_s=DAY_S,
        max_lifetime_s=5 * DAY_S,
    ),
    "card": ExpiryPolicy(ttl_s=600, max_lifetime_s=2 * HOUR_S),
    "admin": ExpiryPolicy(expires=False),
}


@pytest.fixture
def shop(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(policies=POLICIES, unpaid_limit=2)


def score(redis_client: RedisClient, user_id: str, order_id: str) -> float | None:
    return redis_client.zscore(f"UnpaidOrder-{user_id}", order_id)


def nothing_written(engine: Engine, redis_client: RedisClient, user_id: str) -> bool:
    with engine.connect() as conn:
        rows = conn.scalar(
            select(func.count()).select_from(orders_table).where(orders_table.c.user_id == user_id)
        )
        events = conn.scalar(
            select(func.count()).select_from(events_table).where(events_table.c.user_id == user_id)
        )
    return (rows, events, redis_client.exists(f"UnpaidOrder-{user_id}")) == (0, 0, 0)


def test_a_policy_sets_the_time_to_pay_and_the_reminder_and_the_order_remembers_it(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    order = shop.create_unpaid_order("u1", policy="bank_transfer")
    created = order.created_at_ms
    assert order.expires_at_ms == created + 3 * DAY_S * 1000
    assert order.remind_at_ms == order.expires_at_ms - DAY_S * 1000
    assert (order.policy, shop.get_order(order.id).policy) == ("bank_transfer", "bank_transfer")
    row = sql_rows(engine)[order.id]
    assert (row.policy, row.expires_at_ms) == ("bank_transfer", order.expires_at_ms)
    assert score(redis_client, "u1", order.id) == order.expires_at_ms

    plain = shop.create_unpaid_order("u2")
    assert (plain.policy, plain.expires_at_ms - plain.created_at_ms) == (None, 1_800_000)
    assert plain.remind_at_ms is None

    clock.set(order.remind_at_ms - 1)
    assert shop.sweep_expired().reminded == 0
    clock.set(order.remind_at_ms)
    assert (shop.sweep_expired().reminded, shop.sweep_expired().reminded) == (1, 0)
    assert sql_rows(engine)[order.id].reminded_at_ms == order.remind_at_ms


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_a_call_may_ask_for_its_own_time_to_pay_up_to_the_policys_maximum_lifetime(
    shop: OrderService,
) -> None:
    # Past the settings' max_ttl_s (7 days)? No: the card policy's lifetime is 2 h.
    order = shop.create_unpaid_order("u1", policy="card", ttl_s=2 * HOUR_S)
    assert order.expires_at_ms - order.created_at_ms == 2 * HOUR_MS
    with pytest.raises(InvalidInput, match="ttl_s"):
        shop.create_unpaid_order("u1", policy="card", ttl_s=2 * HOUR_S + 1)


@pytest.mark.rotate("database_url", "api", "redis_kind")
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "wire"}, "policy"),
        ({"policy": ""}, "policy"),
        ({"policy": 7}, "policy"),
        ({"expires_at": datetime(2030, 1, 1)}, "expires_at"),  # naive: the point
        ({"expires_at": "2030-01-01T00:00:00+00:00"}, "expires_at"),
        ({"expires_at": datetime(2030, 1, 1, tzinfo=UTC), "ttl_s": 60}, "expires_at"),
        ({"policy": "admin", "ttl_s": 60}, "policy"),
        ({"policy": "admin", "expires_at": datetime(2030, 1, 1, tzinfo=UTC)}, "policy"),
    ],
    ids=[
        "unknown",
        "empty",
        "not-a-string",
        "naive",
        "text",
        "both-deadlines",
        "never-with-ttl",
        "never-with-deadline",
    ],
)
def test_bad_policy_or_deadline_is_invalid_input_before_anything_is_written(
    shop: OrderService,
    engine: Engine,
    redis_client: RedisClient,
    kwargs: dict[str, object],
    field: str,
) -> None:
    with pytest.raises(InvalidInput) as refused:
        shop.create_unpaid_order("u1", **kwargs)  # type: ignore[arg-type]
    assert refused.value.field == field
    assert nothing_written(engine, redis_client, "u1")


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_an_absolute_deadline_is_kept_to_the_millisecond_and_capped_at_the_lifetime(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    now = clock()
    # In a time zone of its own, with a millisecond part: the same instant in UTC.
    deadline_ms = now + 90 * 60 * 1000 + 7
    deadline = datetime.fromtimestamp(deadline_ms / 1000, tz=timezone(timedelta(hours=-5)))
    order = shop.create_unpaid_order("u1", policy="card", expires_at=deadline)
    assert order.expires_at_ms == deadline_ms
    assert score(redis_client, "u1", order.id) == deadline_ms

    far = datetime.fromtimestamp((now + 30 * DAY_S * 1000) / 1000, tz=UTC)
    capped = shop.create_unpaid_order("u2", policy="bank_transfer", expires_at=far)
    assert capped.expires_at_ms == capped.created_at_ms + 5 * DAY_S * 1000
    # The reminder follows the capped expiry.
    assert capped.remind_at_ms == capped.expires_at_ms - DAY_S * 1000

    past = datetime.fromtimestamp(now / 1000, tz=UTC)
    with pytest.raises(InvalidInput, match="not in the future"):
        shop.create_unpaid_order("u3", expires_at=past)
    assert nothing_written(engine, redis_client, "u3")


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_an_order_that_does_not_expire_holds_its_slot_until_paid_or_cancelled(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    held = shop.create_unpaid_order("u1", policy="admin")
    assert held.expires_at_ms == NEVER_EXPIRES_MS
    assert held.expires_at == datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    assert held.remind_at_ms is None
    # An exact score: a double holds every integer below 2**53.
    assert score(redis_client, "u1", held.id) == NEVER_EXPIRES_MS
    other = shop.create_unpaid_order("u1", policy="card")

    clock.advance(ms=50 * 365 * DAY_S * 1000)  # fifty years on
    result = shop.sweep_expired()
    assert result.closed == 1  # the card order, not the held one
    assert sql_rows(engine)[held.id].status == OrderStatus.UNPAID.value
    assert sql_rows(engine)[other.id].status == OrderStatus.CLOSED.value
    assert score(redis_client, "u1", held.id) == NEVER_EXPIRES_MS

    with pytest.raises(InvalidInput, match="does not expire"):
        shop.extend_order(held.id, 60)
    assert sql_rows(engine)[held.id].expires_at_ms == NEVER_EXPIRES_MS

    second = shop.create_unpaid_order("u1", policy="admin")
    with pytest.raises(UnpaidOrderLimitReached):
        shop.create_unpaid_order("u1", policy="card")
    assert shop.cancel_order(second.id).status is OrderStatus.CANCELLED
    assert shop.mark_paid(held.id, payment_ref="p-1").status is OrderStatus.PAID
    assert redis_client.zcard("UnpaidOrder-u1") == 0


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_extensions_stop_at_the_maximum_lifetime_of_the_orders_policy(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    card = shop.create_unpaid_order("u1", policy="card")  # 10 min to pay, 2 h at most
    plain = shop.create_unpaid_order("u2")  # 30 min, 7 days at most
    to_cap_ms = card.created_at_ms + 2 * HOUR_MS - card.expires_at_ms
    with pytest.raises(InvalidInput, match="maximum lifetime"):
        shop.extend_order(card.id, to_cap_ms / 1000 + 0.001)
    assert sql_rows(engine)[card.id].expires_at_ms == card.expires_at_ms
    extended = shop.extend_order(card.id, to_cap_ms / 1000)
    assert extended.expires_at_ms == card.created_at_ms + 2 * HOUR_MS
    assert shop.extend_order(plain.id, 3 * HOUR_S).expires_at_ms == plain.expires_at_ms + (
        3 * HOUR_MS
    )


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_a_late_payment_is_accepted_within_the_window_of_the_orders_policy_only(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    bank = shop.create_unpaid_order("u1", policy="bank_transfer")  # 1 day late window
    card = shop.create_unpaid_order("u2", policy="card")  # none
    clock.set(bank.expires_at_ms + 1)
    assert shop.sweep_expired().closed == 2
    assert sql_rows(engine)[bank.id].status == OrderStatus.CLOSED.value

    clock.set(bank.expires_at_ms + DAY_S * 1000 - 1)
    paid = shop.mark_paid(bank.id, payment_ref="wire-1")
    assert (paid.status, sql_rows(engine)[bank.id].payment_ref) == (OrderStatus.PAID, "wire-1")
    with pytest.raises(OrderClosed):
        shop.mark_paid(card.id, payment_ref="card-1")
    assert sql_rows(engine)[card.id].status == OrderStatus.CLOSED.value


@pytest.mark.rotate("database_url", "api", "redis_kind")
def test_an_order_whose_policy_was_removed_follows_the_settings_own_fields(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    order = make_service(policies=POLICIES).create_unpaid_order("u1", policy="bank_transfer")
    without = make_service()  # no policies: no late window, a 7-day lifetime
    assert without.get_order(order.id).policy == "bank_transfer"
    assert without.extend_order(order.id, 3 * DAY_S).expires_at_ms == order.expires_at_ms + (
        3 * DAY_S * 1000
    )
    clock.set(order.expires_at_ms + 3 * DAY_S * 1000 + 1)
    assert without.sweep_expired().closed == 1
    clock.advance(ms=1000)
    with pytest.raises(OrderClosed):
        without.mark_paid(order.id, payment_ref="wire-2")
    with pytest.raises(InvalidInput, match="policy"):
        without.create_unpaid_order("u1", policy="bank_transfer")


def test_creates_under_mixed_policies_at_once_never_pass_the_limit(
    shop: OrderService, engine: Engine, redis_client: RedisClient
) -> None:
    policies = [None, "bank_transfer", "card", "admin"]
    start = threading.Barrier(8)
    admitted: list[str] = []
    refused: list[str] = []

    def create(i: int) -> None:
        start.wait()
        try:
            order = shop.create_unpaid_order("u1", policy=policies[i % 4])
        except UnpaidOrderLimitReached:
            refused.append(str(i))
        else:
            admitted.append(order.id)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert (len(admitted), len(refused)) == (2, 6)
    unpaid = {oid for oid, row in sql_rows(engine).items() if row.status == "unpaid"}
    members = {m.decode() for m in redis_client.zrange("UnpaidOrder-u1", 0, -1)}
    assert unpaid == members == set(admitted)
    rows = sql_rows(engine)
    for oid in admitted:
        assert score(redis_client, "u1", oid) == rows[oid].expires_at_ms
