"""Where a create's time goes: many ``create_unpaid_order`` calls on durable stores, to profile.

Starts a redis-server on a unix socket and the chosen database (SQLite: a fresh file; or a
throwaway PostgreSQL with fsync on, tests/support/postgres.py), migrates it, then creates ``--ops``
orders for new users on one thread, printing the rate. Run it under a profiler for the
flame graphs of docs/bench.md (the servers run in their own processes, so the graph is the client):

    .venv/bin/py-spy record --format flamegraph -o docs/profiles/create-postgresql.svg -- \\
        .venv/bin/python scripts/profile_create.py --engine postgresql --ops 5000

Every server started here is stopped by its PID at the end.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from orders.bootstrap import build_engine  # noqa: E402
from orders.config import Settings  # noqa: E402
from orders.errors import UnpaidOrderLimitReached  # noqa: E402
from orders.service import OrderService  # noqa: E402
from orders.sql import migrate  # noqa: E402
from scripts.bench_durable import durable_stores  # noqa: E402


def run(
    service: OrderService,
    users: list[str],
    mode: str,
    top: int | None,
    sort: str = "tottime",
    callers: str | None = None,
) -> None:
    """Once per user: create, be refused at the limit, pay or cancel (the last three on an
    order created beforehand, untimed); print the rate. ``callers``: also print who called
    the profiled functions whose names match that pattern."""
    opened = (
        [service.create_unpaid_order(user, limit=1).id for user in users]
        if mode != "create"
        else []
    )
    calls: dict[str, Callable[[int, str], object]] = {
        "create": lambda _i, user: service.create_unpaid_order(user, limit=1),
        "refuse": lambda _i, user: service.create_unpaid_order(user, limit=1),
        "pay": lambda i, _user: service.mark_paid(opened[i], payment_ref=f"ref-{i}"),
        "cancel": lambda i, _user: service.cancel_order(opened[i]),
    }
    call = calls[mode]
    profiler = cProfile.Profile() if top else None
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    for i, user in enumerate(users):
        try:
            call(i, user)
        except UnpaidOrderLimitReached:
            if mode != "refuse":
                raise
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - started
    if profiler is not None:
        stats = pstats.Stats(profiler, stream=sys.stderr).sort_stats(sort)
        stats.print_stats(top)
        if callers:
            stats.print_callers(callers)
    print(f"{len(users) / elapsed:,.0f} ops/s", file=sys.stderr)


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
    options = parser.parse_args()
    with durable_stores([options.engine]) as stores:
        url, sock = stores(options.engine)
        settings = Settings(database_url=url, redis_url=f"unix://{sock}")
        engine = build_engine(settings)
        migrate.upgrade(engine)
        service = OrderService(engine, redis.Redis(unix_socket_path=str(sock)), settings)
        users = [f"user-{i:07d}" for i in range(options.ops)]
        mode = "refuse" if options.refuse else options.mode
        run(service, users, mode, options.cprofile, options.sort, options.callers)
        service.close()


if __name__ == "__main__":
    main()
