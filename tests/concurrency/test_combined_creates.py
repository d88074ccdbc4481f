"""Concurrent creates combined (``Settings.combine_creates``, ``orders.rules.combining``).

Threads released together by a barrier create at once; the combiner's counters show that
batches of several creates really formed (so combining cannot be silently off), and then:

* each caller got its own order (its user, its amount, its expiry) or its own refusal;
* SQL holds exactly the orders returned, each with one ``created`` event, and the Redis
  index equals SQL;
* one user at the limit gets exactly ``limit`` orders, also after FLUSHDB, when only the
  SQL guard stands in the way (the batch then leaves the orders it could not insert to the
  single path, which refuses them and writes the index back);
* retries and twins (the same ``order_id`` twice in one batch) get the one order;
* a leader interrupted in its batch's insert, before the commit, leaves no row and no
  member of its own order, and each follower completes alone from Redis's answer;
* a create alone runs at once, without joining a batch; a create in the host's
  transaction and one with ``on_limit="replace_oldest"`` are never combined.
"""

from __future__ import annotations

from collections import Counter
from decimal import Decimal
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine, select

from orders.config import Settings
from orders.domain import Order
from orders.errors import CreateRateLimited, UnpaidOrderLimitReached
from orders.rules.batching import CombinerStats
from orders.rules.combining import CreateCombiner
from orders.service import OrderService
from orders.sql.models import events_table
from orders.sql.slot_batch import SlotBatch
from tests.support.clocks import ManualClock
from tests.support.doubles import gated_race, pausing_after_admit
from tests.support.stores import events_of, flush_db, orders_of
from tests.support.threads import outcomes_of_race

THREADS = 32
#: Rounds of THREADS creates at most, until a batch of several has formed (it does in the
#: first round on an idle machine).
ROUNDS = 10


def combined_service(
    engine: Engine, redis_client: redis.Redis, database_url: str, opts: dict[str, Any], clock: Any
) -> OrderService:
    settings = Settings(database_url=database_url, combine_creates=True, **opts)
    return OrderService(engine, redis_client, settings, clock=clock)


def combiner_of(service: OrderService) -> CreateCombiner:
    combiner = service.combiner
    assert combiner is not None, "combine_creates=True built no combiner"
    return combiner


def snapshot(stats: CombinerStats) -> tuple[int, int, int, int]:
    return (stats.alone, stats.waited_alone, stats.batches, stats.combined)


def assert_one_created_event_each(engine: Engine, user: str, order_ids: set[str]) -> None:
    events = events_of(engine, user)
    assert set(events) == order_ids
    assert all(kinds == ["created"] for kinds in events.values()), events


@pytest.mark.timeout(120)
def test_creates_for_distinct_users_share_batches_and_each_gets_its_own_order(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
) -> None:
    service = combined_service(engine, redis_client, database_url, redis_options, clock)
    stats = combiner_of(service).stats
    service.create_unpaid_order("warm-up", ttl_s=60)  # first connects, outside the race
    returned: dict[str, Order] = {}
    for round_ in range(ROUNDS):

        def create(n: int, round_: int = round_) -> Order:
            # Each caller's own amount and time to pay: another's order would show.
            return service.create_unpaid_order(
                f"u{round_}-{n}",
                ttl_s=60 + n,
                amount=Decimal(n + 1),
                currency="EUR",
                metadata={"cart": n, "gift": n % 2 == 0},
                actor=f"checkout-{n}",
            )

        outcomes = outcomes_of_race([lambda n=n: create(n) for n in range(THREADS)])
        for n, order in enumerate(outcomes):
            assert isinstance(order, Order), order
            assert order.user_id == f"u{round_}-{n}"
            assert order.amount == Decimal(n + 1)
            assert order.metadata == {"cart": n, "gift": n % 2 == 0}
            assert order.expires_at_ms - order.created_at_ms == (60 + n) * 1000
            returned[order.id] = order
        if stats.largest > 1:
            break
    assert stats.batches > 0, f"no batch formed: {stats}"
    assert stats.largest > 1, f"no batch of several formed: {stats}"
    # Every call is counted once: alone, alone after a wait, or in a batch.
    assert stats.calls == len(returned) + 1
    for order in returned.values():
        rows = orders_of(engine, order.user_id)
        assert set(rows) == {order.id}
        assert rows[order.id].expires_at_ms == order.expires_at_ms
        assert_one_created_event_each(engine, order.user_id, {order.id})
        assert service.index.members(order.user_id) == {order.id: order.expires_at_ms}
        assert service.get_order(order.id).metadata == order.metadata
    # Every create committed, in a batch or alone, is confirmed: no refusal asks SQL of it.
    assert service.admitter.confirmations.send() == len(returned) + 1
    admits = [service.index.admits_key(order.user_id) for order in returned.values()]
    assert not any(redis_client.exists(key) for key in admits)
    # Each created event names its own caller and time (the batch writes them together).
    with engine.connect() as conn:
        created = conn.execute(
            select(events_table.c.order_id, events_table.c.actor, events_table.c.at_ms)
        ).all()
    by_order = {row.order_id: (row.actor, row.at_ms) for row in created}
    for order in returned.values():
        n = int(order.user_id.rsplit("-", 1)[1])
        assert by_order[order.id] == (f"checkout-{n}", order.created_at_ms)
    print(f"\n[combined, {engine.dialect.name}] {len(returned)} creates: {stats}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("limit", [1, 3])
# PostgreSQL's statements sent at once (psycopg's pipeline), or one by one (other drivers).
@pytest.mark.parametrize("sending", ["direct", "through_sqlalchemy"])
def test_one_user_at_the_limit_keeps_it_in_batches_and_after_a_flush(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
    limit: int,
    sending: str,
) -> None:
    """Three batches of THREADS creates for one user: the first fills the limit, the
    second is refused by Redis, the third, after FLUSHDB, is admitted by Redis up to the
    limit and must be refused by the batch's SQL guard (then by the single path's, which
    writes the index back)."""
    combined = combined_service(engine, redis_client, database_url, redis_options, clock)
    service = pausing_after_admit(combined, lambda _user, _order: None)
    combiner = combiner_of(service)
    combiner.slot_batch = SlotBatch(service.records.tx, direct=sending == "direct")
    stats = combiner.stats
    user = "limited"
    service.create_unpaid_order("warm-up", ttl_s=60)
    admitted: set[str] = set()
    for round_ in range(3):
        if round_ == 2:
            flush_db(redis_client)  # Redis forgets the user: the SQL guard alone holds
        batches = stats.batches
        outcomes = gated_race(
            service, [lambda: service.create_unpaid_order(user, ttl_s=60, limit=limit)] * THREADS
        )
        assert stats.batches == batches + 1, f"the creates did not run as one batch: {stats}"
        orders = [o for o in outcomes if isinstance(o, Order)]
        refusals = [o for o in outcomes if isinstance(o, UnpaidOrderLimitReached)]
        assert len(orders) + len(refusals) == THREADS, Counter(type(o).__name__ for o in outcomes)
        assert all(r.open_count == limit and r.limit == limit for r in refusals)
        assert all(o.user_id == user for o in orders)
        admitted |= {o.id for o in orders}
        assert len(orders) == (limit if round_ == 0 else 0), (round_, orders)
        by_sql = [r for r in refusals if r.source == "sql"]
        assert len(by_sql) == (limit if round_ == 2 else 0), (round_, refusals)
    rows = orders_of(engine, user)
    assert set(rows) == admitted
    assert [row.status for row in rows.values()] == ["unpaid"] * limit
    assert sorted(row.slot for row in rows.values()) == list(range(1, limit + 1))
    assert_one_created_event_each(engine, user, admitted)
    # The refusals by SQL wrote the user's orders back into the flushed index.
    assert service.index.members(user) == {oid: row.expires_at_ms for oid, row in rows.items()}
    print(f"\n[combined, limit {limit}, {engine.dialect.name}] {stats}")


@pytest.mark.timeout(120)
def test_retries_and_twins_in_one_batch_get_the_one_order(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
) -> None:
    service = combined_service(engine, redis_client, database_url, redis_options, clock)
    stats = combiner_of(service).stats
    service.create_unpaid_order("warm-up", ttl_s=60)
    ids = [f"twin-{n // 2}" for n in range(THREADS)]  # each id asked twice at once

    def create(order_id: str) -> Order:
        return service.create_unpaid_order(f"user-{order_id}", order_id=order_id, ttl_s=60)

    first = outcomes_of_race([lambda oid=oid: create(oid) for oid in ids])
    again = outcomes_of_race([lambda oid=oid: create(oid) for oid in ids])  # retries
    for outcomes in (first, again):
        assert all(isinstance(o, Order) for o in outcomes), outcomes
        by_id: dict[str, set[tuple[str, int]]] = {}
        for order in outcomes:
            assert isinstance(order, Order)
            by_id.setdefault(order.id, set()).add((order.user_id, order.expires_at_ms))
        assert set(by_id) == set(ids)
        assert all(len(seen) == 1 for seen in by_id.values()), by_id
    assert stats.largest > 1, f"no batch of several formed: {stats}"
    for oid in set(ids):
        assert set(orders_of(engine, f"user-{oid}")) == {oid}
        assert_one_created_event_each(engine, f"user-{oid}", {oid})
        assert list(service.index.members(f"user-{oid}")) == [oid]


@pytest.mark.timeout(120)
def test_a_leader_interrupted_in_its_insert_leaves_nothing_of_its_own_and_followers_go_alone(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KeyboardInterrupt reaches the leader's thread in the batch's insert, its rows
    written and not committed: the shared transaction rolls back. The leader's caller gets
    the interrupt, its admission is taken back (no row, no member); each follower completes
    alone from its own admission, its order once in both stores."""
    combined = combined_service(engine, redis_client, database_url, redis_options, clock)
    service = pausing_after_admit(combined, lambda _user, _order: None)
    combiner = combiner_of(service)
    insert_all = combiner.slot_batch.insert_all
    batches: list[int] = []

    def interrupted_commit(_conn: Connection) -> None:
        raise KeyboardInterrupt

    def interrupted_insert(creates: Any) -> object:
        batches.append(len(creates))
        with monkeypatch.context() as patched:  # the batch's commit only
            patched.setattr(Connection, "commit", interrupted_commit)
            return insert_all(creates)

    monkeypatch.setattr(combiner.slot_batch, "insert_all", interrupted_insert)

    def create(user: str) -> object:
        try:
            return service.create_unpaid_order(user, ttl_s=60)
        except KeyboardInterrupt as stop:  # in whichever thread led the batch
            return stop

    users = [f"buyer-{n}" for n in range(6)]
    outcomes = gated_race(service, [lambda user=user: create(user) for user in users])
    assert batches == [len(users)], "the creates did not run as one batch"
    cut = [
        user for user, o in zip(users, outcomes, strict=True) if isinstance(o, KeyboardInterrupt)
    ]
    assert len(cut) == 1, outcomes
    for user, outcome in zip(users, outcomes, strict=True):
        if user in cut:  # the leader: nothing of its order in either store
            assert orders_of(engine, user) == {}
            assert events_of(engine, user) == {}
            assert service.index.members(user) == {}, "the interrupted leader kept its member"
            continue
        assert isinstance(outcome, Order), outcome
        assert set(orders_of(engine, user)) == {outcome.id}
        assert_one_created_event_each(engine, user, {outcome.id})
        assert service.index.members(user) == {outcome.id: outcome.expires_at_ms}


def test_a_create_alone_runs_at_once_and_some_creates_are_never_combined(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
) -> None:
    service = combined_service(engine, redis_client, database_url, redis_options, clock)
    stats = combiner_of(service).stats
    service.create_unpaid_order("alone", ttl_s=60)
    # Nothing was in flight: it ran at once by the single path, joining no batch.
    assert snapshot(stats) == (1, 0, 0, 0)
    with engine.connect() as conn:
        service.create_unpaid_order("hosted", ttl_s=60, connection=conn)
        conn.commit()
    service.create_unpaid_order("replacing", ttl_s=60, on_limit="replace_oldest")
    assert snapshot(stats) == (1, 0, 0, 0)  # neither went through the combiner
    assert set(orders_of(engine, "hosted"))
    assert set(orders_of(engine, "replacing"))
    default = OrderService(
        engine, redis_client, Settings(database_url=database_url, **redis_options)
    )
    # By default on SQLite only (issue 45: 8 callers ran slower combined on PostgreSQL).
    assert (default.combiner is not None) == (engine.dialect.name == "sqlite")
    on = Settings(database_url=database_url, combine_creates=True, **redis_options)
    assert OrderService(engine, redis_client, on).combiner is not None
    off = Settings(database_url=database_url, combine_creates=False, **redis_options)
    assert OrderService(engine, redis_client, off).combiner is None


@pytest.mark.timeout(120)
def test_the_create_rate_holds_in_a_batch(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
) -> None:
    settings = Settings(
        database_url=database_url, combine_creates=True, create_rate="5/3600", **redis_options
    )
    service = pausing_after_admit(
        OrderService(engine, redis_client, settings, clock=clock), lambda _user, _order: None
    )
    stats = combiner_of(service).stats
    outcomes = gated_race(
        service, [lambda: service.create_unpaid_order("rated", ttl_s=60, limit=100)] * THREADS
    )
    assert stats.batches == 1, stats
    orders = [o for o in outcomes if isinstance(o, Order)]
    limited = [o for o in outcomes if isinstance(o, CreateRateLimited)]
    assert len(orders) == 5, outcomes
    assert len(limited) == THREADS - 5, outcomes
    assert set(orders_of(engine, "rated")) == {o.id for o in orders}
    assert_one_created_event_each(engine, "rated", {o.id for o in orders})
