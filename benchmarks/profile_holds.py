"""Where a create with holds spends its wall time, statement by statement (issue 43).

On the durable stores of ``bench_durable`` (a throwaway PostgreSQL with fsync on and a
redis-server on a unix socket; SQLite in WAL with synchronous=FULL), ``--ops`` creates of
each kind (no holds, 1 hold, a 10-resource cart) run in turn on one thread; every SQL
statement's wall time (``before_cursor_execute`` to ``after_cursor_execute``) and every
commit's are summed by the statement's first words, and printed per create beside the
create's own wall time and client CPU.

    .venv/bin/python benchmarks/profile_holds.py --engine postgresql --ops 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sqlalchemy import event  # noqa: E402

from benchmarks.bench_durable import durable_stores  # noqa: E402
from benchmarks.measure import run_ops  # noqa: E402


def _label(statement: str) -> str:
    words = " ".join(statement.split())
    if words.startswith("WITH"):
        return "WITH ... (the order's insert and its event)"
    if "FOR UPDATE" in words:
        return "SELECT ... FOR UPDATE (lock the resources)"
    if words.startswith("SELECT") and "sum(" in words:
        return "SELECT sum(quantity) (held now)"
    return " ".join(words.split()[:3])


def profile(engine_name: str, ops: int, threads: int) -> None:
    with durable_stores([engine_name]) as stores:
        url, sock = stores(engine_name)
        env = {**os.environ, "ORDERS_DATABASE_URL": url, "ORDERS_REDIS_URL": f"unix://{sock}"}
        os.environ.update(env)
        import subprocess  # noqa: PLC0415

        orders = str(Path(sys.executable).with_name("orders"))
        subprocess.run([orders, "db", "upgrade"], env=env, check=True, stdout=subprocess.DEVNULL)
        from orders.bootstrap import build_service  # noqa: PLC0415
        from orders.config import Settings  # noqa: PLC0415

        service = build_service(Settings.from_env(), startup_warnings=False)
        try:
            _run(service, ops)
            if threads:
                _hot(service, ops, threads)
        finally:
            service.close()


def _hot(service: Any, ops: int, threads: int) -> None:
    """``threads`` threads creating with 1 unit of one resource each: how long each create
    held the resource's row lock (from the return of its ``FOR UPDATE`` statement, when the
    lock is granted, to the create's return, the commit included), and what share of the
    run's wall time the lock was held (near 100 %: the lock is what the holds queue on)."""
    service.set_capacity("p-hot", 10**9)
    service.create_unpaid_order("warm-hot", holds={"p-hot": 1})
    mine = threading.local()

    def granted(_conn: Any, _c: Any, statement: str, *_: Any) -> None:
        if "FOR UPDATE" in statement or (
            statement.lstrip().startswith("SELECT") and "oes_resources" in statement
        ):
            mine.locked_at = time.perf_counter()

    event.listen(service.engine, "after_cursor_execute", granted)
    held: list[float] = []
    calls: list[float] = []

    def op(i: int) -> None:
        t0 = time.perf_counter()
        service.create_unpaid_order(f"h-{i}", holds={"p-hot": 1})
        done = time.perf_counter()
        held.append(done - mine.locked_at)
        calls.append(done - t0)

    run = run_ops(op, ops, threads)
    event.remove(service.engine, "after_cursor_execute", granted)
    wall = run.elapsed_ns / 1e9
    held.sort()
    calls.sort()
    print(f"\none hot SKU, {threads} threads: {ops / wall:,.0f} holds/s")
    for name, xs in (("lock held (granted to return)", held), ("whole create", calls)):
        print(f"  {name}: mean {statistics.mean(xs) * 1e3:.2f} ms, p50 "
              f"{xs[len(xs) // 2] * 1e3:.2f}, p99 {xs[int(len(xs) * 0.99)] * 1e3:.2f}")  # fmt: skip
    print(f"  lock held {sum(held) / wall:.0%} of the wall time")


def _run(service: Any, ops: int) -> None:
    spent: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}

    def before(conn: Any, _c: Any, statement: str, *_: Any) -> None:
        started[id(conn)] = time.perf_counter()
        conn.info["profile_label"] = _label(statement)

    def after(conn: Any, *_: Any) -> None:
        spent[conn.info["profile_label"]] += time.perf_counter() - started.pop(id(conn))

    carts = {"no holds": 0, "1 hold": 1, "10 holds": 10}
    for name, size in carts.items():
        for i in range(size):
            service.set_capacity(f"p-{name[:2].strip()}-{i}", 10**9)
    event.listen(service.engine, "before_cursor_execute", before)
    event.listen(service.engine, "after_cursor_execute", after)
    for name, size in carts.items():
        holds = {f"p-{name[:2].strip()}-{i}": 1 for i in range(size)}
        service.create_unpaid_order(f"warm-{name}", holds=holds)  # the index built
        spent.clear()
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(ops):
            service.create_unpaid_order(f"u-{name}-{i}", holds=holds)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"\n{name}: {wall / ops * 1e3:.3f} ms a create, client CPU {cpu / ops * 1e3:.3f} ms")
        for label, seconds in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"  {seconds / ops * 1e3:7.3f} ms  {label}")
        print(f"  {sum(spent.values()) / ops * 1e3:7.3f} ms  all SQL statements (commit aside)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="postgresql", choices=["postgresql", "sqlite"])
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--threads", type=int, default=64, help="of the hot SKU (0: none)")
    options = parser.parse_args()
    profile(options.engine, options.ops, options.threads)


if __name__ == "__main__":
    main()
