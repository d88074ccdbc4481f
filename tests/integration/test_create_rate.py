"""The create rate (``Settings.create_rate``): at most N creates per user in any window,
counted in Redis beside the user's set, in the admission's own round trip."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

import orders
import orders.aio
from orders import CreateRateLimited, InvalidInput, Order, OrderService, UnpaidOrderLimitReached
from orders.config import Settings
from orders.config.values import CreateRate
from orders.index.admissions import AdmitRequest
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.threads import outcomes_of_race

pytestmark = [pytest.mark.cluster_too, pytest.mark.both_apis]

HOUR_MS = 3_600_000


def sql_ids(engine: Engine, user_id: str) -> set[str]:
    with engine.connect() as conn:
        query = select(orders_table.c.id).where(orders_table.c.user_id == user_id)
        return set(conn.scalars(query))


def rate_entries(service: OrderService, redis_client: redis.Redis, user_id: str) -> set[str]:
    """The creates the user's rate set holds (the window's, and any not trimmed yet)."""
    return {m.decode() for m in redis_client.zrange(service.index.rate_key(user_id), 0, -1)}


@pytest.fixture
def rated(make_service: Callable[..., OrderService]) -> OrderService:
    """3 creates per user an hour, under a limit the rate reaches first."""
    return make_service(create_rate="3/3600", unpaid_limit=10)


def test_the_creates_past_the_rate_are_refused_until_the_oldest_leaves_the_window(
    rated: OrderService, engine: Engine, clock: ManualClock
) -> None:
    first = rated.create_unpaid_order("u1")
    clock.advance(s=600)
    rated.create_unpaid_order("u1")
    clock.advance(s=600)
    rated.create_unpaid_order("u1")
    clock.advance(s=600)

    with pytest.raises(CreateRateLimited) as info:
        rated.create_unpaid_order("u1")
    assert (info.value.user_id, info.value.limit, info.value.window_s) == ("u1", 3, 3600)
    assert info.value.retry_after_s == (first.created_at_ms + HOUR_MS - clock()) / 1000 == 1800
    rated.create_unpaid_order("u2")  # another user's rate is its own

    clock.set(first.created_at_ms + HOUR_MS - 1)  # the millisecond before: still inside
    with pytest.raises(CreateRateLimited) as still:
        rated.create_unpaid_order("u1")
    assert still.value.retry_after_s == 0.001
    clock.advance(ms=1)
    admitted = rated.create_unpaid_order("u1")
    assert admitted.created_at_ms == first.created_at_ms + HOUR_MS
    assert len(sql_ids(engine, "u1")) == 4


def test_create_cancel_create_counts_every_create(
    rated: OrderService, redis_client: redis.Redis, engine: Engine
) -> None:
    # The bot's loop: each create is cancelled at once, so the limit never bites.
    for _ in range(3):
        rated.cancel_order(rated.create_unpaid_order("bot").id)

    with pytest.raises(CreateRateLimited):
        rated.create_unpaid_order("bot")
    assert rated.list_unpaid("bot") == []
    assert len(sql_ids(engine, "bot")) == 3
    assert len(rate_entries(rated, redis_client, "bot")) == 3


def test_a_retry_with_the_same_order_id_is_not_a_new_create(
    rated: OrderService, redis_client: redis.Redis, engine: Engine, clock: ManualClock
) -> None:
    # The first attempt got as far as its admission (counted), then died before its insert.
    rate = CreateRate(3, HOUR_MS)
    rated.index.admit(
        AdmitRequest(
            "u1", "ord-1", expires_at_ms=clock() + 60_000, now_ms=clock(), limit=10, rate=rate
        )
    )
    rated.create_unpaid_order("u1")
    rated.create_unpaid_order("u1")
    clock.advance(s=1)

    # The rate is used up, but the retry is no new create: it finishes the order.
    order = rated.create_unpaid_order("u1", order_id="ord-1")
    assert order.id in sql_ids(engine, "u1")
    for _ in range(3):
        clock.advance(s=1)
        assert rated.create_unpaid_order("u1", order_id="ord-1").id == order.id
    assert len(rate_entries(rated, redis_client, "u1")) == 3
    with pytest.raises(CreateRateLimited):
        rated.create_unpaid_order("u1")
    # Paid (no longer in the user's set), then retried: the same order comes back.
    rated.mark_paid(order.id)
    assert rated.create_unpaid_order("u1", order_id="ord-1").id == order.id


def test_the_rate_refusal_wins_when_the_limit_refuses_too(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service(create_rate="2/60", unpaid_limit=2)
    service.create_unpaid_order("u1")
    service.create_unpaid_order("u1")
    # A cancel frees a slot under the limit but gives no create back: the rate is the
    # refusal that still holds after it.
    with pytest.raises(CreateRateLimited):
        service.create_unpaid_order("u1")


def test_concurrent_creates_never_pass_the_rate(
    rated: OrderService, redis_client: redis.Redis, engine: Engine
) -> None:
    outcomes = outcomes_of_race([lambda: rated.create_unpaid_order("u1")] * 10)

    admitted = {o.id for o in outcomes if isinstance(o, Order)}
    refused = [o for o in outcomes if isinstance(o, CreateRateLimited)]
    assert (len(admitted), len(refused)) == (3, 7), outcomes
    assert sql_ids(engine, "u1") == admitted
    assert rate_entries(rated, redis_client, "u1") == admitted


def test_a_create_refused_by_sql_after_redis_admitted_gives_its_rate_back(
    make_service: Callable[..., OrderService], redis_client: redis.Redis, engine: Engine
) -> None:
    service = make_service(create_rate="2/3600", unpaid_limit=1)
    kept = service.create_unpaid_order("u1")
    redis_client.delete(service.index.key("u1"))  # Redis lost the member; SQL still holds it

    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1", order_id="compensated")
    assert info.value.source == "sql"
    assert rate_entries(service, redis_client, "u1") == {kept.id}

    service.cancel_order(kept.id)
    second = service.create_unpaid_order("u1")  # the rate's second create, not its third
    assert sql_ids(engine, "u1") == {kept.id, second.id}


def test_an_abandoned_admission_gives_its_rate_back(
    rated: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    # A create whose Redis call timed out: its caller abandons the attempt.
    rate = CreateRate(3, HOUR_MS)
    started_ms = clock()
    rated.index.admit(
        AdmitRequest(
            "u1", "lost", expires_at_ms=clock() + 60_000, now_ms=started_ms, limit=10, rate=rate
        )
    )
    rated.index.admit(
        AdmitRequest(
            "u1", "kept", expires_at_ms=clock() + 60_000, now_ms=started_ms, limit=10, rate=rate
        )
    )

    assert rated.index.abandon("u1", "lost", started_ms=started_ms)
    assert rate_entries(rated, redis_client, "u1") == {"kept"}


def test_the_pre_close_checks_reopen_is_not_a_create(
    make_service: Callable[..., OrderService], redis_client: redis.Redis, clock: ManualClock
) -> None:
    service = make_service(create_rate="1/3600")
    order = service.create_unpaid_order("u1", ttl_s=5)
    service.set_pre_close_check(lambda o: 30)
    clock.advance(s=5)

    assert service.sweep_expired().closed == 0
    assert service.get_order(order.id).expires_at_ms == clock() + 30_000
    assert service.index.members("u1") == {order.id: clock() + 30_000}
    rate_key = service.index.rate_key("u1")
    assert redis_client.zrange(rate_key, 0, -1, withscores=True) == [
        (order.id.encode(), order.created_at_ms)
    ]


def test_the_rate_set_shares_the_users_slot_and_expires_with_the_window(
    rated: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    rated.create_unpaid_order("u1")
    clock.advance(s=10)
    rated.create_unpaid_order("u1")
    rate_key = rated.index.rate_key("u1")

    assert rate_key.startswith("UnpaidOrder-[")  # left out of the users' scan
    assert 3_590_000 < redis_client.pttl(rate_key) <= HOUR_MS
    assert [u for batch in rated.index.scan_users() for u in batch] == ["u1"]


def test_without_a_rate_nothing_is_counted(
    service: OrderService, redis_client: redis.Redis
) -> None:
    for _ in range(3):
        service.cancel_order(service.create_unpaid_order("u1").id)
    service.create_unpaid_order("u1")
    assert redis_client.exists(service.index.rate_key("u1")) == 0


@pytest.mark.parametrize(
    "text", ["0/0", "x/y", "10/0", "0/60", "-1/60", "10/-5", "1000001/60", "10/2592001", ""]
)
def test_a_bad_rate_is_refused_when_the_settings_are_made(text: str) -> None:
    with pytest.raises(InvalidInput) as info:
        Settings(create_rate=text)
    assert info.value.field == "create_rate"
    with pytest.raises(InvalidInput):
        Settings.from_env({"ORDERS_CREATE_RATE": text or " "})


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("10/3600", CreateRate(10, HOUR_MS)), ("1000000/2592000", CreateRate(10**6, 2592000 * 1000))],
)
def test_a_rate_is_read_once_into_creates_and_milliseconds(text: str, parsed: Any) -> None:
    assert Settings.from_env({"ORDERS_CREATE_RATE": text}).create_rate_limit == parsed
    assert Settings().create_rate_limit is None


def test_the_error_is_exported_beside_both_apis() -> None:
    assert orders.CreateRateLimited is orders.aio.CreateRateLimited is CreateRateLimited
    assert issubclass(CreateRateLimited, orders.OrdersError)
