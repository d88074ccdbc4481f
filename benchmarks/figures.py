"""The figures: each runs its variants side by side and returns its part of the report.

The throughput figures (create, refusal, mark_paid, cancel, sql_admission) are in
:mod:`benchmarks.throughput`, the three use cases at 1, 8 and 64 callers (callers) in
:mod:`benchmarks.callers`; the sweep, close-lag and Redis memory figures here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import func, select

from benchmarks.callers import callers
from benchmarks.holds import holds
from benchmarks.measure import (
    Run,
    Variant,
    chunks,
    ns,
    percentile,
    quiet,
    spread,
)
from benchmarks.throughput import cancel, create, mark_paid, refusal, sql_admission
from benchmarks.waiting import waiting
from benchmarks.workload import FOREIGN_MARGIN_MS, OC, SWEEP_NOW_MS, Workload
from orders.domain import OrderStatus
from orders.index.admissions import AdmitRequest
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.failures import sql_errors
from orders.sql.models import orders_table
from orders.sql.predicates import UNPAID_PREDICATE


def _sweep_variant(w: Workload, sweeper: OrderService, batch: int) -> Variant:
    """Load n due orders (untimed), then time one ``sweep_expired`` closing them."""

    def run(n: int) -> Run:
        users = w.users("d", n)
        ids = w.bulk_ids(n)
        expiries = [SWEEP_NOW_MS - n + i for i in range(n)]
        w.insert_rows(
            [w.row(o, u, e - 60_000, e) for o, u, e in zip(ids, users, expiries, strict=True)]
        )
        w.add_members(users, ids, expiries)
        started = ns()
        result = sweeper.sweep_expired(batch_size=batch)
        elapsed = ns() - started
        if result.closed != n:
            w.notes.append(f"sweep closed {result.closed} of {n} due orders (another sweeper?)")
        w.delete_ids(ids)
        return Run(result.closed, elapsed)

    return run


def _sweep_summary(rates: Mapping[str, Mapping[str, list[float]]]) -> dict[str, Any]:
    """The best batch size (on the 1x table, both phases) and what the 10x table cost."""

    def median(label: str, name: str) -> float:
        return statistics.median(rates[label][name])

    def small(name: str) -> float:
        return statistics.median(rates["table_1x"][name] + rates["table_1x_again"][name])

    names = list(rates["table_1x"])
    best = max(names, key=small)
    return {
        "best_batch": int(best.removeprefix("batch_")),
        "best_closes_s": small(best),
        "best_closes_s_10x": median("table_10x", best),
        "cost_10x": small(best) / median("table_10x", best),
        "cost_10x_by_batch": {name: small(name) / median("table_10x", name) for name in names},
        "drift_1x": median("table_1x_again", best) / median("table_1x", best),
    }


def sweep(w: Workload) -> dict[str, Any] | None:
    sz = w.sizes
    if w.foreign_unpaid_due(SWEEP_NOW_MS):
        w.notes.append("sweep skipped: the database holds other users' orders due in 2001")
        return None
    due, rows = sz.sweep_due, max(sz.sweep_rows, sz.sweep_due)
    sweeper = OrderService(w.engine, w.client, w.service.settings, clock=lambda: SWEEP_NOW_MS)
    variants = {f"batch_{b}": _sweep_variant(w, sweeper, b) for b in sz.batch_sizes}
    out: dict[str, Any] = {"due": due, "batch_sizes": list(sz.batch_sizes)}
    rates: dict[str, dict[str, list[float]]] = {}
    # The table cannot grow and shrink between two sweeps, so the sizes take turns as
    # phases instead, A B A: a machine that drifts shows as a gap between the two 1x.
    w.fill_open(rows - due)
    extra = ""
    for label, size in (("table_1x", rows), ("table_10x", rows * 10), ("table_1x_again", rows)):
        w.status(f"sweep: {size:,} orders in the table")
        if label == "table_10x":
            extra = w.fill_open(rows * 9)
        elif extra:
            w.delete_users(extra)
        w.settle()
        w.step(1)
        runs = w.measure(f"sweep, {size:,} orders", variants, n=due, reps=w.sweep_reps)
        rates[label] = {name: [r.ops_s for r in rs] for name, rs in runs.items()}
        out[label] = {"rows": size}
        out[label].update({name: {"closes_s": spread(v)} for name, v in rates[label].items()})
    out.update(_sweep_summary(rates))
    return out


def close_lag(w: Workload) -> dict[str, Any] | None:
    sz = w.sizes
    n = max(1, round(sz.lag_rate * sz.lag_seconds))
    gap_ms = 1000 / sz.lag_rate
    shift = w.service.clock() - SWEEP_NOW_MS
    base_clock = w.service.clock

    def clock() -> int:
        return base_clock() - shift

    last_ms = SWEEP_NOW_MS + round(sz.lag_seconds * 1000) + 60_000
    if w.foreign_unpaid_due(last_ms + FOREIGN_MARGIN_MS):
        w.notes.append("close_lag skipped: the database holds other users' orders due in 2001")
        return None
    settings = replace(w.service.settings, key_prefix=w.key_tag + "lag-")
    lagged = OrderService(w.engine, w.client, settings, clock=clock)
    sweeper = Sweeper(lagged, reconcile_at_start=False)
    # The startup reconcile would index every unpaid order in the database under the
    # bench's prefix (all are open in 2001); the bench's orders need no Redis members.
    lagged.index.epoch.set("orders-bench")

    w.status(f"close lag: inserting {n:,} orders expiring at {sz.lag_rate:g}/s")
    users = w.users("l", n)
    ids = w.bulk_ids(n)
    lead_ms = 1500 + n // 20  # time to insert them and to start the scheduler
    start_ms = clock() + lead_ms
    expiries = [start_ms + round(i * gap_ms) for i in range(n)]
    w.insert_rows(
        [w.row(o, u, e - 60_000, e) for o, u, e in zip(ids, users, expiries, strict=True)]
    )
    if clock() > start_ms - 200:
        w.notes.append("close_lag: the orders were inserted late; the first ones may lag")
    remaining = (
        select(func.count())
        .select_from(orders_table)
        .where(UNPAID_PREDICATE, OC.expires_at_ms <= expiries[-1])
    )
    scheduler = build_scheduler(sweeper, blocking=False)
    with quiet("orders.sweeper"), quiet("apscheduler"):
        scheduler.start()
        try:
            deadline = time.monotonic() + (lead_ms + sz.lag_seconds * 1000) / 1000 + 30
            shown = 0.0
            while time.monotonic() < deadline:
                time.sleep(0.1)
                done = min(1.0, max(0.0, (clock() - start_ms) / (expiries[-1] - start_ms + 1)))
                w.status(f"close lag: {done:.0%} of the expiry window")
                w.step(done * 10 - shown)
                shown = done * 10
                if clock() > expiries[-1]:
                    with sql_errors(), w.engine.connect() as conn:
                        if not conn.scalar(remaining):
                            break
        finally:
            scheduler.shutdown(wait=True)
            sweeper.close()
    query = (
        select(OC.expires_at_ms, OC.closed_at_ms - OC.expires_at_ms)
        .where(
            OC.user_id.startswith(f"{w.tag}l", autoescape=True),
            OC.status == OrderStatus.CLOSED.value,
        )
        .order_by(OC.expires_at_ms)
    )
    with sql_errors(), w.engine.connect() as conn:
        closed = [(int(e), int(lag)) for e, lag in conn.execute(query)]
    lags = [lag for _, lag in closed]
    if len(lags) != n:
        w.notes.append(f"close_lag: {len(lags)} of {n} orders were closed in time")
    return {
        "rate_s": sz.lag_rate,
        "seconds": sz.lag_seconds,
        "orders": n,
        "closed": len(lags),
        "batch_size": sweeper.batch_size,
        "p50_ms": percentile(lags, 50),
        "p99_ms": percentile(lags, 99),
        "max_ms": float(max(lags, default=0)),
        "samples": {
            "due_s": [round((e - start_ms) / 1000, 3) for e, _ in closed],
            "lag_ms": lags,
        },
    }


def redis_memory(w: Workload) -> dict[str, Any]:
    sz, index, clock = w.sizes, w.service.index, w.service.clock
    ttl = w.ttl_ms
    per_order: dict[int, list[float]] = {1: [], 3: []}
    in_flight: dict[int, list[float]] = {1: [], 3: []}
    key_bytes = 0
    for rep in range(sz.memory_reps):
        for k, values in per_order.items():
            w.status(f"redis memory: {k} per user, repetition {rep + 1}")
            users = w.users("m", sz.memory_users)
            ids = w.order_ids(len(users) * k)
            key_bytes = len(w.key(users[-1]).encode())
            before = w.used_memory()
            now = clock()
            for u, user in enumerate(users):
                for j in range(k):
                    index.admit(
                        AdmitRequest(
                            user, ids[u * k + j], expires_at_ms=now + ttl, now_ms=now, limit=k
                        )
                    )
            after = w.used_memory()
            # Each admission also notes its create's start in the user's admissions hash,
            # which expires one admission window later (Settings.admission_window_ms):
            # what an open order costs for the rest of its life is measured without it.
            for part in chunks([index.admits_key(u) for u in users], 1000):
                w.client.delete(*part)
            settled = w.used_memory()
            values.append((settled - before) / len(ids))
            in_flight[k].append((after - before) / len(ids))
            for part in chunks([k for u in users for k in w.admit_keys(u)], 1000):
                w.client.delete(*part)
            w.step(1)
    return {
        "users": sz.memory_users,
        "key_bytes": key_bytes,
        "member_bytes": 26,
        "window_s": index.window_ms / 1000,
        **{
            f"per_user_{k}": {
                "bytes_per_order": spread(per_order[k]),
                "bytes_per_order_in_flight": spread(in_flight[k]),
            }
            for k in per_order
        },
    }


FIGURES = (
    "create",
    "refusal",
    "mark_paid",
    "cancel",
    "callers",
    "sweep",
    "close_lag",
    "redis_memory",
    "sql_admission",
    "holds",
    "waiting",
)

#: Each figure's function, in the order of FIGURES. None: the figure was skipped (see notes).
MAKERS: dict[str, Callable[[Workload], dict[str, Any] | None]] = {
    "create": create,
    "refusal": refusal,
    "mark_paid": mark_paid,
    "cancel": cancel,
    "callers": callers,
    "sweep": sweep,
    "close_lag": close_lag,
    "redis_memory": redis_memory,
    "sql_admission": sql_admission,
    "holds": holds,
    "waiting": waiting,
}
