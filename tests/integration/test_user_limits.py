"""Per-user limits: set, lowered, 0, cleared; honoured by admit.lua and by the SQL guard
alike, with Redis intact or flushed; rebuilt by reconcile; one hash slot per user."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
from redis.crc import key_slot
from sqlalchemy import Engine, func, select, text

from orders import InvalidInput, Order, OrderService, SchemaNotReady, UnpaidOrderLimitReached
from orders.domain import Actor, ActorKind
from orders.index.keys import limit_key
from orders.index.unpaid import UnpaidIndex
from orders.sql.models import orders_table, user_limit_history_table, user_limits_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.stats import collect_stats
from tests.support.clocks import ManualClock
from tests.support.stores import flush_db
from tests.support.threads import outcomes_of_race

#: The contract holds on one Redis server and on a Redis Cluster, through both APIs.
pytestmark = [pytest.mark.cluster_too, pytest.mark.both_apis]


def unpaid_in_sql(engine: Engine, user_id: str) -> int:
    query = select(func.count()).where(orders_table.c.user_id == user_id, UNPAID_PREDICATE)
    with engine.connect() as conn:
        return int(conn.scalar(query) or 0)


def limit_rows(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(select(user_limits_table.c.user_id, user_limits_table.c.unpaid_limit))
        return {row.user_id: row.unpaid_limit for row in rows}


def create_n(service: OrderService, user_id: str, n: int) -> list[Order]:
    return [service.create_unpaid_order(user_id, ttl_s=600) for _ in range(n)]


def refusal(service: OrderService, user_id: str) -> UnpaidOrderLimitReached:
    with pytest.raises(UnpaidOrderLimitReached) as refused:
        service.create_unpaid_order(user_id, ttl_s=600)
    return refused.value


def test_a_raised_limit_admits_past_the_settings_limit_and_a_lowered_one_refuses_below_it(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    assert service.settings.unpaid_limit == 3
    raised = service.set_user_limit("u1", 5, actor="ops-anna")
    assert (raised.limit, raised.own, raised.updated_at_ms) == (5, True, clock())
    assert raised.actor == Actor(ActorKind.APPLICATION, "ops-anna")

    create_n(service, "u1", 5)
    assert refusal(service, "u1").limit == 5
    create_n(service, "u2", 3)  # another user keeps the settings' limit
    assert refusal(service, "u2").limit == 3

    clock.advance(s=1)
    service.set_user_limit("u1", 2)
    refused = refusal(service, "u1")
    assert (refused.limit, refused.open_count, refused.source) == (2, 5, "redis")
    shown = service.user_limit("u1")
    assert (shown.limit, shown.own, shown.updated_at_ms) == (2, True, clock())
    assert unpaid_in_sql(engine, "u1") == 5  # orders already held stay
    assert service.index.limits.read("u1") == 2


def test_limit_zero_refuses_with_a_typed_error_that_says_so_and_writes_nothing(
    service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    service.set_user_limit("u1", 0)

    refused = refusal(service, "u1")

    assert isinstance(refused, UnpaidOrderLimitReached)
    assert (refused.limit, refused.open_count, refused.retry_after_s) == (0, 0, 0)
    assert "may hold no unpaid orders" in str(refused)
    assert unpaid_in_sql(engine, "u1") == 0
    assert service.index.members("u1") == {}
    assert not redis_client.exists(service.index.admits_key("u1"))


def test_limit_zero_refuses_in_sql_too_when_redis_lost_its_key(
    service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    service.set_user_limit("u1", 0)
    flush_db(redis_client)

    refused = refusal(service, "u1")

    assert (refused.limit, refused.source) == (0, "sql")
    assert "may hold no unpaid orders" in str(refused)
    assert unpaid_in_sql(engine, "u1") == 0
    assert service.index.members("u1") == {}
    assert service.index.limits.read("u1") == 0  # the repair wrote the key back
    assert refusal(service, "u1").source == "redis"


def test_clear_returns_the_user_to_the_settings_limit_in_both_stores(
    service: OrderService, engine: Engine
) -> None:
    service.set_user_limit("u1", 1)
    create_n(service, "u1", 1)
    assert refusal(service, "u1").limit == 1

    cleared = service.clear_user_limit("u1", actor="ops")
    # Who cleared it outlives the row it removed, in the history.
    [change, _] = service.user_limit_history("u1")
    assert (change.limit, change.actor) == (None, Actor(ActorKind.APPLICATION, "ops"))

    assert (cleared.limit, cleared.own, cleared.updated_at_ms) == (3, False, None)
    assert service.user_limit("u1") == cleared
    assert limit_rows(engine) == {}
    assert service.index.limits.read("u1") is None
    create_n(service, "u1", 2)
    assert service.clear_user_limit("u1").own is False  # idempotent


@pytest.mark.rotate("database_url", "api", "redis_kind")
@pytest.mark.parametrize("wrong", [-1, 1_000_001, True, "3", 2.0, None])
def test_a_limit_out_of_range_or_not_an_int_is_invalid_before_anything_is_written(
    service: OrderService, engine: Engine, redis_client: redis.Redis, wrong: object
) -> None:
    with pytest.raises(InvalidInput) as refused:
        service.set_user_limit("u1", wrong)  # type: ignore[arg-type]
    assert refused.value.field == "limit"
    assert limit_rows(engine) == {}
    assert service.index.limits.read("u1") is None


def test_the_limits_range_ends_are_accepted_and_the_stats_count_the_users(
    service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    assert collect_stats(engine, clock).users_with_own_limit == 0
    service.set_user_limit("u1", 0)
    service.set_user_limit("u2", 1_000_000)
    service.set_user_limit("u2", 4)  # the same user: still one row
    assert limit_rows(engine) == {"u1": 0, "u2": 4}
    assert collect_stats(engine, clock).users_with_own_limit == 2


@pytest.mark.parametrize("redis_lost", [False, True], ids=["redis_intact", "redis_flushed"])
def test_a_lowered_limit_holds_while_holders_above_it_are_unpaid(
    service: OrderService, engine: Engine, redis_client: redis.Redis, redis_lost: bool
) -> None:
    """Holders in slots 1..3, the limit lowered to 1, slot 1's order paid: slots 2 and 3
    still hold unpaid orders, so a create is refused (by SQL alone when Redis lost all)."""
    first, second, third = create_n(service, "u1", 3)
    service.set_user_limit("u1", 1)
    service.mark_paid(first.id)
    if redis_lost:
        flush_db(redis_client)

    refused = refusal(service, "u1")

    assert refused.limit == 1
    assert refused.source == ("sql" if redis_lost else "redis")
    assert unpaid_in_sql(engine, "u1") == 2
    # The repair writes SQL's holders back through the admission script: at most the limit.
    members = set(service.index.members("u1"))
    assert members <= {second.id, third.id}
    assert len(members) == (1 if redis_lost else 2)
    assert service.index.limits.read("u1") == 1
    service.cancel_order(second.id)
    assert refusal(service, "u1").open_count == 1
    service.cancel_order(third.id)
    admitted = service.create_unpaid_order("u1", ttl_s=600)
    assert unpaid_in_sql(engine, "u1") == 1
    assert set(service.index.members("u1")) == {admitted.id}


def test_the_sql_guard_never_lets_a_user_over_a_lowered_limit_after_redis_lost_data(
    service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    """Lowered from 3 to 2 with three holders: whichever leaves, SQL alone (Redis flushed
    before every create) never admits a third."""
    held = create_n(service, "u1", 3)
    service.set_user_limit("u1", 2)
    refused_limits = set()
    for leaving in held:
        service.cancel_order(leaving.id)
        for _ in range(3):
            flush_db(redis_client)
            try:
                service.create_unpaid_order("u1", ttl_s=600)
            except UnpaidOrderLimitReached as refused:
                refused_limits.add((refused.limit, refused.source))
            assert unpaid_in_sql(engine, "u1") <= 2
    assert unpaid_in_sql(engine, "u1") == 2
    assert refused_limits == {(2, "sql")}


@pytest.mark.parametrize("redis_lost", [False, True], ids=["redis_intact", "redis_flushed"])
def test_concurrent_creates_at_a_lowered_limit_never_exceed_it(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: redis.Redis,
    redis_lost: bool,
) -> None:
    service = make_service(unpaid_limit=10)
    for round_ in range(4):
        user = f"u{round_}"
        create_n(service, user, 1)
        service.set_user_limit(user, 3)
        if redis_lost:
            flush_db(redis_client)

        outcomes = outcomes_of_race(
            [lambda u=user: service.create_unpaid_order(u, ttl_s=600) for _ in range(6)]
        )

        admitted = [o for o in outcomes if isinstance(o, Order)]
        refused = [o for o in outcomes if isinstance(o, UnpaidOrderLimitReached)]
        assert len(admitted) + len(refused) == 6, outcomes
        assert len(admitted) == 2
        assert {r.limit for r in refused} == {3}
        assert unpaid_in_sql(engine, user) == 3
        members = service.index.members(user)
        assert {o.id for o in admitted} <= set(members)
        assert len(members) <= 3


def test_the_limit_key_shares_the_users_hash_slot(
    service: OrderService, redis_client: redis.Redis
) -> None:
    """On a cluster the admission script (three keys) would be refused otherwise."""
    for user in ("u1", "user-with-a-long-id-0123456789", "ü-7"):
        assert key_slot(service.index.limits.key(user).encode()) == key_slot(
            service.index.key(user).encode()
        )
    tagged = UnpaidIndex(redis_client, key_prefix="shop:{eu}:")
    assert key_slot(tagged.limits.key("u1").encode()) == key_slot(b"eu")
    assert limit_key("shop:{eu}:u1", "shop:{eu}:").startswith("shop:{eu}:[limit]")
    service.set_user_limit("ü-7", 1)
    create_n(service, "ü-7", 1)
    assert refusal(service, "ü-7").limit == 1


def test_reconcile_writes_every_limit_key_from_sql_and_removes_those_without_a_row(
    service: OrderService, redis_client: redis.Redis
) -> None:
    service.set_user_limit("u1", 1)
    service.set_user_limit("u2", 0)
    create_n(service, "u1", 1)
    flush_db(redis_client)
    redis_client.set(service.index.limits.key("u3"), 7)  # its row is gone

    dry = service.reconcile(dry_run=True, chunk_size=1)
    assert (dry.limits_written, dry.limits_removed) == (2, 1)
    assert service.index.limits.read("u1") is None
    report = service.reconcile(chunk_size=1)

    assert (report.limits_written, report.limits_removed) == (2, 1)
    assert [service.index.limits.read(u) for u in ("u1", "u2", "u3")] == [1, 0, None]
    assert refusal(service, "u1").source == "redis"
    assert refusal(service, "u2").source == "redis"


def test_reconcile_of_one_user_fixes_its_limit_key(
    service: OrderService, redis_client: redis.Redis
) -> None:
    service.set_user_limit("u1", 2)
    redis_client.delete(service.index.limits.key("u1"))
    redis_client.set(service.index.limits.key("u2"), 1)

    first = service.reconcile(user_id="u1")
    second = service.reconcile(user_id="u2")

    assert (first.limits_written, first.limits_removed) == (1, 0)
    assert (second.limits_written, second.limits_removed) == (0, 1)
    assert service.index.limits.read("u1") == 2
    assert service.index.limits.read("u2") is None


def test_a_raised_limit_whose_key_redis_lost_refuses_at_the_settings_limit_until_reconcile(
    service: OrderService, redis_client: redis.Redis
) -> None:
    """Redis refuses first and SQL is not asked: a raised limit needs its key."""
    service.set_user_limit("u1", 5)
    flush_db(redis_client)
    create_n(service, "u1", 3)
    refused = refusal(service, "u1")
    assert (refused.limit, refused.source) == (3, "redis")

    service.reconcile()

    create_n(service, "u1", 2)
    assert refusal(service, "u1").limit == 5


def test_every_set_and_clear_is_kept_in_the_users_history_newest_first(
    service: OrderService, clock: ManualClock
) -> None:
    start_ms = clock()
    service.set_user_limit("u1", 5, actor="ops-anna")
    clock.advance(s=1)
    service.set_user_limit("u1", 2, actor="ops-ben")
    service.set_user_limit("u2", 1, actor="ops-ben")
    clock.advance(s=1)
    service.clear_user_limit("u1", actor="ops-cleo")
    service.clear_user_limit("u1", actor="ops-dan")  # nothing left to clear: no change

    history = service.user_limit_history("u1")

    app = ActorKind.APPLICATION
    assert [(c.user_id, c.limit, c.changed_at_ms, c.actor) for c in history] == [
        ("u1", None, start_ms + 2000, Actor(app, "ops-cleo")),
        ("u1", 2, start_ms + 1000, Actor(app, "ops-ben")),
        ("u1", 5, start_ms, Actor(app, "ops-anna")),
    ]
    assert [c.limit for c in service.user_limit_history("u2")] == [1]
    assert service.user_limit_history("u3") == []


def test_a_limit_change_whose_history_cannot_be_written_changes_nothing(
    service: OrderService, engine: Engine
) -> None:
    service.set_user_limit("u1", 5)
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {user_limit_history_table.name}"))

    with pytest.raises(SchemaNotReady):
        service.set_user_limit("u1", 2)
    with pytest.raises(SchemaNotReady):
        service.clear_user_limit("u1")

    assert limit_rows(engine) == {"u1": 5}
