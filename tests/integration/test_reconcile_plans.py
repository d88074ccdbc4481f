"""Reconcile's reads are bound by the open orders, not by history (issue 46).

With 10**6 paid, cancelled and closed orders beside the open ones, every read of the orders
table a reconcile makes (the rebuild's pages, the stale-add check, the SCAN pass's batch, the
extras' owners, a one-user run) is planned as the driver runs it (prepared, generic plan:
``tests.support.plans.explain_sql``) onto the per-user partial index over unpaid orders or
the primary key: never the table, never the expiry index (which walks every open order and
sorts them, once per page: n^2 in the open orders, and picked by PostgreSQL's generic plan
once history skews the statistics); and a page or batch bounds that index scan by its users.
"""

from __future__ import annotations

import re

import redis
from sqlalchemy import Engine, insert

from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.plans import add_history, captured, explain_sql

NOW_MS = 1_800_000_000_000
USERS = 2000
HISTORY = 10**6
#: The indexes a reconcile read may use: per user over unpaid orders, or the primary key.
BOUND_INDEX = r"ix_oes_orders_unpaid_user_id_\w+|pk_oes_orders|sqlite_autoindex_oes_orders_1"
#: The parameters that carry a page's or batch's users: its scan must start at them.
USER_BOUNDS = {"after_user", "first", "users"}


def open_orders(engine: Engine) -> None:
    """Two open orders for each of the users ``add_history`` names."""
    rows = [
        {
            "id": f"o{u}-{k}",
            "user_id": f"user{u:09d}",
            "status": "unpaid",
            "created_at_ms": NOW_MS - 1000,
            "expires_at_ms": NOW_MS + 60_000 + 1000 * k + u,
            "updated_at_ms": NOW_MS - 1000,
        }
        for u in range(USERS)
        for k in range(2)
    ]
    with engine.begin() as conn:
        conn.execute(insert(orders_table), rows)


def check_bound(engine: Engine, sql: str, params: object) -> None:
    plan = explain_sql(engine, sql, params)
    names = set(params) if isinstance(params, dict) else set()
    if engine.dialect.name == "sqlite":
        reads = [line for line in plan.splitlines() if "oes_orders" in line]
        assert reads, plan
        for line in reads:
            assert re.search(rf"USING (COVERING )?INDEX ({BOUND_INDEX})", line), plan
        assert "USE TEMP B-TREE FOR ORDER BY" not in plan, plan  # a sort of every open order
        bound = any(re.search(r"SEARCH .*\(user_id[=>]", line) for line in reads)
    else:
        assert "Seq Scan" not in plan, plan
        used = re.findall(r"(?:using|Bitmap Index Scan on) (\w+)", plan)
        assert used, plan
        assert all(re.fullmatch(BOUND_INDEX, name) for name in used), plan
        bound = re.search(r"Index Cond: .*user_id", plan) is not None
    # The SQLite statements name their parameters by position: the users are in the SQL.
    if names & USER_BOUNDS or "json_each" in sql:
        assert bound, plan


def test_every_reconcile_read_is_bound_by_open_orders_beside_a_million_closed_ones(
    service: OrderService, engine: Engine, redis_client: redis.Redis, clock: ManualClock
) -> None:
    clock.set(NOW_MS)
    open_orders(engine)
    add_history(engine, HISTORY, USERS, NOW_MS)
    redis_client.flushdb()
    with captured(engine) as seen:
        rebuilt = service.reconcile()  # the rebuild: pages and stale-add checks
        # A member of a paid order: the SCAN pass's batch and the extras' owners read SQL.
        redis_client.zadd(service.index.key("user000000000"), {"h0": NOW_MS + 60_000})
        repaired = service.reconcile()
        service.reconcile(user_id="user000000001")
    assert (rebuilt.users, rebuilt.added) == (USERS, 2 * USERS)
    assert repaired.removed_terminal == 1
    # The waiting lists' recovery pass reads orders by primary key, one per waiting entry
    # (none here): bound by the queues, not by history.
    reads = {
        sql: params for sql, params in seen if "FROM oes_orders" in sql and "oes_waiting" not in sql
    }
    assert len(reads) == 5  # the page, the range, the idle users, the owners, the one user
    for sql, params in reads.items():
        check_bound(engine, sql, params)
