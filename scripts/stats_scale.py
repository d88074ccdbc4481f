"""``orders stats`` at scale: the old algorithm against the new one, side by side.

Fills a database with --orders orders (default 10**7) of which --closed-recent (default
3 * 10**6) were closed in the last hour, runs ANALYZE, then measures, each in a fresh child
process, the wall time of one stats read and the child's peak resident memory (ru_maxrss,
before and after the call), interleaving old and new --repeat times. The new read is then
measured once more after VACUUM, which lets PostgreSQL's index-only scans skip the table.

    .venv/bin/python scripts/stats_scale.py                   # PostgreSQL 10**7, SQLite 10**6
    .venv/bin/python scripts/stats_scale.py --orders 1000000 --closed-recent 300000
    ORDERS_SCALE_DATABASE_URL=postgresql+psycopg://... .venv/bin/python scripts/stats_scale.py

PostgreSQL: without ORDERS_SCALE_DATABASE_URL the script starts its own server from
/usr/lib/postgresql/*/bin (as user nobody when run as root; on a unix socket in a temporary
folder; no TCP; fsync on, as in production) and stops it by its PID at the end, removing its
files. With the variable it creates a database ``orders_stats_scale`` on that server and
drops it at the end. SQLite: a temporary file, removed at the end (--sqlite-orders 0 skips).

Needs about 6 GB free in /tmp for 10**7 orders; the script checks before it fills.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, func, make_url, select, text

from orders.domain import OrderStatus
from orders.sql import migrate
from orders.sql.models import orders_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.stats import Window, close_lag, read_stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the tests' server
from tests.support.postgres import PostgresServer, find_postgres_bin

OC = orders_table.c
HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
FREE_BYTES_PER_ORDER = 600


# --- the baseline: orders/sql/stats.py's collect_stats before this change, as it was -----------
# Copied unchanged but for taking (engine, now_ms) instead of the service, and returning a
# dict. Every lag of the window is loaded into Python and sorted; both the count by status
# and the lag query read the whole table.


def old_percentile(sorted_values: list[int], fraction: float) -> int | None:
    """BASELINE. Nearest-rank percentile of an already sorted list (None for an empty one)."""
    if not sorted_values:
        return None
    rank = max(1, -(-len(sorted_values) * fraction // 1))
    return sorted_values[int(rank) - 1]


def old_collect(
    engine: Engine, now_ms: int, *, window_s: int = 3600, horizon_s: int = 600, buckets: int = 10
) -> dict[str, Any]:
    """BASELINE: the old collect_stats."""
    step_ms = max(1, horizon_s * 1000 // buckets)
    with engine.connect() as conn:
        by_status = {status.value: 0 for status in OrderStatus}
        for status, count in conn.execute(select(OC.status, func.count()).group_by(OC.status)):
            by_status[status] = count
        open_unpaid = conn.scalar(
            select(func.count()).where(UNPAID_PREDICATE, OC.expires_at_ms > now_ms)
        )
        backlog = conn.scalar(
            select(func.count()).where(UNPAID_PREDICATE, OC.expires_at_ms <= now_ms)
        )
        lags = sorted(
            conn.scalars(
                select(OC.closed_at_ms - OC.expires_at_ms).where(
                    OC.status == OrderStatus.CLOSED.value,
                    OC.closed_at_ms >= now_ms - window_s * 1000,
                )
            )
        )
        slot = (OC.expires_at_ms - now_ms) // step_ms
        counts: dict[Any, Any] = dict(
            conn.execute(
                select(slot, func.count())
                .where(
                    UNPAID_PREDICATE,
                    OC.expires_at_ms > now_ms,
                    OC.expires_at_ms < now_ms + step_ms * buckets,
                )
                .group_by(slot)
            ).all()
        )
    per_slot = {int(k): int(v) for k, v in counts.items()}
    return {
        "by_status": by_status,
        "open_unpaid": int(open_unpaid or 0),
        "backlog": int(backlog or 0),
        "closed_in_window": len(lags),
        "lag_p50_ms": old_percentile(lags, 0.50),
        "lag_p99_ms": old_percentile(lags, 0.99),
        "lag_max_ms": lags[-1] if lags else None,
        "upcoming": [(i * step_ms // 1000, per_slot.get(i, 0)) for i in range(buckets)],
    }


# --- the new read ----------------------------------------------------------------------------


def new_collect(engine: Engine, now_ms: int) -> dict[str, Any]:
    """What ``orders stats`` runs now (collect_stats without the service around it)."""
    with engine.connect() as conn:
        found = read_stats(conn, now_ms).as_dict()
    found.pop("at_ms")
    found.pop("window_s")
    return found


# --- one measurement, in a child process ------------------------------------------------------


def child(which: str, url: str, now_ms: int) -> None:
    engine = create_engine(url)
    with engine.connect() as conn:  # connected and imported before the measurement
        conn.execute(text("SELECT 1"))
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    found = (old_collect if which == "old" else new_collect)(engine, now_ms)
    wall_s = time.perf_counter() - started
    after_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.dispose()
    print(json.dumps({"wall_s": wall_s, "rss_before_kb": before_kb, "rss_after_kb": after_kb,
                      "found": found}))  # fmt: skip


def measure(which: str, url: str, now_ms: int) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", which, "--url", url, "--now-ms", str(now_ms)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{which} child failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# --- the data -----------------------------------------------------------------------------

COLUMNS = (
    "id, user_id, status, created_at_ms, expires_at_ms, updated_at_ms, paid_at_ms, "
    "closed_at_ms, close_reason, extensions"
)


def groups(total: int, recent: int, now: int) -> list[tuple[int, str]]:
    """(row count, SELECT list over i = 1..count) per kind of order. ``{o}`` is the offset
    that keeps ids unique. Lags of the recent closes: 0-2 s (the sweep's interval), 1 % of
    them up to a minute more."""
    unpaid = max(2, total // 100)
    backlog = max(1, unpaid // 100)
    rest = total - recent - unpaid
    old_closed, paid = rest * 6 // 10, rest * 3 // 10
    cancelled = rest - old_closed - paid
    month = 30 * DAY_MS
    lag = "((i * 7919) % 2000 + CASE WHEN i % 100 = 0 THEN (i * 31) % 60000 ELSE 0 END)"
    recent_at = f"({now} - 1 - (i - 1) * {HOUR_MS - 1000} / {recent})"
    old_at = f"({now} - {HOUR_MS} - 1 - (i * 104723) % {month})"
    any_at = f"({now} - (i * 104729) % {month})"
    return [
        (recent, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'closed', "
                 f"{recent_at} - {lag} - 600000, {recent_at} - {lag}, {recent_at}, NULL, "
                 f"{recent_at}, 'expired', 0"),
        (old_closed, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'closed', "
                     f"{old_at} - 601000, {old_at} - 1000, {old_at}, NULL, {old_at}, "
                     f"'expired', 0"),
        (paid, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'paid', {any_at} - 60000, "
               f"{any_at} + 540000, {any_at}, {any_at}, NULL, NULL, 0"),
        (cancelled, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'cancelled', {any_at} - 60000, "
                    f"{any_at} + 540000, {any_at}, NULL, {any_at}, 'cancelled', 0"),
        (unpaid - backlog, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'unpaid', {now} - 1000, "
                           f"{now} + 1 + i * 600000 / {unpaid}, {now} - 1000, NULL, NULL, "
                           f"NULL, 0"),
        (backlog, f"'o' || (i + {{o}}), 'u' || (i % 100000), 'unpaid', {now} - 700000, "
                  f"{now} - (i % 5000), {now} - 700000, NULL, NULL, NULL, 0"),
    ]  # fmt: skip


def fill(engine: Engine, total: int, recent: int, now_ms: int) -> None:
    offset = 0
    with engine.begin() as conn:
        for count, select_list in groups(total, recent, now_ms):
            values = select_list.format(o=offset)
            # Only integers of this script go into the SQL.
            if engine.dialect.name == "postgresql":
                sql = (
                    f"INSERT INTO oes_orders ({COLUMNS}) "  # noqa: S608
                    f"SELECT {values} FROM generate_series(1::bigint, {count}) AS s(i)"
                ).replace("%", "%%")  # the driver's placeholder character
            else:
                sql = (
                    f"WITH RECURSIVE s(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM s "  # noqa: S608
                    f"WHERE i < {count}) INSERT INTO oes_orders ({COLUMNS}) SELECT {values} FROM s"
                )
            conn.exec_driver_sql(sql)
            offset += count


# --- the servers ----------------------------------------------------------------------------


@contextmanager
def own_postgres() -> Iterator[str]:
    """A PostgreSQL server of our own (the tests' server, durable: fsync on, no autovacuum so
    the VACUUM step is ours), yielding the URL of its ``postgres`` database; stopped by PID."""
    bindir = find_postgres_bin()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries (initdb); set ORDERS_SCALE_DATABASE_URL")
    server = PostgresServer(
        bindir, durable=True, settings={"max_wal_size": "4GB", "autovacuum": "off"}
    ).start()
    try:
        yield server.url("postgres")
    finally:
        server.stop()


@contextmanager
def scratch_database(server_url: str) -> Iterator[str]:
    """A database ``orders_stats_scale`` on the server, dropped at the end."""
    admin = create_engine(server_url, isolation_level="AUTOCOMMIT")
    name = "orders_stats_scale"
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
            conn.exec_driver_sql(f"CREATE DATABASE {name}")
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.dispose()


# --- the run -------------------------------------------------------------------------------


def check_room(total: int) -> None:
    free = shutil.disk_usage(tempfile.gettempdir()).free
    need = total * FREE_BYTES_PER_ORDER
    print(
        f"{tempfile.gettempdir()}: {free / 2**30:.1f} GiB free, about {need / 2**30:.1f} GiB needed"
    )
    if free < need:
        raise SystemExit("not enough free disk space for the database")


def run(url: str, total: int, recent: int, repeat: int) -> None:
    now_ms = int(time.time() * 1000)
    engine = create_engine(url)
    try:
        migrate.upgrade(engine)
        started = time.perf_counter()
        fill(engine, total, recent, now_ms)
        print(
            f"{engine.dialect.name}: filled {total} orders in {time.perf_counter() - started:.0f} s"
        )
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.exec_driver_sql("ALTER TABLE oes_orders SET (autovacuum_enabled = false)")
            conn.exec_driver_sql(
                "ANALYZE oes_orders" if engine.dialect.name == "postgresql" else "ANALYZE"
            )
        rows: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for _ in range(repeat):
            for which in ("old", "new"):
                rows[which].append(measure(which, url, now_ms))
        if engine.dialect.name == "postgresql":
            explain_close_lag(engine, now_ms, "after ANALYZE")
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("VACUUM oes_orders")
            rows["new, after VACUUM"] = [measure("new", url, now_ms) for _ in range(repeat)]
            explain_close_lag(engine, now_ms, "after VACUUM")
        report(engine.dialect.name, total, recent, rows)
    finally:
        engine.dispose()


def explain_close_lag(engine: Engine, now_ms: int, when: str) -> None:
    """The close-lag statement's actual plan: how many rows it read, heap fetches."""
    seen: list[tuple[str, Any]] = []

    def capture(_c: Any, _cur: Any, sql: str, params: Any, *_r: Any) -> None:
        seen.append((sql, params))

    event.listen(engine, "before_cursor_execute", capture)
    with engine.connect() as conn:
        close_lag(conn, Window.ending_at(now_ms, 3600))
    event.remove(engine, "before_cursor_execute", capture)
    sql, params = seen[-1]
    with engine.connect() as conn:
        plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + sql, params).all()
    print(f"close-lag plan, {when}:")
    for (line,) in plan:
        if "Group Key" not in line and "Sort Key" not in line:
            print("   ", line[:160])


def report(dialect: str, total: int, recent: int, rows: dict[str, list[dict[str, Any]]]) -> None:
    print(f"\n{dialect}, {total} orders, {recent} closed in the last hour (warm cache):")
    for which, runs in rows.items():
        walls = sorted(r["wall_s"] for r in runs)
        peak = max(r["rss_after_kb"] for r in runs) / 1024
        grown = max(r["rss_after_kb"] - r["rss_before_kb"] for r in runs) / 1024
        found = runs[0]["found"]
        print(
            f"  {which:<18} wall median {walls[len(walls) // 2]:.2f} s "
            f"(min {walls[0]:.2f}, max {walls[-1]:.2f}); peak RSS {peak:.0f} MiB "
            f"(+{grown:.0f} MiB in the call); closed {found['closed_in_window']}, "
            f"p50 {found['lag_p50_ms']}, p99 {found['lag_p99_ms']}, max {found['lag_max_ms']}; "
            f"by_status {found['by_status']}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=10**7)
    parser.add_argument("--closed-recent", type=int, default=3 * 10**6)
    parser.add_argument("--sqlite-orders", type=int, default=10**6)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip-postgres", action="store_true")
    parser.add_argument("--child", choices=["old", "new"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--now-ms", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.url, args.now_ms)
        return
    if not args.skip_postgres:
        check_room(args.orders)
        external = os.environ.get("ORDERS_SCALE_DATABASE_URL")
        server = own_postgres() if not external else nullcontext(external)
        with server as server_url, scratch_database(server_url) as url:
            run(url, args.orders, args.closed_recent, args.repeat)
    if args.sqlite_orders:
        with tempfile.TemporaryDirectory(prefix="orders-stats-scale-") as folder:
            recent = args.sqlite_orders * args.closed_recent // args.orders
            run(f"sqlite:///{folder}/orders.db", args.sqlite_orders, recent, args.repeat)


if __name__ == "__main__":
    main()
