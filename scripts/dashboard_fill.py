"""The data behind scripts/dashboard_at_scale.py: a realistic shop of --orders orders, loaded
server-side (INSERT ... SELECT FROM generate_series, never row by row), its events, two
event consumers, the Redis index rebuilt from it and one scheduler's beat.

The mix over --users users: 2 % unpaid with the expiry in the next 30 minutes, 0.05 %
unpaid overdue (the sweep backlog), the rest paid, closed or cancelled uniformly over the
last 7 days; order_events gets one row per transition, in transactions of 100 000 rows;
``stock`` is a few thousand events behind with parked and retrying events, ``audit``
caught up.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import redis
from sqlalchemy import Engine

from orders.config import Settings
from orders.index.heartbeat import Heartbeats, SchedulerBeat
from orders.service import OrderService
from orders.sql import migrate

MIN_MS = 60_000
HOUR_MS = 60 * MIN_MS
WEEK_MS = 7 * 24 * HOUR_MS
EVENTS_PER_TRANSACTION = 100_000
#: The consumer the dashboard shows behind: this many events after its cursor.
STOCK_LAG = 5_000
USER = "u0"
DAMAGED_USER = "u1"
#: A consumer whose cursor is at the start (the worst case of the lag count).
FAR = "new-consumer"

# --- the data -------------------------------------------------------------------------------

COLUMNS = (
    "id, user_id, status, created_at_ms, expires_at_ms, updated_at_ms, paid_at_ms, "
    "closed_at_ms, close_reason, payment_ref, slot, extensions"
)


def order_groups(total: int, users: int, now: int) -> list[tuple[str, int, str]]:
    """(name, row count, SELECT list over i = 1..count) per kind of order; ``{o}`` is the
    offset that keeps ids unique. Unpaid orders j = 0.. go to user j % users with slot
    j // users + 1, so no two unpaid orders of a user share a slot."""
    unpaid = total * 2 // 100
    backlog = max(1, total // 2000)
    rest = total - unpaid - backlog
    paid, closed = rest * 60 // 100, rest * 30 // 100
    cancelled = rest - paid - closed
    # A transition time spread over the last week, and a 0-30 min life before it.
    at = f"({now} - (i * 104729) % {WEEK_MS})"
    life = f"(60000 + (i * 7919) % {29 * MIN_MS})"
    lag = "((i * 31) % 2000 + CASE WHEN i % 100 = 0 THEN (i * 37) % 60000 ELSE 0 END)"
    user = f"'u' || ((i * 7) % {users})"
    unpaid_user = f"'u' || ((i - 1 + {{j}}) % {users})"
    unpaid_slot = f"(i - 1 + {{j}}) / {users} + 1"
    return [
        ("unpaid, expiry ahead", unpaid,
         f"'o' || (i + {{o}}), {unpaid_user}, 'unpaid', {now} - 60000, "
         f"{now} + 1 + (i * {30 * MIN_MS}::bigint) / {unpaid}, {now} - 60000, NULL, NULL, "
         f"NULL, NULL, {unpaid_slot}, 0"),
        ("unpaid, overdue", backlog,
         f"'o' || (i + {{o}}), {unpaid_user}, 'unpaid', {now} - {31 * MIN_MS}, "
         f"{now} - 1 - (i * 97) % {MIN_MS}, {now} - {31 * MIN_MS}, NULL, NULL, NULL, NULL, "
         f"{unpaid_slot}, 0"),
        ("paid", paid,
         f"'o' || (i + {{o}}), {user}, 'paid', {at} - {life}, {at} - {life} + {30 * MIN_MS}, "
         f"{at}, {at}, NULL, NULL, 'pay-' || i, NULL, 0"),
        ("closed", closed,
         f"'o' || (i + {{o}}), {user}, 'closed', {at} - {lag} - {30 * MIN_MS}, {at} - {lag}, "
         f"{at}, NULL, {at}, 'expired', NULL, NULL, 0"),
        ("cancelled", cancelled,
         f"'o' || (i + {{o}}), {user}, 'cancelled', {at} - {life}, "
         f"{at} - {life} + {30 * MIN_MS}, {at}, NULL, {at}, 'cancelled', NULL, NULL, 0"),
    ]  # fmt: skip


def timed(label: str, steps: list[tuple[str, float]], run: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    result = run()
    steps.append((label, time.perf_counter() - started))
    print(f"  {label}: {steps[-1][1]:.1f} s", flush=True)
    return result


def load(engine: Engine, total: int, users: int, now: int, steps: list[tuple[str, float]]) -> None:
    """The orders, one event per transition, two consumers; then VACUUM (ANALYZE)."""
    offset = unpaid_seen = 0
    for name, count, select_list in order_groups(total, users, now):
        values = select_list.format(o=offset, j=unpaid_seen)
        # Only integers of this script go into the SQL.
        sql = (
            f"INSERT INTO oes_orders ({COLUMNS}) SELECT {values} "  # noqa: S608
            f"FROM generate_series(1::bigint, {count}) AS s(i)"
        ).replace("%", "%%")  # the driver's placeholder character

        def insert(sql: str = sql) -> None:
            with engine.begin() as conn:
                conn.exec_driver_sql(sql)

        timed(f"insert {count:,} orders ({name})", steps, insert)
        offset += count
        if name.startswith("unpaid"):
            unpaid_seen += count
    timed("insert order_events (one per transition)", steps, lambda: load_events(engine))
    timed("two consumers: cursors, retrying and parked events", steps,
          lambda: load_consumers(engine, now))  # fmt: skip

    def vacuum() -> None:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM (ANALYZE)")
            conn.exec_driver_sql("CHECKPOINT")  # not to write it out while measuring

    timed("VACUUM (ANALYZE), CHECKPOINT", steps, vacuum)


def load_events(engine: Engine) -> None:
    """A created event per order at its creation, and a paid, cancelled or closed one at
    its transition; in created-then-transition order by time, in several transactions so
    the events carry several txids, as the service's would."""
    events = (
        "SELECT id, user_id, 'created' AS kind, created_at_ms AS at_ms FROM oes_orders "
        "UNION ALL SELECT id, user_id, status, COALESCE(paid_at_ms, closed_at_ms) FROM oes_orders "
        "WHERE status <> 'unpaid'"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE staged_events AS SELECT row_number() OVER (ORDER BY at_ms, kind) "  # noqa: S608
            f"AS n, * FROM ({events}) e"
        )
        total = int(conn.exec_driver_sql("SELECT count(*) FROM staged_events").scalar_one())
    for start in range(0, total, EVENTS_PER_TRANSACTION):
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "INSERT INTO oes_order_events (order_id, user_id, kind, at_ms) "  # noqa: S608
                "SELECT id, user_id, kind, at_ms FROM staged_events "
                f"WHERE n > {start} AND n <= {start + EVENTS_PER_TRANSACTION} ORDER BY n"
            )
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE staged_events")


def load_consumers(engine: Engine, now: int) -> None:
    """``stock``: STOCK_LAG events behind, 5 parked and 2 retrying; ``audit``: caught up."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO oes_event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
            f"SELECT 'stock', txid, id, {now} FROM oes_order_events ORDER BY txid DESC, id DESC "
            f"OFFSET {STOCK_LAG} LIMIT 1"
        )
        conn.exec_driver_sql(
            "INSERT INTO oes_event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
            f"SELECT 'audit', txid, id, {now} FROM oes_order_events ORDER BY txid DESC, id DESC "
            "LIMIT 1"
        )
        conn.exec_driver_sql(
            "INSERT INTO oes_event_retries (consumer, event_id, attempts, next_at_ms, last_error, "  # noqa: S608
            f"parked_at_ms) SELECT 'stock', id, 10, {now}, 'RuntimeError: no stock row', "
            f"CASE WHEN k <= 5 THEN {now} - k * 60000 END "
            f"FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM (SELECT id FROM "
            f"order_events ORDER BY txid DESC, id DESC OFFSET {STOCK_LAG + 10} LIMIT 7) l) e"
        )
        conn.exec_driver_sql(
            "UPDATE oes_event_retries SET attempts = 3, next_at_ms = next_at_ms + 60000 "
            "WHERE parked_at_ms IS NULL"
        )


def row_counts(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        found = [
            (f"orders, {status}", int(n))
            for status, n in conn.exec_driver_sql(
                "SELECT status, count(*) FROM oes_orders GROUP BY status ORDER BY status"
            )
        ]
        for table in ("oes_orders", "oes_order_events", "oes_event_cursors", "oes_event_retries"):
            n = conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one()  # noqa: S608
            found.append((table, int(n)))
        size = conn.exec_driver_sql(
            "SELECT pg_size_pretty(pg_total_relation_size('oes_orders')), "
            "pg_size_pretty(pg_total_relation_size('oes_order_events'))"
        ).one()
    return [*found, (f"size with indexes: orders {size[0]}, order_events {size[1]}", -1)]


# --- the measurements -----------------------------------------------------------------------


def fill_stores(
    engine: Engine,
    client: redis.Redis,
    settings: Settings,
    args: argparse.Namespace,
    now: int,
    steps: list[tuple[str, float]],
) -> OrderService:
    """Migrate, load, reconcile, one scheduler's beat; DAMAGED_USER's index then holds a
    member with no row and a paid order, so comparing it sends its second statement."""
    timed("migrate", steps, lambda: migrate.upgrade(engine))
    load(engine, args.orders, args.users, now, steps)
    service = OrderService(engine, client, settings, clock=lambda: now)
    report = timed("reconcile (Redis gets the open orders)", steps, service.reconcile)
    print(f"  reconcile: {report.as_dict()}", flush=True)
    Heartbeats(client, key_prefix=service.index.key_prefix).publish(
        SchedulerBeat("scheduler-1", True, now - 1000, now + 29_000, now),
        forget_after_ms=60_000,
    )
    with engine.connect() as conn:
        paid_id = conn.exec_driver_sql(
            "SELECT id FROM oes_orders WHERE status = 'paid' LIMIT 1"
        ).scalar_one()
    client.zadd(service.index.key(DAMAGED_USER), {"ghost": now + 5000, paid_id: now + 1})
    return service
