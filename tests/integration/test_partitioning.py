"""docs/partitioning.sql: orders and order_events hash-partitioned by user_id, on PostgreSQL.

The DDL is applied to a fresh database of the tests' PostgreSQL, and the service runs on it
unchanged: creates, payments, cancels and the sweep leave the rows, their events and the
Redis index as on the migrated schema, the limit holds in SQL through the partial unique
slot index (now enforced per partition) when Redis has lost its data, an order id stays
unique across users (through ``oes_order_ids``), and the statements that name a user read one
partition while those by order id alone read all. Only PostgreSQL: SQLite has no
partitioning. Breaking the DDL turns these red: without the ``oes_order_ids`` trigger a second
user gets the same order id; with a non-unique slot index every create fails.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from sqlalchemy import Engine, make_url, text

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.errors import OrderConflict, StoreUnavailable, UnpaidOrderLimitReached
from orders.policies import ExpiryPolicy
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.postgres import PostgresTarget

DDL = Path(__file__).resolve().parents[2] / "docs" / "partitioning.sql"
PARTITIONS = 16


@pytest.fixture
def partitioned(postgres: PostgresTarget | str) -> Iterator[Engine]:
    """A fresh database holding docs/partitioning.sql and nothing else."""
    if isinstance(postgres, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL tests must run in CI: {postgres}")
        pytest.skip(f"PostgreSQL not available: {postgres}")
    name = postgres.new_database()
    url = postgres.url(name)
    engine = build_engine(Settings(database_url=url))
    try:
        dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        with psycopg.connect(dsn) as conn:
            conn.execute(DDL.read_text().encode())
        yield engine
    finally:
        engine.dispose()
        postgres.drop_database(name)


@pytest.fixture
def service(partitioned: Engine, redis_client: redis.Redis, clock: ManualClock) -> OrderService:
    settings = Settings(unpaid_limit=3, default_policy=ExpiryPolicy(ttl_s=60))
    return OrderService(partitioned, redis_client, settings, clock=clock)


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return {
            r.id: r.status
            for r in conn.execute(text(f"SELECT id, status FROM {orders_table.name}"))
        }


def event_kinds(engine: Engine) -> Counter[tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.execute(text(f"SELECT order_id, kind FROM {events_table.name}")).all()
    return Counter((r.order_id, r.kind) for r in rows)


def test_schema_is_partitioned_by_user_and_the_slot_index_stays_partial_and_unique(
    partitioned: Engine,
) -> None:
    with partitioned.connect() as conn:
        strategy: dict[str, str] = dict(
            conn.execute(
                text(
                    "SELECT c.relname, p.partstrat FROM pg_partitioned_table p "
                    "JOIN pg_class c ON c.oid = p.partrelid"
                )
            ).all()
        )
        slot_indexes = conn.execute(
            text(
                "SELECT i.indisunique, pg_get_expr(i.indpred, i.indrelid) FROM pg_index i "
                "JOIN pg_class c ON c.oid = i.indexrelid "
                "WHERE c.relname LIKE 'oes_orders_p%_user_id_slot_idx'"
            )
        ).all()
    assert strategy == {orders_table.name: "h", events_table.name: "h", "oes_order_ids": "h"}
    assert len(slot_indexes) == PARTITIONS
    assert all(unique and "'unpaid'" in str(where) for unique, where in slot_indexes)


def test_create_pay_cancel_and_sweep_run_unchanged_on_partitioned_tables(
    service: OrderService, partitioned: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    users = [f"user-{i}" for i in range(40)]
    made = [service.create_unpaid_order(u, amount="9.50", currency="EUR") for u in users]
    paid, cancelled, left = made[:10], made[10:20], made[20:]
    for order in paid:
        service.mark_paid(order.id, payment_ref=f"ref-{order.id}")
    for order in cancelled:
        service.cancel_order(order.id)
    clock.advance(s=61)

    result = service.sweep_expired()

    assert result.closed == len(left)
    expected = {o.id: "paid" for o in paid}
    expected |= {o.id: "cancelled" for o in cancelled}
    expected |= {o.id: "closed" for o in left}
    assert statuses(partitioned) == expected
    kinds = {"paid": "paid", "cancelled": "cancelled", "closed": "closed"}
    assert event_kinds(partitioned) == Counter(
        [(o, "created") for o in expected] + [(o, kinds[s]) for o, s in expected.items()]
    )
    assert list(redis_client.scan_iter("UnpaidOrder-user-*")) == []
    with partitioned.connect() as conn:
        used = conn.execute(
            text(f"SELECT count(DISTINCT tableoid) FROM {orders_table.name} UNION ALL "
                 f"SELECT count(DISTINCT tableoid) FROM {events_table.name}")
        ).scalars().all()  # fmt: skip
    assert min(used) > 1  # the rows really are spread over partitions


def test_limit_holds_in_sql_per_partition_after_redis_lost_its_data(
    service: OrderService, partitioned: Engine, redis_client: redis.Redis
) -> None:
    held = [service.create_unpaid_order("buyer-7") for _ in range(3)]
    redis_client.flushall()  # Redis forgets: only the partial unique slot index can refuse

    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("buyer-7")

    assert statuses(partitioned) == {o.id: "unpaid" for o in held}
    assert set(service.index.members("buyer-7")) == {o.id for o in held}  # repaired from SQL


def partitions_read(engine: Engine, statement: str) -> set[str]:
    """The partitions of oes_orders the plan of ``statement`` visits."""
    with engine.connect() as conn:
        lines = conn.execute(text(f"EXPLAIN {statement}")).scalars()
        return {name for line in lines for name in re.findall(rf"\b{orders_table.name}_p\d+", line)}


def test_statements_naming_the_user_read_one_partition_those_by_id_alone_read_all(
    partitioned: Engine,
) -> None:
    orders = orders_table.name
    by_user = f"SELECT slot FROM {orders} WHERE user_id = 'u-1' AND status = 'unpaid'"
    by_id = f"UPDATE {orders} SET status = 'paid' WHERE id = 'x'"
    by_both = f"UPDATE {orders} SET status = 'paid' WHERE id = 'x' AND user_id = 'u-1'"

    assert len(partitions_read(partitioned, by_user)) == 1
    assert len(partitions_read(partitioned, by_id)) == PARTITIONS
    assert len(partitions_read(partitioned, by_both)) == 1


def test_an_order_id_stays_unique_across_users_and_partitions(
    service: OrderService, partitioned: Engine
) -> None:
    first = service.create_unpaid_order("alice", order_id="checkout-1")
    others = [f"bob-{i}" for i in range(PARTITIONS * 2)]  # some land in other partitions

    for user in others:
        with pytest.raises(OrderConflict):
            service.create_unpaid_order(user, order_id="checkout-1")

    assert service.create_unpaid_order("alice", order_id="checkout-1") == first  # a retry
    assert statuses(partitioned) == {"checkout-1": "unpaid"}
    with partitioned.connect() as conn:
        ids = conn.execute(text("SELECT id, user_id FROM oes_order_ids")).all()
    assert [tuple(r) for r in ids] == [("checkout-1", "alice")]


def test_erasure_is_refused_by_the_foreign_keys_on_user_id_with_the_user_kept(
    partitioned: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    """Not supported here (docs/operations.md, Erasure): the events' and refusals' keys
    name the user id, and oes_order_ids keeps it. Step 2 has run (unpaid orders cancelled);
    step 3 is rolled back whole."""
    settings = Settings(
        unpaid_limit=3,
        default_policy=ExpiryPolicy(ttl_s=60),
        erasure_key="erasure-key-of-the-tests",
    )
    shop = OrderService(partitioned, redis_client, settings, clock=clock)
    paid, unpaid = shop.create_unpaid_order("alice"), shop.create_unpaid_order("alice")
    shop.mark_paid(paid.id, payment_ref="ref-1")

    with pytest.raises(StoreUnavailable, match="constraint"):
        shop.erase_user("alice")

    assert statuses(partitioned) == {paid.id: "paid", unpaid.id: "cancelled"}
    with partitioned.connect() as conn:
        users = conn.execute(text(f"SELECT DISTINCT user_id FROM {orders_table.name}")).all()
    assert [tuple(r) for r in users] == [("alice",)]
