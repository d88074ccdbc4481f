"""Where a create's time goes: many ``create_unpaid_order`` calls on durable stores, to profile.

Starts a redis-server on a unix socket and the chosen database (SQLite: a fresh file; or a
throwaway PostgreSQL with fsync on, tests/support/postgres.py), migrates it, then creates ``--ops``
orders for new users on one thread (``--threads N``: on N threads, each its share of the
users; ``--combine``: with ``combine_creates`` and ``combine_transitions``), printing the
rate. Run it under a profiler for the flame graphs of benchmarks/README.md (the servers run in
their own processes, so the graph is the client):

    .venv/bin/py-spy record --format flamegraph -o docs/profiles/create-postgresql.svg -- \\
        .venv/bin/python benchmarks/profile_create.py --engine postgresql --ops 5000

With threads, ``py-spy record --gil`` samples only the thread that holds the GIL: the
samples over the wall time say how much of it one core's worth of Python was busy.

Every server started here is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from benchmarks.bench_durable import durable_stores  # noqa: E402
from orders.bootstrap import build_engine  # noqa: E402
from orders.config import Settings  # noqa: E402
from orders.errors import UnpaidOrderLimitReached  # noqa: E402
from orders.service import OrderService  # noqa: E402
from orders.sql import migrate  # noqa: E402


def machine_busy() -> tuple[float, float]:
    """The machine's CPU time so far, all cores (/proc/stat): (busy, total) in ticks."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle and iowait
    return sum(fields) - idle, sum(fields)


def on_threads(share: Callable[[int], None], threads: int) -> None:
    """``share(n)`` for n in 0 .. threads - 1, each on a thread of its own (one: here)."""
    if threads == 1:
        share(0)
        return
    workers = [threading.Thread(target=share, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


#: Layers of a call, by where a function lives (cProfile's own time of each function): the
#: first whose mark is in the file name, or in a built-in's name, wins.
LAYERS = (
    ("SQL driver and server", ("sqlite3.", "/psycopg", "psycopg_c", "psycopg_binary")),
    ("Redis socket and server", ("_socket.socket", "hiredis")),
    ("SQLAlchemy", ("/sqlalchemy/",)),
    ("redis-py", ("/redis/",)),
    ("orders", ("/orders/",)),
)


def layer_of(filename: str, function: str) -> str:
    where = filename + " " + function
    for name, marks in LAYERS:
        if any(mark in where for mark in marks):
            return name
    return "Python and the standard library"


def print_layers(stats: pstats.Stats, calls: int) -> None:
    """Microseconds per call in each layer (cProfile's own time, its overhead included:
    compare runs of this script with each other, not with the ops/s of a run without it)."""
    spent: dict[str, float] = dict.fromkeys([name for name, _ in LAYERS], 0.0)
    spent["Python and the standard library"] = 0.0
    raw: Any = stats
    for (filename, _line, function), row in raw.stats.items():
        spent[layer_of(filename, function)] += row[2]  # tottime
    total = sum(spent.values())
    print("| layer | us per call | share |", file=sys.stderr)
    print("| --- | --- | --- |", file=sys.stderr)
    for name, seconds in spent.items():
        print(f"| {name} | {seconds / calls * 1e6:,.0f} | {seconds / total:.0%} |", file=sys.stderr)
    print(f"| all | {total / calls * 1e6:,.0f} | 100% |", file=sys.stderr)


def run(
    service: OrderService,
    users: list[str],
    mode: str,
    top: int | None,
    sort: str = "tottime",
    callers: str | None = None,
    threads: int = 1,
    layers: bool = False,
) -> None:
    """Once per user: create, be refused at the limit, pay or cancel (the last three on an
    order created beforehand, untimed); print the rate. ``callers``: also print who called
    the profiled functions whose names match that pattern."""
    opened = (
        [service.create_unpaid_order(user, limit=1).id for user in users]
        if mode != "create"
        else []
    )
    # The setup's admissions are confirmed now, not by the thread a second later: a refusal
    # that named them as suspects (over 5 s old) would time the SQL question, not a refusal.
    service.admitter.confirmations.send()
    calls: dict[str, Callable[[int, str], object]] = {
        "create": lambda _i, user: service.create_unpaid_order(user, limit=1),
        "refuse": lambda _i, user: service.create_unpaid_order(user, limit=1),
        "pay": lambda i, _user: service.mark_paid(opened[i], payment_ref=f"ref-{i}"),
        "cancel": lambda i, _user: service.cancel_order(opened[i]),
    }
    call = calls[mode]

    def share(first: int) -> None:
        for i in range(first, len(users), threads):
            try:
                call(i, users[i])
            except UnpaidOrderLimitReached:
                if mode != "refuse":
                    raise

    profiler = cProfile.Profile() if top or layers else None
    started, cpu_started = time.perf_counter(), time.process_time()
    busy_started, total_started = machine_busy()
    if profiler is not None:
        profiler.enable()
    on_threads(share, threads)
    cpu = time.process_time() - cpu_started
    busy, total = machine_busy()
    machine = (busy - busy_started) / (total - total_started)
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - started
    if profiler is not None and layers:
        print_layers(pstats.Stats(profiler), len(users))
    elif profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr).sort_stats(sort)
        stats.print_stats(top)
        if callers:
            stats.print_callers(callers)
    print(
        f"{len(users) / elapsed:,.0f} ops/s on {threads} threads;"
        f" {cpu / len(users) * 1e6:,.0f} us of this process's CPU per call,"
        f" {cpu / elapsed:.2f} of a core; the machine's cores {machine:.0%} busy",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--refuse", action="store_true", help="time refusals (--mode refuse)")
    parser.add_argument("--mode", choices=("create", "refuse", "pay", "cancel"), default="create")
    parser.add_argument(
        "--cprofile", type=int, metavar="N", help="print the N costliest functions of the loop"
    )
    parser.add_argument(
        "--sort", default="tottime", help="the profile's order: tottime, cumulative..."
    )
    parser.add_argument(
        "--callers", metavar="PATTERN", help="with --cprofile: who called the functions matched"
    )
    parser.add_argument("--threads", type=int, default=1, help="callers at once")
    parser.add_argument(
        "--layers", action="store_true", help="print the time per call in each layer (cProfile)"
    )
    parser.add_argument(
        "--combine", action="store_true", help="combine_creates and combine_transitions on"
    )
    options = parser.parse_args()
    with durable_stores([options.engine]) as stores:
        url, sock = stores(options.engine)
        combine = options.combine
        settings = Settings(
            database_url=url,
            redis_url=f"unix://{sock}",
            combine_creates=combine,
            combine_transitions=combine,
            sql_pool_size=10,  # as the lab's callers figure
            sql_max_overflow=10,
        )
        engine = build_engine(settings)
        migrate.upgrade(engine)
        service = OrderService(engine, redis.Redis(unix_socket_path=str(sock)), settings)
        users = [f"user-{i:07d}" for i in range(options.ops)]
        mode = "refuse" if options.refuse else options.mode
        run(
            service,
            users,
            mode,
            options.cprofile,
            options.sort,
            options.callers,
            threads=options.threads,
            layers=options.layers,
        )
        service.close()


if __name__ == "__main__":
    main()
