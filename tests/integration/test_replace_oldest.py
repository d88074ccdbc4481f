"""Replace the oldest (``on_limit="replace_oldest"``): at the limit a create cancels its
user's oldest unpaid order (reason ``replaced``) and takes its place, never past the limit
and never over a payment that committed first or is in flight."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from orders import InvalidInput, Order, OrderService, UnpaidOrderLimitReached
from orders.config import Settings
from orders.domain import Actor, ActorKind, EventKind, OrderStatus
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.threads import outcomes_of_race

pytestmark = [pytest.mark.cluster_too, pytest.mark.both_apis]

REPLACE = "replace_oldest"


def sql_orders(engine: Engine, user_id: str) -> dict[str, str]:
    """Every order of the user in SQL: id -> status."""
    with engine.connect() as conn:
        query = select(orders_table.c.id, orders_table.c.status).where(
            orders_table.c.user_id == user_id
        )
        return {row.id: row.status for row in conn.execute(query)}


def unpaid_ids(engine: Engine, user_id: str) -> set[str]:
    return {oid for oid, status in sql_orders(engine, user_id).items() if status == "unpaid"}


def cancelled_events(service: OrderService) -> dict[str, list[Any]]:
    """The cancelled events by order id."""
    found: dict[str, list[Any]] = {}
    for event in service.iter_events(limit=1000):
        if event.kind is EventKind.CANCELLED:
            found.setdefault(event.order_id, []).append(event)
    return found


def fill(service: OrderService, clock: ManualClock, user_id: str, n: int) -> list[Order]:
    """``n`` orders of the user, one second apart (the first is the oldest)."""
    made = []
    for _ in range(n):
        made.append(service.create_unpaid_order(user_id))
        clock.advance(s=1)
    return made


@pytest.fixture
def limited(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(unpaid_limit=3)


def test_at_the_limit_the_oldest_is_cancelled_and_the_new_order_admitted(
    limited: OrderService, engine: Engine, clock: ManualClock
) -> None:
    held = fill(limited, clock, "u1", 3)

    new = limited.create_unpaid_order("u1", on_limit=REPLACE, actor="checkout")

    oldest = limited.get_order(held[0].id)
    assert (oldest.status, oldest.close_reason) == (OrderStatus.CANCELLED, "replaced")
    (event,) = cancelled_events(limited)[oldest.id]
    assert event.data == {"reason": "replaced", "replaced_by": new.id}
    assert event.actor == Actor(ActorKind.APPLICATION, "checkout")
    expected = {held[1].id, held[2].id, new.id}
    assert unpaid_ids(engine, "u1") == expected
    assert set(limited.index.members("u1")) == expected


def test_the_setting_replaces_without_the_argument_and_the_argument_wins(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=1, on_limit=REPLACE)
    first = service.create_unpaid_order("u1")
    second = service.create_unpaid_order("u1")
    assert service.get_order(first.id).status is OrderStatus.CANCELLED

    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", on_limit="refuse")
    assert unpaid_ids(engine, "u1") == {second.id}


def test_below_the_limit_nothing_is_replaced(
    limited: OrderService, engine: Engine, clock: ManualClock
) -> None:
    held = fill(limited, clock, "u1", 2)
    new = limited.create_unpaid_order("u1", on_limit=REPLACE)

    assert unpaid_ids(engine, "u1") == {held[0].id, held[1].id, new.id}
    assert cancelled_events(limited) == {}


def test_a_payment_that_commits_first_makes_the_create_refuse(
    limited: OrderService,
    engine: Engine,
    clock: ManualClock,
    redis_client: redis.Redis,
    redis_options: dict[str, Any],
    database_url: str,
) -> None:
    held = fill(limited, clock, "u1", 3)
    # Another process's payment commits between the pick of the oldest and its cancel: the
    # pre-close check runs exactly there, so it pays (and lets the cancel go ahead).
    payer = OrderService(
        engine, redis_client, Settings(database_url=database_url, **redis_options), clock=clock
    )

    def pay_then_allow(order: Order) -> None:
        payer.mark_paid(order.id, payment_ref="psp-1")

    limited.set_pre_close_check(pay_then_allow)

    with pytest.raises(UnpaidOrderLimitReached):
        limited.create_unpaid_order("u1", on_limit=REPLACE)
    assert limited.get_order(held[0].id).status is OrderStatus.PAID
    assert unpaid_ids(engine, "u1") == {held[1].id, held[2].id}
    assert cancelled_events(limited) == {}
    payer.close()


@pytest.mark.parametrize("answer", ["in_flight", "raises"])
def test_a_pre_close_check_that_does_not_allow_it_keeps_the_order(
    limited: OrderService, engine: Engine, clock: ManualClock, answer: str
) -> None:
    held = fill(limited, clock, "u1", 3)
    asked: list[str] = []

    def check(order: Order) -> float | None:
        asked.append(order.id)
        if answer == "raises":
            raise RuntimeError("payment provider unreachable")
        return 30.0  # a payment in flight: give it time

    limited.set_pre_close_check(check)
    with pytest.raises(UnpaidOrderLimitReached):
        limited.create_unpaid_order("u1", on_limit=REPLACE)

    assert asked == [held[0].id]
    assert unpaid_ids(engine, "u1") == {o.id for o in held}
    assert set(limited.index.members("u1")) == {o.id for o in held}

    limited.set_pre_close_check(lambda order: None)  # nothing in flight: replaced
    new = limited.create_unpaid_order("u1", on_limit=REPLACE)
    assert unpaid_ids(engine, "u1") == {held[1].id, held[2].id, new.id}


@pytest.mark.parametrize("racers", [2, 8])
def test_concurrent_replacing_creates_keep_the_limit(
    limited: OrderService, engine: Engine, clock: ManualClock, racers: int
) -> None:
    fill(limited, clock, "u1", 3)

    outcomes = outcomes_of_race(
        [lambda: limited.create_unpaid_order("u1", on_limit=REPLACE)] * racers
    )

    assert all(isinstance(o, Order | UnpaidOrderLimitReached) for o in outcomes), outcomes
    admitted = {o.id for o in outcomes if isinstance(o, Order)}
    assert admitted
    unpaid = unpaid_ids(engine, "u1")
    assert len(unpaid) == 3
    assert set(limited.index.members("u1")) == unpaid
    cancelled = {oid for oid, s in sql_orders(engine, "u1").items() if s == "cancelled"}
    # An admitted order may itself be the oldest a later racer replaced (same millisecond).
    assert admitted <= unpaid | cancelled
    assert len(cancelled) <= racers
    events = cancelled_events(limited)
    assert set(events) == cancelled
    replaced_by = []
    for order_id in cancelled:
        (event,) = events[order_id]
        assert event.data["reason"] == "replaced"
        assert limited.get_order(order_id).close_reason == "replaced"
        replaced_by.append(event.data["replaced_by"])
    # One create cancels at most one order; a create that cancelled one and then lost the
    # freed slot to a concurrent create was refused, so its new id never came to exist.
    assert len(set(replaced_by)) == len(replaced_by)
    never_created = set(replaced_by) - set(sql_orders(engine, "u1"))
    refused = [o for o in outcomes if isinstance(o, UnpaidOrderLimitReached)]
    assert len(never_created) <= len(refused)
    assert not (set(replaced_by) - never_created) - admitted


def test_redis_that_lost_the_members_still_replaces(
    limited: OrderService, engine: Engine, clock: ManualClock, redis_client: redis.Redis
) -> None:
    held = fill(limited, clock, "u1", 3)
    redis_client.delete(limited.index.key("u1"))  # Redis admits; the SQL guard refuses

    new = limited.create_unpaid_order("u1", on_limit=REPLACE)

    assert limited.get_order(held[0].id).close_reason == "replaced"
    expected = {held[1].id, held[2].id, new.id}
    assert unpaid_ids(engine, "u1") == expected
    assert set(limited.index.members("u1")) == expected


def test_in_the_hosts_transaction_the_limit_refuses_and_nothing_is_replaced(
    make_service: Callable[..., OrderService], engine: Engine, api: str
) -> None:
    if api == "async":
        pytest.skip("a host's transaction here is a synchronous Connection")
    service = make_service(unpaid_limit=1, on_limit=REPLACE)
    kept = service.create_unpaid_order("u1")
    with engine.connect() as conn:
        with pytest.raises(UnpaidOrderLimitReached):
            service.create_unpaid_order("u1", connection=conn)
        conn.commit()
    assert unpaid_ids(engine, "u1") == {kept.id}
    assert cancelled_events(service) == {}


def test_a_bad_on_limit_is_refused_before_anything_is_written(
    limited: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    for bad in ("newest", "", 1, "REPLACE_OLDEST"):
        with pytest.raises(InvalidInput) as info:
            limited.create_unpaid_order("u1", on_limit=bad)  # type: ignore[arg-type]
        assert info.value.field == "on_limit"
        with pytest.raises(InvalidInput, match="on_limit"):
            Settings(on_limit=bad)  # type: ignore[arg-type]
    assert sql_orders(engine, "u1") == {}
    assert redis_client.exists(limited.index.key("u1")) == 0
    assert Settings.from_env({"ORDERS_ON_LIMIT": REPLACE}).on_limit == REPLACE
