"""Three sweeper processes draining the same backlog of due orders.

The backlog is written straight into SQL (rows plus their ``created`` events) with expired
Redis members beside them, as a crashed or paused scheduler would leave it. Three worker
processes, released together, each call ``sweep_expired(batch_size=100)`` until nothing is
due. PostgreSQL shares the work out with ``FOR UPDATE SKIP LOCKED``; SQLite takes the
writers one at a time (so there one process may close nothing). Either way every order is
closed exactly once, and every batch stays within its size.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, insert, select

from orders.config import Settings
from orders.domain import OrderStatus
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import now_ms
from tests.support.processes import started
from tests.support.stores import key_count

UNPAID = OrderStatus.UNPAID.value

OC = orders_table.c
EC = events_table.c

SWEEPERS = 3
BATCH = 100
USERS = 100


#: The issue's size; it runs in seconds on both engines, so CI runs it in full too.
BACKLOG = 10_000


def write_backlog(engine: Engine, client: redis.Redis, key_prefix: str, count: int) -> None:
    """``count`` unpaid orders, all due (expired up to a minute ago), and their Redis members."""
    now = now_ms()
    rows: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    members: dict[str, dict[str, int]] = {}
    for n in range(count):
        oid, user = f"due-{n:06d}", f"backlog-{n % USERS}"
        expires = now - 1_000 - (n * 7919) % 60_000  # a shuffled spread of expiries
        created = expires - 30_000
        rows.append(
            {
                "id": oid,
                "user_id": user,
                "status": UNPAID,
                "created_at_ms": created,
                "expires_at_ms": expires,
                "updated_at_ms": created,
            }
        )
        events.append({"order_id": oid, "user_id": user, "kind": "created", "at_ms": created})
        members.setdefault(user, {})[oid] = expires
    with engine.begin() as conn:
        conn.execute(insert(orders_table), rows)
        conn.execute(insert(events_table), events)
    pipe = client.pipeline(transaction=False)
    for user, mapping in members.items():
        pipe.zadd(f"{key_prefix}{user}", mapping)  # type: ignore[arg-type,unused-ignore]
    pipe.execute()


def counts(rows: Iterable[Any]) -> dict[str, int]:
    """(key, count) rows as a dict."""
    return {str(row[0]): int(row[1]) for row in rows}


@pytest.mark.rotate("redis_kind")  # CI time: each engine on one topology (both: --full)
@pytest.mark.slow
@pytest.mark.cluster_too
@pytest.mark.timeout(400)
def test_three_sweeper_processes_close_each_due_order_exactly_once(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    tmp_path: Path,
) -> None:
    count = BACKLOG
    service = OrderService(
        engine, redis_client, Settings(database_url=database_url, **redis_options)
    )
    write_backlog(engine, redis_client, service.settings.key_prefix, count)
    assert service.count_due() == count
    assert key_count(redis_client) == USERS

    specs = [
        ("drain", {"name": f"sweeper{n}", "batch_size": BATCH, "deadline_s": 300})
        for n in range(SWEEPERS)
    ]
    with started(
        specs, database_url=database_url, redis_options=redis_options, log_dir=tmp_path
    ) as workers:
        for worker in workers:
            worker.go()
        results = [worker.result(timeout_s=320) for worker in workers]

    errors = [s for r in results for s in r["error_samples"]]
    assert sum(r["errors"] for r in results) == 0, errors
    closed = [r["closed"] for r in results]
    assert sum(closed) == count  # none closed twice, none skipped
    for r in results:
        assert r["closed"] <= r["batches"] * BATCH  # no batch closed more than its size
        assert r["redis_errors"] == 0
    if engine.dialect.name == "postgresql":
        # SKIP LOCKED shares the backlog out. (SQLite hands its write lock to whichever
        # writer asks when it frees, so one process may sit the whole run out there.)
        assert sum(1 for c in closed if c > 0) >= 2, f"the sweepers did not share: {closed}"

    with engine.connect() as conn:
        status = counts(conn.execute(select(OC.status, func.count()).group_by(OC.status)))
        per_order = counts(
            conn.execute(
                select(EC.order_id, func.count()).where(EC.kind == "closed").group_by(EC.order_id)
            )
        )
        kinds = counts(conn.execute(select(EC.kind, func.count()).group_by(EC.kind)))
        bad_rows = conn.execute(
            select(func.count()).where(
                OC.status == "closed",
                (OC.close_reason != "expired") | (OC.closed_at_ms < OC.expires_at_ms),
            )
        ).scalar_one()
    assert status == {"closed": count}
    assert len(per_order) == count
    assert set(per_order.values()) == {1}  # one closed event per order
    assert kinds == {"created": count, "closed": count}
    assert bad_rows == 0
    assert service.count_due() == 0
    assert key_count(redis_client) == 0, "expired members left in Redis"

    print(
        f"\n[parallel sweepers, {engine.dialect.name}] {count} due orders of {USERS} users, "
        f"{SWEEPERS} processes with batch size {BATCH}: closed per process {closed}, "
        f"batches {[r['batches'] for r in results]}, calls {[r['calls'] for r in results]} "
        f"(idle {[r['idle_calls'] for r in results]}), "
        f"elapsed {[r['elapsed_s'] for r in results]} s"
    )
