"""A batch of combined creates (``Settings.combine_creates``) meeting a hung or full Redis.

Each case queues 16 creates behind a held one, so they run as one batch, then breaks Redis
before the batch is sent:

* hung (SIGSTOP): the batch's round trip times out. Every caller gets StoreUnavailable and
  every admission is abandoned, as a create alone does: once Redis answers again, the
  next create sends the abandons first, so no member is left for an order that does not
  exist, even if the stalled server runs the batch's scripts late;
* hung, with ``create_without_redis``: every caller gets its order through the SQL guard
  alone, and reconcile makes the index equal SQL;
* full (maxmemory, noeviction): Redis refuses each script; every caller gets
  StoreUnavailable ("out of memory") and nothing is written anywhere;
* a shared transaction that fails (a trigger refuses the events): each member goes on
  alone and fails as a create alone does, its admission taken back.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import Order
from orders.errors import StoreUnavailable
from orders.service import OrderService
from orders.sql.models import events_table
from tests.support.clocks import ManualClock
from tests.support.doubles import gated_race, pausing_after_admit
from tests.support.redis_server import RedisServer, own_server
from tests.support.stores import orders_of, refuse_inserts

MEMBERS = 16
USERS = [f"b{n}" for n in range(MEMBERS)]


@pytest.fixture
def own_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    with own_server(redis_binary) as server:
        yield server


def combining_on(
    server: RedisServer, engine: Engine, clock: ManualClock, **overrides: object
) -> OrderService:
    settings = Settings(
        redis_url=server.url,
        combine_creates=True,
        redis_socket_timeout_s=0.2,
        **overrides,  # type: ignore[arg-type]
    )
    service = OrderService(engine, build_redis(settings), settings, clock=clock)
    service.create_unpaid_order("warm-up", ttl_s=60)
    return pausing_after_admit(service, lambda _user, _order: None)


def batch_of_creates(service: OrderService, before_open: object) -> list[object]:
    stats = service.combiner.stats  # type: ignore[union-attr]
    batches = stats.batches
    calls = [lambda user=user: service.create_unpaid_order(user, ttl_s=60) for user in USERS]
    outcomes = gated_race(service, calls, before_open)  # type: ignore[arg-type]
    assert stats.batches == batches + 1, f"the creates did not run as one batch: {stats}"
    return outcomes


def test_a_hung_redis_fails_every_member_and_abandons_every_admission(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = combining_on(own_redis, engine, clock)
    assert own_redis.proc is not None
    proc = own_redis.proc
    try:
        outcomes = batch_of_creates(service, lambda: proc.send_signal(signal.SIGSTOP))
    finally:
        proc.send_signal(signal.SIGCONT)
    assert all(isinstance(o, StoreUnavailable) and o.store == "redis" for o in outcomes), outcomes
    assert len(service.admitter.abandoner.unsent) == MEMBERS  # sent after the next answer
    service.create_unpaid_order("after", ttl_s=60)  # alone: sends the abandons first
    assert not service.admitter.abandoner.unsent
    for user in USERS:
        assert orders_of(engine, user) == {}
        assert service.index.members(user) == {}, user


def test_a_hung_redis_with_create_without_redis_admits_the_batch_through_sql(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = combining_on(own_redis, engine, clock, create_without_redis=True)
    assert own_redis.proc is not None
    proc = own_redis.proc
    try:
        outcomes = batch_of_creates(service, lambda: proc.send_signal(signal.SIGSTOP))
    finally:
        proc.send_signal(signal.SIGCONT)
    assert all(isinstance(o, Order) for o in outcomes), outcomes
    for user, order in zip(USERS, outcomes, strict=True):
        assert isinstance(order, Order)
        assert order.user_id == user
        assert set(orders_of(engine, user)) == {order.id}
    service.reconcile()
    for user, order in zip(USERS, outcomes, strict=True):
        assert isinstance(order, Order)
        assert service.index.members(user) == {order.id: order.expires_at_ms}


def test_a_full_redis_refuses_every_member_and_nothing_is_written(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    service = combining_on(own_redis, engine, clock)
    with redis.Redis.from_url(own_redis.url) as admin:
        admin.config_set("maxmemory-policy", "noeviction")

        def fill() -> None:
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", used // 2)

        try:
            outcomes = batch_of_creates(service, fill)
        finally:
            admin.config_set("maxmemory", 0)
    for outcome in outcomes:
        assert isinstance(outcome, StoreUnavailable), outcome
        assert "out of memory" in str(outcome)
    for user in USERS:
        assert orders_of(engine, user) == {}
        assert service.index.members(user) == {}


def test_a_batch_whose_transaction_fails_leaves_each_member_to_the_single_path(
    own_redis: RedisServer, engine: Engine, clock: ManualClock
) -> None:
    """A trigger refuses every event: the shared transaction fails as a whole, and each
    member then fails alone as a create alone does (StoreUnavailable, its member removed)."""
    service = combining_on(own_redis, engine, clock)
    outcomes = batch_of_creates(
        service, lambda: refuse_inserts(engine, events_table.name, "no events today")
    )
    for outcome in outcomes:
        assert isinstance(outcome, StoreUnavailable), outcome
        assert outcome.store == "sql"
    for user in USERS:
        assert orders_of(engine, user) == {}
        assert service.index.members(user) == {}
