"""PostgreSQL figures for the capacity model: WAL and CPU per use case, bytes per order.

Starts the durable stores ``benchmarks/bench_durable.py`` starts (a throwaway PostgreSQL with
fsync, synchronous commits and full-page writes on, a redis-server on a unix socket),
migrates the schema with ``orders.sql.migrate`` and then:

1. runs ``--ops`` creates (one per user) through ``OrderService``, pays half of them, moves
   the clock past the expiry and sweeps the other half closed; for each phase it reports
   ops/s from one thread, the WAL written (``pg_current_wal_lsn`` before and after) and the
   CPU used by the client, by every PostgreSQL process and by redis-server (from /proc), per
   operation;
2. bulk-loads ``--orders`` orders shaped like the service's rows (26-character ids,
   24-character user ids, an amount and a currency; 20 % unpaid, 50 % paid, 25 % closed,
   5 % cancelled) with their events (``created``, plus one per transition), VACUUMs, and
   reports the bytes per row of each table and of each index (``pg_relation_size``) and the
   total (``pg_total_relation_size``) per order and per event.

With ``--partitions N`` the schema is docs/partitioning.sql with N hash partitions instead
of the migrations (and step 2 is skipped: ``--orders`` is for the plain schema), to see what
partitioning costs each use case. ``--sweep`` then also runs the lab's ``--only sweep``
on that schema (its closes/s per batch size, best batch and 10x table).

    .venv/bin/python benchmarks/pg_capacity.py --ops 5000 --orders 1000000
    .venv/bin/python benchmarks/pg_capacity.py --ops 5000 --partitions 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis
from sqlalchemy import Engine, make_url, text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_durable import durable_stores  # noqa: E402
from orders import ExpiryPolicy, OrderService, Settings  # noqa: E402
from orders.bootstrap import build_engine  # noqa: E402
from orders.sql.migrate import upgrade  # noqa: E402

TTL_S = 900
PARTITIONED_DDL = REPO / "docs" / "partitioning.sql"
TICK_S = os.sysconf("SC_CLK_TCK")


class Clock:
    """The service's clock, moved by hand past the expiry before the sweep."""

    def __init__(self) -> None:
        self.offset_ms = 0

    def __call__(self) -> int:
        return int(time.time() * 1000) + self.offset_ms


def cpu_s(pid: int, *, children: bool = False) -> float:
    """CPU seconds of a process (with its reaped children's, if asked) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        ticks += int(fields[13]) + int(fields[14])  # cutime, cstime
    return ticks / TICK_S


def postgres_cpu_s(postmaster: int) -> float:
    """Every PostgreSQL process: the postmaster with the backends it has reaped, and the
    processes still running under it."""
    total = cpu_s(postmaster, children=True)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == postmaster:
            total += (int(stat[11]) + int(stat[12])) / TICK_S
    return total


class Meter:
    """WAL bytes and CPU seconds (client, PostgreSQL, Redis) over a phase."""

    def __init__(self, engine: Engine, postmaster: int, redis_pid: int) -> None:
        self.engine, self.postmaster, self.redis_pid = engine, postmaster, redis_pid

    def reading(self) -> tuple[str, float, float, float, float]:
        with self.engine.connect() as conn:
            lsn = str(conn.execute(text("SELECT pg_current_wal_lsn()")).scalar_one())
        return (
            lsn,
            time.perf_counter(),
            time.process_time(),
            postgres_cpu_s(self.postmaster),
            cpu_s(self.redis_pid),
        )

    def measure(self, name: str, ops: int, work: Callable[[], object]) -> dict[str, Any]:
        before = self.reading()
        work()
        after = self.reading()
        with self.engine.connect() as conn:
            wal = conn.execute(
                text("SELECT pg_wal_lsn_diff(:a, :b)"), {"a": after[0], "b": before[0]}
            ).scalar_one()
        wall = after[1] - before[1]
        return {
            "phase": name,
            "ops": ops,
            "ops_s": round(ops / wall),
            "wal_bytes_per_op": round(float(wal) / ops),
            "client_cpu_us_per_op": round((after[2] - before[2]) * 1e6 / ops),
            "postgres_cpu_us_per_op": round((after[3] - before[3]) * 1e6 / ops),
            "redis_cpu_us_per_op": round((after[4] - before[4]) * 1e6 / ops, 1),
        }


def use_cases(engine: Engine, client: redis.Redis, meter: Meter, n: int) -> list[dict[str, Any]]:
    clock = Clock()
    service = OrderService(
        engine,
        client,
        Settings(unpaid_limit=3, default_policy=ExpiryPolicy(ttl_s=TTL_S)),
        clock=clock,
    )
    users = [f"cap-{i:020d}" for i in range(n)]
    ids: list[str] = []

    def create() -> None:
        for user in users:
            ids.append(service.create_unpaid_order(user, amount="19.90", currency="EUR").id)

    def pay() -> None:
        for order_id in ids[: n // 2]:
            service.mark_paid(order_id, payment_ref=f"pi_{order_id}")

    def sweep() -> None:
        clock.offset_ms = (TTL_S + 1) * 1000
        closed = service.sweep_expired(batch_size=2000).closed
        if closed != n - n // 2:
            raise RuntimeError(f"the sweep closed {closed} of {n - n // 2}")

    rows = [
        meter.measure("create", n, create),
        meter.measure("mark_paid", n // 2, pay),
        meter.measure("sweep close", n - n // 2, sweep),
    ]
    service.close()
    return rows


BULK_ORDERS = """
INSERT INTO oes_orders (id, user_id, status, amount, currency, created_at_ms, expires_at_ms,
                    updated_at_ms, paid_at_ms, closed_at_ms, close_reason, payment_ref, slot)
SELECT 'B' || lpad(i::text, 25, '0'),
       'u' || substr(md5(i::text), 1, 23),
       s.status, '19.90', 'EUR', t, t + 900000, t + 1000,
       CASE WHEN s.status = 'paid' THEN t + 1000 END,
       CASE WHEN s.status IN ('closed', 'cancelled') THEN t + 1000 END,
       CASE s.status WHEN 'closed' THEN 'expired' WHEN 'cancelled' THEN 'cancelled' END,
       CASE WHEN s.status = 'paid' THEN 'pi_B' || lpad(i::text, 25, '0') END,
       CASE WHEN s.status = 'unpaid' THEN 1 END
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT 1780000000000 + i * 10 AS t) AS tt,
     LATERAL (SELECT CASE WHEN i % 20 < 4 THEN 'unpaid' WHEN i % 20 < 14 THEN 'paid'
                          WHEN i % 20 < 19 THEN 'closed' ELSE 'cancelled' END AS status) AS s
"""
BULK_EVENTS = [
    """INSERT INTO oes_order_events (order_id, user_id, kind, at_ms)
       SELECT id, user_id, 'created', created_at_ms FROM oes_orders""",
    """INSERT INTO oes_order_events (order_id, user_id, kind, at_ms, data)
       SELECT id, user_id, CASE status WHEN 'paid' THEN 'paid' ELSE status END,
              updated_at_ms,
              CASE WHEN status = 'paid' THEN json_build_object('payment_ref', payment_ref) END
       FROM oes_orders WHERE status <> 'unpaid'""",
]
SIZES = """
SELECT c.relname, c.relkind, pg_relation_size(c.oid) AS bytes,
       pg_total_relation_size(c.oid) AS total, t.relname AS tablename, c.reltuples
FROM pg_class c
JOIN pg_index i ON i.indexrelid = c.oid
JOIN pg_class t ON t.oid = i.indrelid
WHERE t.relname IN ('oes_orders', 'oes_order_events')
UNION ALL
SELECT c.relname, c.relkind, pg_relation_size(c.oid), pg_total_relation_size(c.oid), c.relname,
       c.reltuples
FROM pg_class c WHERE c.relname IN ('oes_orders', 'oes_order_events')
"""


def storage(engine: Engine, n: int) -> dict[str, Any]:
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM oes_orders"))
        conn.execute(text(BULK_ORDERS), {"n": n})
        for statement in BULK_EVENTS:
            conn.execute(text(statement))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE oes_orders, oes_order_events"))
        counts: dict[str, int] = dict(
            conn.execute(text("SELECT status, count(*) FROM oes_orders GROUP BY status")).all()
        )
        events = conn.execute(text("SELECT count(*) FROM oes_order_events")).scalar_one()
        sizes = conn.execute(text(SIZES)).all()
    rows = {"oes_orders": sum(counts.values()), "oes_order_events": events}
    relations = {
        r.relname: {
            "bytes": r.bytes,
            "per_row_of_table": round(r.bytes / rows[r.tablename], 1),
            "entries": int(r.reltuples),
            "per_entry": round(r.bytes / max(1, r.reltuples), 1),
        }
        for r in sizes
    }
    totals = {r.relname: r.total for r in sizes if r.relkind == "r"}
    return {
        "orders": rows["oes_orders"],
        "by_status": counts,
        "events": events,
        "relations": relations,
        "total_bytes_per_order": round(totals["oes_orders"] / rows["oes_orders"], 1),
        "total_bytes_per_event": round(totals["oes_order_events"] / events, 1),
    }


def partitioned_schema(url: str, partitions: int) -> None:
    """docs/partitioning.sql with ``partitions`` hash partitions per table."""
    ddl = PARTITIONED_DDL.read_text()
    ddl = ddl.replace("MODULUS 16", f"MODULUS {partitions}").replace(
        "0..15", f"0..{partitions - 1}"
    )
    dsn = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl.encode())


def bench_sweep(url: str, sock: Path) -> dict[str, Any]:
    """``python -m benchmarks --only sweep --json`` on these stores: the sweep's figure."""
    env = {
        **os.environ,
        "ORDERS_DATABASE_URL": url,
        "ORDERS_REDIS_URL": f"unix://{sock}",
        # The bench's fill and cleanup of 5x10^5 rows outlast the default 30 s when the
        # tables are partitioned (a trigger and a cascade per row).
        "ORDERS_SQL_STATEMENT_TIMEOUT_S": "600",
    }
    argv = [sys.executable, "-m", "benchmarks", "--only", "sweep", "--json", "--yes", "--reps", "3"]
    done = subprocess.run(argv, env=env, check=False, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"the lab failed: {done.stderr.strip()[-600:]}")
    report = json.loads(done.stdout)
    sweep: dict[str, Any] = report["figures"]["sweep"]
    figures = ("best_batch", "best_closes_s", "best_closes_s_10x", "cost_10x")
    return {key: sweep[key] for key in figures} | {"durations_s": report["durations_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=5000, help="creates through the service")
    parser.add_argument("--orders", type=int, default=1_000_000, help="bulk-loaded orders")
    parser.add_argument("--partitions", type=int, default=0, help="docs/partitioning.sql")
    parser.add_argument("--sweep", action="store_true", help="also the lab's --only sweep")
    options = parser.parse_args()
    with durable_stores(["postgresql"]) as stores:
        url, sock = stores("postgresql")
        engine = build_engine(Settings(), url)
        if options.partitions:
            partitioned_schema(url, options.partitions)
        else:
            upgrade(engine)
        client = redis.Redis(unix_socket_path=str(sock))
        host = Path(str(make_url(url).query["host"]))
        postmaster = int((host / "data" / "postmaster.pid").read_text().split()[0])
        redis_pid = int(client.info("server")["process_id"])
        meter = Meter(engine, postmaster, redis_pid)
        report: dict[str, Any] = {
            "partitions": options.partitions,
            "use_cases": use_cases(engine, client, meter, options.ops),
        }
        if not options.partitions and options.orders:
            report["storage"] = storage(engine, options.orders)
        if options.sweep:
            report["sweep"] = bench_sweep(url, sock)
        client.close()
        engine.dispose()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
