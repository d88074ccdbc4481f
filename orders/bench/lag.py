"""The close lag: ``closed_at - expires_at`` of orders expiring at a steady rate, closed by a
real ``orders scheduler`` process started on the same stores.

The scheduler runs under a key prefix of the bench's own (its lease, heartbeat and index
beside no other scheduler's) and with none of the host's other ``ORDERS_*`` settings, so it
runs no handler, webhook or retention of the host's. It sweeps SQL as any scheduler does,
so the figure is skipped when another user's unpaid order would fall due meanwhile.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text

from orders import OrderService, OrderStatus, Settings
from orders.bench.measure import percentile
from orders.bench.stores import Bench, now_ms


def scheduler_env(settings: Settings, key_prefix: str) -> dict[str, str]:
    """The scheduler's environment: these stores under ``key_prefix``, and none of the
    other ``ORDERS_*`` settings (no handlers, webhooks, retention or ports of the host)."""
    # ORDERS_REDIS_SERVER: not a setting, the embedded server's binary.
    env = {k: v for k, v in os.environ.items() if k[:7] != "ORDERS_" or k[7:] == "REDIS_SERVER"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env |= {"ORDERS_HOME": str(settings.home), "ORDERS_KEY_PREFIX": key_prefix}
    for name, url in (("DATABASE", settings.database_url), ("REDIS", settings.redis_url)):
        if url is not None:
            env[f"ORDERS_{name}_URL"] = url.reveal()
    return env


def close_lag(b: Bench) -> dict[str, Any] | None:
    """``closed_at - expires_at`` of orders expiring at a steady rate, closed by a real
    ``orders scheduler`` process (under a key prefix of the bench's own)."""
    z = b.sizes
    n = max(1, round(z.lag_rate_s * z.lag_s))
    if b.foreign_unpaid_due(now_ms() + 60_000 + round(2 * n * b.create_ms + z.lag_s * 1000)):
        b.notes.append("close_lag skipped: other users' orders fall due meanwhile")
        return None
    prefix = f"{b.settings.key_prefix}{b.tag}lag-"
    lagged = OrderService(b.engine, b.client, replace(b.settings, key_prefix=prefix))
    with tempfile.TemporaryFile() as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "orders", "scheduler"],
            env=scheduler_env(b.settings, prefix),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            if not _started(b, lagged, child):
                log.seek(0)
                last = (log.read().decode(errors="replace").strip().splitlines() or [""])[-1]
                b.notes.append(f"close_lag skipped: the scheduler closed nothing ({last})")
                return None
            users = b.users("l", n)
            start = now_ms() + 500 + round(2 * n * b.create_ms)  # time to create them all
            expiries = [start + round(i * 1000 / z.lag_rate_s) for i in range(n)]
            for user, at_ms in zip(users, expiries, strict=True):
                lagged.create_unpaid_order(
                    user, expires_at=datetime.fromtimestamp(at_ms / 1000, UTC)
                )
            if now_ms() > start - 100:
                b.notes.append("close_lag: the orders were created late; the first may lag")
            deadline = time.monotonic() + (expiries[-1] - now_ms()) / 1000 + 30
            while time.monotonic() < deadline and b.count(
                "user_id LIKE :lag AND status = 'unpaid'", lag=f"{b.tag}l%"
            ):
                time.sleep(0.1)
        finally:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    query = "SELECT closed_at_ms - expires_at_ms FROM oes_orders WHERE user_id LIKE :lag"
    with b.engine.connect() as conn:
        found = conn.scalars(text(query + " AND status = 'closed'"), {"lag": f"{b.tag}l%"})
        lags = [int(x) for x in found]
    return {
        "rate_s": z.lag_rate_s,
        "orders": n,
        "closed": len(lags),
        "p50_ms": percentile(lags, 50),
        "p99_ms": percentile(lags, 99),
        "max_ms": float(max(lags, default=0)),
    }


def _started(b: Bench, lagged: OrderService, child: subprocess.Popen[bytes]) -> bool:
    """Whether the scheduler closed a probe order due at once, within a minute."""
    at = datetime.fromtimestamp((now_ms() + 100) / 1000, UTC)
    probe = lagged.create_unpaid_order(b.users("p", 1)[0], expires_at=at)
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline:
        if lagged.get_order(probe.id).status is OrderStatus.CLOSED:
            return True
        time.sleep(0.05)
    return False
