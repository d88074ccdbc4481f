"""What a run of tests/support/workers/pg.py must leave behind, whatever broke under it.

Shared by the PostgreSQL restart test and the Redis Cluster fault tests: every worker's
calls ended in a result or a typed error; nothing the workers were told has happened is
missing from SQL; after a reconcile the Redis index equals SQL. (That no user ever held
more unpaid orders than the limit: ``tests.support.monitor``.)
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from orders.config import Settings
from orders.index.nodes import RedisClient
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.stores import sql_rows


def read_acks(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_typed_outcomes(results: list[dict[str, Any]], allowed: set[str]) -> int:
    """No worker saw an error outside ``allowed`` (exception type names) or an untyped
    one; returns how many calls failed in all."""
    failed = 0
    for r in results:
        assert r["errors"] == 0, r["error_samples"]
        for op, data in r["ops"].items():
            assert set(data["failed"]) <= allowed, (r["name"], op, data)
            failed += sum(data["failed"].values())
    return failed


def assert_acknowledged_in_sql(engine: Engine, acks: list[list[dict[str, Any]]]) -> Counter[str]:
    """Each acknowledged create is a row, each payment paid with its reference, each close
    closed; returns the acknowledged operations counted by kind."""
    rows = sql_rows(engine)
    creates = [a for log in acks for a in log if a["op"] == "create"]
    pays = [a for log in acks for a in log if a["op"] == "pay"]
    closes = Counter(
        tuple(c) for log in acks for a in log if a["op"] == "close" for c in a["closed"]
    )
    assert creates, "no create was acknowledged"
    for a in creates:
        row = rows.get(a["id"])
        assert row is not None, f"acknowledged create {a['id']} is missing"
        assert (row.user_id, row.expires_at_ms) == (a["user"], a["expires"])
    for a in pays:
        assert (rows[a["id"]].status, rows[a["id"]].payment_ref) == ("paid", a["ref"]), a
    in_sql = Counter(
        (row.user_id, row.expires_at_ms, row.closed_at_ms)
        for row in rows.values()
        if row.status == "closed"
    )
    missing = closes - in_sql
    assert not missing, f"acknowledged closes missing from SQL: {list(missing)[:5]}"
    return Counter(create=len(creates), pay=len(pays), close=sum(closes.values()))


def assert_index_equals_sql_after_reconcile(
    engine: Engine, client: RedisClient, settings: Settings
) -> int:
    """Reconcile at a frozen instant (the last write), then each user's set holds exactly
    the user's unpaid orders not yet expired, and no other user has a key. Returns how many
    members the index holds."""
    rows = sql_rows(engine)
    frozen = ManualClock(max(row.updated_at_ms for row in rows.values()))
    checker = OrderService(engine, client, settings, clock=frozen)
    checker.reconcile()
    rows = sql_rows(engine)
    expected: dict[str, dict[str, int]] = {}
    for oid, row in rows.items():
        if row.status == "unpaid" and row.expires_at_ms > frozen():
            expected.setdefault(row.user_id, {})[oid] = row.expires_at_ms
    for user in {row.user_id for row in rows.values()}:
        assert checker.index.members(user) == expected.get(user, {}), user
    with_keys = {user for batch in checker.index.scan_users() for user in batch}
    assert with_keys == set(expected), with_keys ^ set(expected)
    return sum(len(members) for members in expected.values())
