"""The prune beside live traffic: create rate and close lag before and while 10^6 rows go.

Starts the durable stores of ``benchmarks/bench_durable.py`` (PostgreSQL with fsync, synchronous
commits and full-page writes on; redis-server on a unix socket), migrates, bulk-loads
``--orders`` terminal orders (paid, closed, cancelled) last changed half a year ago, with
their events, and then runs a steady load as deployed: ``--rate`` creates per second through
``OrderService`` in this process (short-lived orders, so they come due all the time), an
``orders scheduler`` process sweeping them, and after ``--baseline-s`` an ``orders prune
--older-than 90d`` process until it has deleted everything it may. For each
phase it prints the creates per second achieved, their latency (p50, p99) and the close lag
of the orders that came due in it (p50, p99, max: closed_at - expires_at), and for the
prune its orders and events per second. A measurement, not a test.

    .venv/bin/python benchmarks/prune_bench.py --orders 1000000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
from sqlalchemy import Engine, text

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_durable import durable_stores  # noqa: E402
from orders import ExpiryPolicy, OrderService, Settings  # noqa: E402
from orders.bootstrap import build_engine  # noqa: E402
from orders.errors import OrdersError  # noqa: E402
from orders.sql.migrate import upgrade  # noqa: E402

DAY_MS = 86_400_000
#: The ``orders`` command of this interpreter's environment.
ORDERS = str(Path(sys.executable).with_name("orders"))
#: Terminal orders only (no unpaid row: those would all be due at once): 50 % paid,
#: 40 % closed, 10 % cancelled, created and last changed ``age`` ago, 10 ms apart.
BULK_ORDERS = """
INSERT INTO oes_orders (id, user_id, status, amount, currency, created_at_ms, expires_at_ms,
                        updated_at_ms, paid_at_ms, closed_at_ms, close_reason, payment_ref)
SELECT 'P' || lpad(i::text, 25, '0'),
       'u' || substr(md5(i::text), 1, 23),
       s.status, '19.90', 'EUR', t, t + 900000, t + 1000,
       CASE WHEN s.status = 'paid' THEN t + 1000 END,
       CASE WHEN s.status IN ('closed', 'cancelled') THEN t + 1000 END,
       CASE s.status WHEN 'closed' THEN 'expired' WHEN 'cancelled' THEN 'cancelled' END,
       CASE WHEN s.status = 'paid' THEN 'pi_P' || lpad(i::text, 25, '0') END
FROM generate_series(1, :n) AS i,
     LATERAL (SELECT :start_ms + i * 10 AS t) AS tt,
     LATERAL (SELECT CASE WHEN i % 10 < 5 THEN 'paid' WHEN i % 10 < 9 THEN 'closed'
                          ELSE 'cancelled' END AS status) AS s
"""
BULK_EVENTS = [
    """INSERT INTO oes_order_events (order_id, user_id, kind, at_ms)
       SELECT id, user_id, 'created', created_at_ms FROM oes_orders WHERE id LIKE 'P%'""",
    """INSERT INTO oes_order_events (order_id, user_id, kind, at_ms)
       SELECT id, user_id, status, updated_at_ms FROM oes_orders WHERE id LIKE 'P%'""",
]
LAGS = """
SELECT closed_at_ms - expires_at_ms FROM oes_orders
WHERE status = 'closed' AND id NOT LIKE 'P%' AND expires_at_ms >= :start AND expires_at_ms < :end
"""


@dataclass
class Phase:
    name: str
    seconds: float
    creates_per_s: float
    create_p50_ms: float
    create_p99_ms: float
    closed: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: int
    pruned_orders: int = 0
    pruned_events: int = 0
    pruned_orders_per_s: float = 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Load:
    """Creates at a fixed rate, on a thread of their own."""

    def __init__(self, service: OrderService, rate: float) -> None:
        self.service = service
        self.rate = rate
        self.latencies: list[tuple[float, float]] = []  # (when, seconds)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.create_loop, daemon=True)]

    def create_loop(self) -> None:
        n = 0
        next_at = time.monotonic()
        while not self.stop.is_set():
            next_at += 1 / self.rate
            started = time.monotonic()
            with contextlib.suppress(OrdersError):  # at the limit: a refusal is an answer too
                self.service.create_unpaid_order(f"load-{n % 5000}", ttl_s=1)
            self.latencies.append((started, time.monotonic() - started))
            n += 1
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop.wait(delay)
            else:
                next_at = time.monotonic()

    def phase(self, engine: Engine, name: str, start: float, end: float, t0_ms: int) -> Phase:
        took = [s for at, s in self.latencies if start <= at < end]
        start_ms = t0_ms + round((start - self.started) * 1000)
        end_ms = t0_ms + round((end - self.started) * 1000)
        with engine.connect() as conn:
            lags = [int(r[0]) for r in conn.execute(text(LAGS), {"start": start_ms, "end": end_ms})]
        return Phase(
            name=name,
            seconds=round(end - start, 1),
            creates_per_s=round(len(took) / (end - start), 1),
            create_p50_ms=round(percentile(took, 0.5) * 1000, 2),
            create_p99_ms=round(percentile(took, 0.99) * 1000, 2),
            closed=len(lags),
            lag_p50_ms=statistics.median(lags) if lags else 0.0,
            lag_p99_ms=percentile([float(v) for v in lags], 0.99),
            lag_max_ms=max(lags, default=0),
        )

    def start(self) -> None:
        self.started = time.monotonic()
        for thread in self.threads:
            thread.start()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)


def bulk_load(engine: Engine, n: int) -> float:
    """``n`` terminal orders of half a year ago with their events; the seconds it took."""
    loaded_at = time.monotonic()
    half_a_year_ago = round(time.time() * 1000) - 180 * DAY_MS
    with engine.begin() as conn:
        conn.execute(text(BULK_ORDERS), {"n": n, "start_ms": half_a_year_ago})
        for statement in BULK_EVENTS:
            conn.execute(text(statement))
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE oes_orders, oes_order_events"))
    return time.monotonic() - loaded_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orders", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=200.0, help="creates per second")
    parser.add_argument("--baseline-s", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=10.0, help="the scheduler's start")
    parser.add_argument("--batch-size", type=int, default=500)
    options = parser.parse_args()
    with durable_stores(["postgresql"]) as stores:
        url, sock = stores("postgresql")
        settings = Settings(unpaid_limit=3, default_policy=ExpiryPolicy(ttl_s=1))
        engine = build_engine(settings, url)
        upgrade(engine)
        load_s = bulk_load(engine, options.orders)
        client = redis.Redis(unix_socket_path=str(sock))
        service = OrderService(engine, client, settings)
        env = {**os.environ, "ORDERS_DATABASE_URL": url, "ORDERS_REDIS_URL": f"unix://{sock}"}
        scheduler = subprocess.Popen(
            [ORDERS, "scheduler"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(options.warmup_s)  # its start-up: interpreter, lease, index rebuild
        load = Load(service, options.rate)
        t0_ms = round(time.time() * 1000)
        try:
            load.start()
            time.sleep(options.baseline_s)
            prune_start = time.monotonic()
            batch = str(options.batch_size)
            pruned = subprocess.run(
                [ORDERS, "prune", "--older-than", "90d", "--json", "--batch-size", batch],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            prune_end = time.monotonic()
            time.sleep(3)  # the orders due by the prune's end are closed and counted
        finally:
            load.close()
            scheduler.send_signal(signal.SIGTERM)
            scheduler.wait(30)
        report = json.loads(pruned.stdout)
        baseline = load.phase(engine, "baseline", load.started + 2, prune_start, t0_ms)
        during = load.phase(engine, "during prune", prune_start, prune_end, t0_ms)
        during.pruned_orders, during.pruned_events = report["orders"], report["events"]
        during.pruned_orders_per_s = round(report["orders"] / (prune_end - prune_start), 1)
        service.close()
        client.close()
        engine.dispose()
    phases = [baseline, during]
    head = list(asdict(baseline))
    print(f"bulk load of {options.orders} orders with 2 events each: {load_s:.0f} s")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for phase in phases:
        print(" | ".join(str(v) for v in asdict(phase).values()))
    result: dict[str, Any] = {"options": vars(options), "phases": [asdict(p) for p in phases]}
    print(json.dumps(result), file=sys.stderr)


if __name__ == "__main__":
    main()
