"""Prometheus metrics of the expiry pipeline (prometheus-client, default registry).

They live in the process's default registry, so a host application that already serves
``/metrics`` exposes them with its own; ``orders scheduler --metrics-port`` serves them on
its own. This module imports nothing else from the package, so any module may count.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

CREATES = Counter(
    "orders_creates_total",
    "create_unpaid_order calls by result",
    ["result"],  # admitted, retry (same order again), refused_redis, refused_sql, conflict
)
PAYMENTS = Counter(
    "orders_payments_total",
    "mark_paid calls by outcome",
    # on_time, late_before_close (after expires_at, before the sweep), refused_after_close,
    # refused_strict (strict_expiry), repeat (idempotent retry), other_ref
    ["outcome"],
)
CANCELS = Counter("orders_cancels_total", "orders cancelled")
EXTENSIONS = Counter("orders_extensions_total", "expiries moved", ["trigger"])
CLOSES = Counter("orders_closes_total", "orders closed by the sweep")
SWEEP_SECONDS = Histogram(
    "orders_sweep_duration_seconds",
    "duration of sweeps that closed something",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
CLOSE_LAG_SECONDS = Histogram(
    "orders_close_lag_seconds",
    "closed_at - expires_at of each closed order",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
BACKLOG = Gauge("orders_backlog", "unpaid orders due but not yet closed, after the last tick")
RECONCILE_FIXES = Counter(
    "orders_reconcile_fixes_total",
    "index members reconcile fixed, by kind",
    ["kind"],  # added, rescored, removed_terminal, removed_expired
)
FOREIGN_KEYS = Counter(
    "orders_foreign_keys_total",
    "keys or members under the key prefix that the service did not write, skipped",
)
STORE_ERRORS = Counter("orders_store_errors_total", "failed Redis or SQL calls", ["store"])


def serve(port: int, addr: str = "127.0.0.1") -> int:
    """Serve /metrics on ``addr:port`` from a daemon thread; returns the port (0: any free)."""
    server, _thread = start_http_server(port, addr=addr)
    return int(server.server_port)
