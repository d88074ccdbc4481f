"""Creates with and without combining (``Settings.combine_creates``), side by side, on durable
stores (:mod:`bench_durable`: PostgreSQL with fsync on, SQLite WAL with synchronous=FULL,
Redis on a unix socket).

One process per engine run; two services on the same engine and Redis client, one
combining and one not, take turns: for each thread count, ``--rounds`` rounds of each,
interleaved (off, on, off, on, ...), so both see the same machine. Each round: every thread
creates ``--creates`` orders, each for a user of its own (no refusal), all threads released
together. Printed per engine, thread count and mode: the median round's ops/s (and the
spread), p50 and p99 of every call's latency, and for the combined mode how many creates
ran in batches and the mean batch size. The load average is printed before and after.

    ORDERS_REDIS_SERVER=/usr/bin/redis-server .venv/bin/python benchmarks/bench_combined.py
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_durable import durable_stores  # noqa: E402
from orders.bootstrap import build_engine, build_redis  # noqa: E402
from orders.config import Settings  # noqa: E402
from orders.service import OrderService  # noqa: E402
from orders.sql import migrate  # noqa: E402


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def one_round(
    service: OrderService, threads: int, creates: int, tag: str
) -> tuple[float, list[float]]:
    """(ops/s, latencies in s) of ``threads`` threads making ``creates`` creates each."""
    barrier = threading.Barrier(threads + 1)
    latencies: list[list[float]] = [[] for _ in range(threads)]

    def run(n: int) -> None:
        barrier.wait()
        mine = latencies[n]
        for i in range(creates):
            began = time.perf_counter()
            service.create_unpaid_order(f"{tag}-{n}-{i}", ttl_s=600)
            mine.append(time.perf_counter() - began)

    workers = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - began
    return threads * creates / elapsed, [x for mine in latencies for x in mine]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench(engine_name: str, url: str, sock: Path, options: argparse.Namespace) -> None:
    base = Settings(
        database_url=url, redis_url=f"unix://{sock}", sql_pool_size=80, sql_max_overflow=10
    )
    engine = build_engine(base)
    migrate.upgrade(engine)
    client = build_redis(base)
    services = {
        "off": OrderService(engine, client, base),
        "on": OrderService(engine, client, dataclasses.replace(base, combine_creates=True)),
    }
    for name, service in services.items():  # first connects and compiles
        one_round(service, 8, 5, f"warm-{name}")
    print(f"[{engine_name}] load average before: {load()}", flush=True)
    for threads in options.threads:
        creates = max(5, options.total // threads)
        figures: dict[str, list[float]] = {"off": [], "on": []}
        latencies: dict[str, list[float]] = {"off": [], "on": []}
        combiner = services["on"].combiner
        assert combiner is not None
        before = (combiner.stats.combined, combiner.stats.batches)
        for r in range(options.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                ops, lat = one_round(services[mode], threads, creates, f"{mode}-{threads}-{r}")
                figures[mode].append(ops)
                latencies[mode] += lat
        combined = combiner.stats.combined - before[0]
        batches = combiner.stats.batches - before[1]
        for mode in ("off", "on"):
            ops = figures[mode]
            lat = latencies[mode]
            extra = ""
            if mode == "on":
                calls = threads * creates * options.rounds
                mean = combined / batches if batches else 0
                extra = f", in batches {combined}/{calls}, mean batch {mean:.1f}"
            print(
                f"[{engine_name}] {threads:2d} threads, combining {mode:3s}: "
                f"{statistics.median(ops):7.0f} ops/s (rounds {min(ops):.0f}-{max(ops):.0f}), "
                f"p50 {percentile(lat, 0.5) * 1000:6.2f} ms, "
                f"p99 {percentile(lat, 0.99) * 1000:6.2f} ms"
                f"{extra}",
                flush=True,
            )
        ratio = statistics.median(figures["on"]) / statistics.median(figures["off"])
        print(f"[{engine_name}] {threads:2d} threads: on/off {ratio:.2f}x", flush=True)
    print(f"[{engine_name}] load average after: {load()}", flush=True)
    client.close()
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="sqlite,postgresql")
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--total", type=int, default=1280, help="creates per round")
    options = parser.parse_args()
    engines = [e.strip() for e in options.engines.split(",") if e.strip()]
    with durable_stores(engines) as stores:
        for engine_name in engines:
            url, sock = stores(engine_name)
            bench(engine_name, url, sock, options)


if __name__ == "__main__":
    main()
