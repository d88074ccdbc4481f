"""``orders bench``: what the service costs, measured on your own stores against its floors.

Every comparison runs side by side in one process: the variants of a figure take turns
(A B C A B C ...) for several repetitions, so a machine that slows down or speeds up during
the run affects each of them alike. Each figure reports the median over the repetitions and
the min-max, and every ratio is computed per repetition (A_r / B_r) before its median is
taken, so a ratio holds on a noisy machine even when the absolute figures wander.

The figures, each with what it is compared with:

1. ``create``: ``create_unpaid_order`` end to end (every op a new user, so every op is
   admitted), on 1 thread and on N, against the raw floor measured in the same run (one
   EVALSHA of the admission script alone, one Core INSERT + COMMIT of the same row alone,
   combined as ``1 / (1/a + 1/b)``) and against the naive approach (ZCARD, then ZADD from
   the client, then the same INSERT).
2. ``refusal``: a create refused at the limit, and the SQL statements it issued (should be
   none), against one raw EVALSHA that refuses.
3. ``mark_paid``: end to end against one raw ``UPDATE ... WHERE status = 'unpaid'`` + COMMIT.
4. ``sweep``: closes per second of ``sweep_expired`` per batch size, on a table of many
   unpaid orders of which a fixed number are due, then on a table ten times larger with the
   same number due (the cost should stay flat), then on the first size again: a table cannot
   grow and shrink between two sweeps, so the sizes take turns as phases (1x 10x 1x).
5. ``close_lag``: ``closed_at - expires_at`` with a real :class:`~orders.sweeper.Sweeper` in
   an APScheduler background scheduler while orders expire at a steady rate.
6. ``redis_memory``: Redis ``used_memory`` per open order, with 1 and 3 orders per user.
7. ``sql_admission``: the SQL guard alone (count + insert under the per-user lock, no Redis)
   as a peer of the Redis path, for refusals and for admissions.

Besides wall-clock figures, each variant reports the client's CPU time per operation: on a
busy machine the wall clock of every variant suffers, the CPU time hardly.

What the bench writes is its own: users ``bench-<random>-...``, orders whose ids it made,
Redis keys under ``<key prefix>bench-<random>-``. The sweep figure runs the service with a
clock stopped in 2001 (``SWEEP_NOW_MS``) and the close-lag figure with one running at real
speed from that date, so the only orders due in their eyes are the bench's own, inserted
with expiries in 2001; a database holding someone else's unpaid order due by then makes the
bench skip those two figures rather than close it. (The close-lag scheduler also takes its
lease under the bench's prefix and skips its startup reconcile, which would otherwise index
every unpaid order of the database under that prefix.) Everything is deleted at the end
(``order_events`` rows go by the cascade), also when the bench fails or is interrupted. The
only other trace is planner statistics: the sweep figure runs ``ANALYZE`` (PostgreSQL:
``VACUUM (ANALYZE)``) on ``orders`` after each bulk load.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import platform
import secrets
import sqlite3
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from typing import Any

import click
import redis
import sqlalchemy
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from sqlalchemy import Engine, bindparam, delete, event, func, insert, select, update

from orders.domain import OrderIdGenerator, OrderStatus
from orders.errors import OrdersError, UnpaidOrderLimitReached
from orders.lease import SweeperLease
from orders.models import UNPAID_PREDICATE, events_table, orders_table, sql_errors
from orders.scheduling import build_scheduler
from orders.service import OrderService, _SqlRefused
from orders.sweeper import Sweeper

OC = orders_table.c
UNPAID = OrderStatus.UNPAID.value

#: "Now" of the sweep figure, and the start of the close-lag figure's shifted clock:
#: 2001-09-09, long before any real order was created.
SWEEP_NOW_MS = 1_000_000_000_000
#: How far past its latest expiry the close-lag figure checks that no foreign order is due.
FOREIGN_MARGIN_MS = 24 * 3600 * 1000

ns = time.perf_counter_ns

TARGETS = {
    "create_vs_floor": 0.9,
    "create_vs_naive": 1.5,
    "refusal_vs_evalsha": 0.9,
    "sweep_closes_s": 20_000.0,
    "sweep_cost_10x": 1.3,
    "close_lag_p99_ms": 50.0,
    "redis_bytes_per_order": 120.0,
}

FIGURES = ("create", "refusal", "mark_paid", "sweep", "close_lag", "redis_memory", "sql_admission")


# --- measuring -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run of one variant: ``ops`` operations in ``elapsed_ns`` wall time.

    ``cpu_ns`` is the CPU time this process (all its threads) used meanwhile: unlike the
    wall time, it hardly changes when other programs load the machine, so it shows where
    the client's own cost goes even on a busy host (the servers' CPU is not in it).
    """

    ops: int
    elapsed_ns: int
    latencies_ns: list[int] = field(default_factory=list)
    cpu_ns: int = 0

    @property
    def ops_s(self) -> float:
        return self.ops * 1e9 / max(1, self.elapsed_ns)

    @property
    def cpu_us(self) -> float:
        """Client CPU microseconds per operation."""
        return self.cpu_ns / 1000 / max(1, self.ops)


#: A variant: given a number of operations, prepares its data (untimed) and times them.
Variant = Callable[[int], Run]


def run_ops(op: Callable[[int], object], n: int, threads: int = 1) -> Run:
    """Call ``op(i)`` for i in 0..n-1 on ``threads`` threads; time each call and the whole.

    The wall clock starts when every thread is ready and stops when the last is done.
    """
    cpu_started = time.process_time_ns()
    if threads <= 1:
        latencies: list[int] = []
        started = ns()
        for i in range(n):
            t0 = ns()
            op(i)
            latencies.append(ns() - t0)
        elapsed = ns() - started
        return Run(n, elapsed, latencies, time.process_time_ns() - cpu_started)
    per_thread: list[list[int]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    ready = threading.Barrier(threads + 1)

    def work(t: int) -> None:
        mine = per_thread[t]
        ready.wait()
        try:
            for i in range(t, n, threads):
                t0 = ns()
                op(i)
                mine.append(ns() - t0)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()
    started = ns()
    for worker in workers:
        worker.join()
    elapsed = ns() - started
    cpu = time.process_time_ns() - cpu_started
    if errors:
        raise errors[0]
    return Run(n, elapsed, [x for mine in per_thread for x in mine], cpu)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values``."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return float(ordered[rank])


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max: how a figure is reported."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0}
    return {
        "median": float(statistics.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
    }


def describe(runs: Sequence[Run]) -> dict[str, Any]:
    """ops/s over the repetitions, latency percentiles over every operation of them, and
    the client's CPU per operation (median over the repetitions)."""
    latencies = [x for run in runs for x in run.latencies_ns]
    return {
        "ops_s": spread([run.ops_s for run in runs]),
        "p50_ms": percentile(latencies, 50) / 1e6,
        "p99_ms": percentile(latencies, 99) / 1e6,
        "cpu_us": statistics.median(run.cpu_us for run in runs) if runs else 0.0,
    }


def ratios(a: Sequence[Run] | Sequence[float], b: Sequence[Run] | Sequence[float]) -> list[float]:
    """Per-repetition ratios a_r / b_r of two interleaved variants (ops/s)."""
    left = [x.ops_s if isinstance(x, Run) else x for x in a]
    right = [x.ops_s if isinstance(x, Run) else x for x in b]
    return [x / y for x, y in zip(left, right, strict=True) if y > 0]


def harmonic_floor(a: Sequence[Run], b: Sequence[Run]) -> list[float]:
    """Per repetition, the rate of doing one op of ``a`` then one of ``b``: 1/(1/a + 1/b)."""
    return [1 / (1 / x.ops_s + 1 / y.ops_s) for x, y in zip(a, b, strict=True)]


@contextlib.contextmanager
def counting_statements(engine: Engine) -> Iterator[list[int]]:
    """Counts every statement the engine sends to the database while the block runs."""
    counter = [0]

    def on_execute(*_: Any) -> None:
        counter[0] += 1

    event.listen(engine, "before_cursor_execute", on_execute)
    try:
        yield counter
    finally:
        event.remove(engine, "before_cursor_execute", on_execute)


@contextlib.contextmanager
def quiet(logger_name: str) -> Iterator[None]:
    """Hold a logger at WARNING (the sweeper logs a line per sweep that closed something)."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


# --- sizes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    ops: int = 1000
    reps: int = 5
    threads: int = 4
    warmup: int = 100
    sweep_rows: int = 50_000
    sweep_due: int = 10_000
    batch_sizes: tuple[int, ...] = (100, 500, 2000)
    lag_rate: float = 1000.0
    lag_seconds: float = 10.0
    memory_users: int = 10_000
    memory_reps: int = 3

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            ops=150,
            reps=3,
            warmup=20,
            sweep_rows=5_000,
            sweep_due=1_000,
            lag_rate=200.0,
            lag_seconds=2.0,
            memory_users=1_000,
            memory_reps=2,
        )


# --- the bench -----------------------------------------------------------------------------


class Bench:
    """The stores, the bench's own namespace in them, and the figures."""

    def __init__(
        self,
        service: OrderService,
        sizes: Sizes,
        *,
        step: Callable[[float], None] = lambda _units: None,
        status: Callable[[str], None] = lambda _text: None,
    ) -> None:
        self.service = service
        self.sizes = sizes
        self.engine = service.engine
        self.client: redis.Redis = service.index.client
        self.step = step
        self.status = status
        self.tag = f"bench-{secrets.token_hex(4)}-"
        self.key_tag = service.index.key_prefix + self.tag
        self.notes: list[str] = []
        self._serial = itertools.count()
        self._bulk_serial = itertools.count()
        self._bulk_prefix = "B" + self.tag[6:14]
        self._new_id = OrderIdGenerator(service.clock)
        admit_lua = resources.files("orders").joinpath("lua", "admit.lua").read_text("utf-8")
        self.admit_sha: str = self.client.script_load(admit_lua)
        self._full_users: list[str] | None = None

    # --- names and rows ----------------------------------------------------------------

    def users(self, kind: str, n: int) -> list[str]:
        """``n`` user ids never used before, all under the bench's tag."""
        batch = next(self._serial)
        return [f"{self.tag}{kind}{batch}-{i}" for i in range(n)]

    def order_ids(self, n: int) -> list[str]:
        """``n`` fresh ULIDs (26 characters), like the service's own ids."""
        return [self._new_id() for _ in range(n)]

    def bulk_ids(self, n: int) -> list[str]:
        """``n`` fresh 26-character ids, cheaper to make than ULIDs (for bulk rows)."""
        return [f"{self._bulk_prefix}{next(self._bulk_serial):017d}" for _ in range(n)]

    def key(self, user_id: str) -> str:
        return self.service.index.key(user_id)

    @staticmethod
    def row(order_id: str, user_id: str, created_ms: int, expires_ms: int) -> dict[str, Any]:
        """An orders row of the shape ``create_unpaid_order`` inserts (no amount, no metadata)."""
        return {
            "id": order_id,
            "user_id": user_id,
            "status": UNPAID,
            "amount": None,
            "currency": None,
            "created_at_ms": created_ms,
            "expires_at_ms": expires_ms,
            "updated_at_ms": created_ms,
            "metadata": None,
        }

    def insert_rows(self, rows: Sequence[dict[str, Any]], chunk: int = 5000) -> None:
        """Bulk rows with Core executemany, one transaction per chunk."""
        statement = insert(orders_table)
        for part in chunks(rows, chunk):
            with sql_errors(), self.engine.begin() as conn:
                conn.execute(statement, list(part))

    def delete_ids(self, ids: Sequence[str]) -> None:
        for part in chunks(ids, 500):
            with sql_errors(), self.engine.begin() as conn:
                conn.execute(delete(orders_table).where(OC.id.in_(list(part))))

    def open_orders(self, kind: str, n: int, *, members: bool) -> list[str]:
        """``n`` open unpaid orders of ``n`` new users, inserted directly (untimed setup);
        with ``members``, each also gets its Redis member, as a create would have added."""
        now = self.service.clock()
        expires = now + self.service.settings.ttl_ms
        ids = self.order_ids(n)
        users = self.users(kind, n)
        self.insert_rows([self.row(o, u, now, expires) for o, u in zip(ids, users, strict=True)])
        if members:
            self.add_members(users, ids, [expires] * n)
        return ids

    def add_members(self, users: Sequence[str], ids: Sequence[str], scores: Sequence[int]) -> None:
        pipe = self.client.pipeline(transaction=False)
        for user, oid, score in zip(users, ids, scores, strict=True):
            pipe.zadd(self.key(user), {oid: score})
        pipe.execute()

    def full_users(self) -> list[str]:
        """Users holding one open order each, admitted by the service with limit 1."""
        if self._full_users is None:
            users = self.users("full", min(self.sizes.ops, 1000))
            for user in users:
                self.service.create_unpaid_order(user, limit=1)
            self._full_users = users
        return self._full_users

    def foreign_unpaid_due(self, cutoff_ms: int) -> int:
        """Unpaid orders of other users due by ``cutoff_ms``: a shifted sweep would close them."""
        query = (
            select(func.count())
            .select_from(orders_table)
            .where(UNPAID_PREDICATE, OC.expires_at_ms <= cutoff_ms)
            .where(~OC.user_id.startswith(self.tag, autoescape=True))
        )
        with sql_errors(), self.engine.connect() as conn:
            return int(conn.scalar(query) or 0)

    # --- interleaving --------------------------------------------------------------------

    def measure(
        self,
        label: str,
        variants: Mapping[str, Variant],
        *,
        n: int | None = None,
        reps: int | None = None,
    ) -> dict[str, list[Run]]:
        """One warm-up run of each variant, then ``reps`` rounds of A B C ..., in turn."""
        n = self.sizes.ops if n is None else n
        reps = self.sizes.reps if reps is None else reps
        self.status(f"{label}: warm-up")
        for variant in variants.values():
            variant(min(n, self.sizes.warmup))
            self.step(1)
        runs: dict[str, list[Run]] = {name: [] for name in variants}
        for rep in range(reps):
            self.status(f"{label}: repetition {rep + 1} of {reps}")
            for name, variant in variants.items():
                runs[name].append(variant(n))
                self.step(1)
        return runs

    # --- variants ----------------------------------------------------------------------

    def v_create(self, threads: int = 1) -> Variant:
        service = self.service

        def variant(n: int) -> Run:
            users = self.users("c", n)
            return run_ops(lambda i: service.create_unpaid_order(users[i]), n, threads)

        return variant

    def v_evalsha(self, threads: int = 1) -> Variant:
        """One EVALSHA of the admission script that admits (a new user per op)."""
        client, sha, clock = self.client, self.admit_sha, self.service.clock
        s = self.service.settings
        ttl, limit, margin = s.ttl_ms, s.unpaid_limit, s.key_margin_ms

        def variant(n: int) -> Run:
            keys = [self.key(u) for u in self.users("e", n)]
            ids = self.order_ids(n)

            def op(i: int) -> None:
                now = clock()
                client.evalsha(sha, 1, keys[i], ids[i], now + ttl, now, limit, margin)

            return run_ops(op, n, threads)

        return variant

    def _insert_one(self) -> Callable[[dict[str, Any]], None]:
        statement = insert(orders_table)
        engine = self.engine

        def insert_one(row: dict[str, Any]) -> None:
            with engine.connect() as conn:
                conn.execute(statement, row)
                conn.commit()

        return insert_one

    def v_insert(self, threads: int = 1) -> Variant:
        """One Core INSERT + COMMIT of a row shaped like a create's."""
        insert_one, clock, ttl = (
            self._insert_one(),
            self.service.clock,
            self.service.settings.ttl_ms,
        )

        def variant(n: int) -> Run:
            users, ids = self.users("i", n), self.order_ids(n)

            def op(i: int) -> None:
                now = clock()
                insert_one(self.row(ids[i], users[i], now, now + ttl))

            return run_ops(op, n, threads)

        return variant

    def v_naive(self, threads: int = 1) -> Variant:
        """The original article's create: ZCARD, then ZADD from the client, then INSERT."""
        client, insert_one, clock = self.client, self._insert_one(), self.service.clock
        ttl, limit = self.service.settings.ttl_ms, self.service.settings.unpaid_limit

        def variant(n: int) -> Run:
            users, ids = self.users("n", n), self.order_ids(n)

            def op(i: int) -> None:
                now = clock()
                key = self.key(users[i])
                if int(client.zcard(key)) >= limit:
                    raise RuntimeError("naive create refused a new user")
                client.zadd(key, {ids[i]: now + ttl})
                insert_one(self.row(ids[i], users[i], now, now + ttl))

            return run_ops(op, n, threads)

        return variant

    def v_refusal(self) -> Variant:
        """``create_unpaid_order`` refused at the limit (users holding 1 of 1)."""
        service, users = self.service, self.full_users()

        def op(i: int) -> None:
            try:
                service.create_unpaid_order(users[i % len(users)], limit=1)
            except UnpaidOrderLimitReached:
                return
            raise RuntimeError("a create at the limit was admitted")

        return lambda n: run_ops(op, n)

    def v_evalsha_refused(self) -> Variant:
        """One EVALSHA of the admission script that refuses (the same full users)."""
        client, sha, clock = self.client, self.admit_sha, self.service.clock
        s = self.service.settings
        keys = [self.key(u) for u in self.full_users()]

        def variant(n: int) -> Run:
            ids = self.order_ids(n)

            def op(i: int) -> None:
                now = clock()
                reply = client.evalsha(
                    sha, 1, keys[i % len(keys)], ids[i], now + s.ttl_ms, now, 1, s.key_margin_ms
                )
                if int(reply[0]) != -1:
                    raise RuntimeError("raw admission at the limit was not refused")

            return run_ops(op, n)

        return variant

    def v_sql_guard(self, *, refuse: bool) -> Variant:
        """The SQL guard alone: ``_insert_guarded`` (count + insert under the user's lock)."""
        service, clock, ttl = self.service, self.service.clock, self.service.settings.ttl_ms

        def variant(n: int) -> Run:
            users = self.full_users() if refuse else self.users("g", n)
            ids = self.order_ids(n)
            limit = 1 if refuse else service.settings.unpaid_limit

            def op(i: int) -> None:
                now = clock()
                values = self.row(ids[i], users[i % len(users)], now, now + ttl)
                try:
                    service._insert_guarded(values, limit, now)
                except _SqlRefused:
                    if refuse:
                        return
                    raise
                if refuse:
                    raise RuntimeError("the SQL guard admitted an order at the limit")

            return run_ops(op, n)

        return variant

    # --- the figures -------------------------------------------------------------------

    def fig_create(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for threads in dict.fromkeys((1, self.sizes.threads)):
            runs = self.measure(
                f"create, {threads} thread{'s' if threads > 1 else ''}",
                {
                    "create": self.v_create(threads),
                    "evalsha": self.v_evalsha(threads),
                    "insert": self.v_insert(threads),
                    "naive": self.v_naive(threads),
                },
            )
            floor = harmonic_floor(runs["evalsha"], runs["insert"])
            out[f"threads_{threads}"] = {
                "threads": threads,
                "ops_per_rep": self.sizes.ops,
                "variants": {name: describe(r) for name, r in runs.items()},
                "floor_ops_s": spread(floor),
                "create_vs_floor": spread(ratios(runs["create"], floor)),
                "create_vs_naive": spread(ratios(runs["create"], runs["naive"])),
            }
        return out

    def fig_refusal(self) -> dict[str, Any]:
        refusal, evalsha = self.v_refusal(), self.v_evalsha_refused()
        with counting_statements(self.engine) as statements:
            runs = self.measure("refusal", {"refusal": refusal, "evalsha": evalsha})
        refusals = self.sizes.reps * self.sizes.ops + min(self.sizes.ops, self.sizes.warmup)
        return {
            "ops_per_rep": self.sizes.ops,
            "variants": {name: describe(r) for name, r in runs.items()},
            "sql_statements": statements[0],
            "refusals": refusals,
            "refusal_vs_evalsha": spread(ratios(runs["refusal"], runs["evalsha"])),
        }

    def fig_mark_paid(self) -> dict[str, Any]:
        service, engine, clock = self.service, self.engine, self.service.clock
        statement = (
            update(orders_table)
            .where(OC.id == bindparam("b_id"), UNPAID_PREDICATE)
            .values(
                status=OrderStatus.PAID.value,
                paid_at_ms=bindparam("b_now"),
                updated_at_ms=bindparam("b_now"),
            )
        )

        def mark_paid(n: int) -> Run:
            ids = self.open_orders("p", n, members=True)
            return run_ops(lambda i: service.mark_paid(ids[i]), n)

        def raw_update(n: int) -> Run:
            ids = self.open_orders("u", n, members=False)

            def op(i: int) -> None:
                with engine.connect() as conn:
                    conn.execute(statement, {"b_id": ids[i], "b_now": clock()})
                    conn.commit()

            return run_ops(op, n)

        runs = self.measure("mark_paid", {"mark_paid": mark_paid, "raw_update": raw_update})
        return {
            "ops_per_rep": self.sizes.ops,
            "variants": {name: describe(r) for name, r in runs.items()},
            "mark_paid_vs_raw_update": spread(ratios(runs["mark_paid"], runs["raw_update"])),
        }

    def fig_sweep(self) -> dict[str, Any] | None:
        sz = self.sizes
        if self.foreign_unpaid_due(SWEEP_NOW_MS):
            self.notes.append("sweep skipped: the database holds other users' orders due in 2001")
            return None
        due, rows = sz.sweep_due, max(sz.sweep_rows, sz.sweep_due)
        sweeper = OrderService(
            self.engine, self.client, self.service.settings, clock=lambda: SWEEP_NOW_MS
        )

        def variant(batch: int) -> Variant:
            def run(n: int) -> Run:
                users = self.users("d", n)
                ids = self.bulk_ids(n)
                expiries = [SWEEP_NOW_MS - n + i for i in range(n)]
                self.insert_rows(
                    [
                        self.row(o, u, e - 60_000, e)
                        for o, u, e in zip(ids, users, expiries, strict=True)
                    ]
                )
                self.add_members(users, ids, expiries)
                started = ns()
                result = sweeper.sweep_expired(batch_size=batch)
                elapsed = ns() - started
                if result.closed != n:
                    self.notes.append(
                        f"sweep closed {result.closed} of {n} due orders (another sweeper?)"
                    )
                self.delete_ids(ids)
                return Run(result.closed, elapsed)

            return run

        variants = {f"batch_{b}": variant(b) for b in sz.batch_sizes}
        out: dict[str, Any] = {"due": due, "batch_sizes": list(sz.batch_sizes)}
        rates: dict[str, dict[str, list[float]]] = {}
        # The table cannot grow and shrink between two sweeps, so the sizes take turns as
        # phases instead, A B A: a machine that drifts shows as a gap between the two 1x.
        self.fill_open(rows - due)
        extra = ""
        for label, size in (("table_1x", rows), ("table_10x", rows * 10), ("table_1x_again", rows)):
            self.status(f"sweep: {size:,} orders in the table")
            if label == "table_10x":
                extra = self.fill_open(rows * 9)
            elif extra:
                self.delete_users(extra)
            self.settle()
            self.step(1)
            runs = self.measure(f"sweep, {size:,} orders", variants, n=due, reps=self.sweep_reps)
            rates[label] = {name: [r.ops_s for r in rs] for name, rs in runs.items()}
            out[label] = {"rows": size}
            out[label].update({name: {"closes_s": spread(v)} for name, v in rates[label].items()})

        def median(label: str, name: str) -> float:
            return statistics.median(rates[label][name])

        def small(name: str) -> float:
            return statistics.median(rates["table_1x"][name] + rates["table_1x_again"][name])

        best = max(variants, key=small)
        out["best_batch"] = int(best.removeprefix("batch_"))
        out["best_closes_s"] = small(best)
        out["best_closes_s_10x"] = median("table_10x", best)
        out["cost_10x"] = small(best) / median("table_10x", best)
        out["cost_10x_by_batch"] = {
            name: small(name) / median("table_10x", name) for name in variants
        }
        out["drift_1x"] = median("table_1x_again", best) / median("table_1x", best)
        return out

    @property
    def sweep_reps(self) -> int:
        """Repetitions per sweep phase: each costs a fresh load of due orders."""
        return min(self.sizes.reps, 3)

    def settle(self) -> None:
        """After a bulk load or delete: fresh planner statistics, and on PostgreSQL a VACUUM,
        as a live table kept by autovacuum would have."""
        with sql_errors(), self.engine.connect() as conn:
            if self.engine.dialect.name == "postgresql":
                conn.execution_options(isolation_level="AUTOCOMMIT")
                conn.exec_driver_sql("VACUUM (ANALYZE) orders")
            else:
                conn.exec_driver_sql("ANALYZE orders")
                conn.commit()

    def delete_users(self, prefix: str) -> None:
        with sql_errors(), self.engine.begin() as conn:
            conn.execute(delete(orders_table).where(OC.user_id.startswith(prefix, autoescape=True)))

    def fill_open(self, n: int) -> str:
        """``n`` unpaid orders not due for a week (3 per user), inserted directly.

        Returns the user-id prefix of their users (see :meth:`delete_users`).
        """
        users = self.users("o", max(1, (n + 2) // 3))
        prefix = users[0].rpartition("-")[0] + "-"
        if n <= 0:
            return prefix
        now = self.service.clock()
        ids = self.bulk_ids(n)
        week = 7 * 24 * 3600 * 1000
        step = 10_000
        for start in range(0, n, step):
            end = min(n, start + step)
            self.insert_rows(
                [self.row(ids[i], users[i // 3], now, now + week + i) for i in range(start, end)]
            )
        return prefix

    def fig_close_lag(self) -> dict[str, Any] | None:
        sz = self.sizes
        n = max(1, round(sz.lag_rate * sz.lag_seconds))
        gap_ms = 1000 / sz.lag_rate
        shift = self.service.clock() - SWEEP_NOW_MS
        base_clock = self.service.clock

        def clock() -> int:
            return base_clock() - shift

        last_ms = SWEEP_NOW_MS + round(sz.lag_seconds * 1000) + 60_000
        if self.foreign_unpaid_due(last_ms + FOREIGN_MARGIN_MS):
            self.notes.append(
                "close_lag skipped: the database holds other users' orders due in 2001"
            )
            return None
        settings = replace(self.service.settings, key_prefix=self.key_tag + "lag-")
        lagged = OrderService(self.engine, self.client, settings, clock=clock)
        sweeper = Sweeper(lagged, reconcile_at_start=False)
        # The startup reconcile would index every unpaid order in the database under the
        # bench's prefix (all are open in 2001); the bench's orders need no Redis members.
        lagged.index.set_epoch("orders-bench")

        self.status(f"close lag: inserting {n:,} orders expiring at {sz.lag_rate:g}/s")
        users = self.users("l", n)
        ids = self.bulk_ids(n)
        lead_ms = 1500 + n // 20  # time to insert them and to start the scheduler
        start_ms = clock() + lead_ms
        expiries = [start_ms + round(i * gap_ms) for i in range(n)]
        self.insert_rows(
            [self.row(o, u, e - 60_000, e) for o, u, e in zip(ids, users, expiries, strict=True)]
        )
        if clock() > start_ms - 200:
            self.notes.append("close_lag: the orders were inserted late; the first ones may lag")
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
                    self.status(f"close lag: {done:.0%} of the expiry window")
                    self.step(done * 10 - shown)
                    shown = done * 10
                    if clock() > expiries[-1]:
                        with sql_errors(), self.engine.connect() as conn:
                            if not conn.scalar(remaining):
                                break
            finally:
                scheduler.shutdown(wait=True)
                sweeper.close()
        query = select(OC.closed_at_ms - OC.expires_at_ms).where(
            OC.user_id.startswith(f"{self.tag}l", autoescape=True),
            OC.status == OrderStatus.CLOSED.value,
        )
        with sql_errors(), self.engine.connect() as conn:
            lags = [int(x) for x in conn.scalars(query)]
        if len(lags) != n:
            self.notes.append(f"close_lag: {len(lags)} of {n} orders were closed in time")
        return {
            "rate_s": sz.lag_rate,
            "seconds": sz.lag_seconds,
            "orders": n,
            "closed": len(lags),
            "batch_size": sweeper.batch_size,
            "p50_ms": percentile(lags, 50),
            "p99_ms": percentile(lags, 99),
            "max_ms": float(max(lags, default=0)),
        }

    def fig_redis_memory(self) -> dict[str, Any]:
        sz, index, clock = self.sizes, self.service.index, self.service.clock
        ttl = self.service.settings.ttl_ms
        per_order: dict[int, list[float]] = {1: [], 3: []}
        key_bytes = 0
        for rep in range(sz.memory_reps):
            for k, values in per_order.items():
                self.status(f"redis memory: {k} per user, repetition {rep + 1}")
                users = self.users("m", sz.memory_users)
                ids = self.order_ids(len(users) * k)
                key_bytes = len(self.key(users[-1]).encode())
                before = self.used_memory()
                now = clock()
                for u, user in enumerate(users):
                    for j in range(k):
                        index.admit(
                            user, ids[u * k + j], expires_at_ms=now + ttl, now_ms=now, limit=k
                        )
                after = self.used_memory()
                values.append((after - before) / len(ids))
                for part in chunks([self.key(u) for u in users], 1000):
                    self.client.delete(*part)
                self.step(1)
        return {
            "users": sz.memory_users,
            "key_bytes": key_bytes,
            "member_bytes": 26,
            "per_user_1": {"bytes_per_order": spread(per_order[1])},
            "per_user_3": {"bytes_per_order": spread(per_order[3])},
        }

    def used_memory(self) -> int:
        info: dict[str, Any] = self.client.info("memory")
        return int(info["used_memory"])

    def fig_sql_admission(self) -> dict[str, Any]:
        runs = self.measure(
            "sql admission",
            {
                "redis_refusal": self.v_refusal(),
                "sql_refusal": self.v_sql_guard(refuse=True),
                "create": self.v_create(),
                "sql_admission": self.v_sql_guard(refuse=False),
            },
        )
        return {
            "ops_per_rep": self.sizes.ops,
            "variants": {name: describe(r) for name, r in runs.items()},
            "refusal_redis_vs_sql": spread(ratios(runs["redis_refusal"], runs["sql_refusal"])),
            "admission_create_vs_sql": spread(ratios(runs["create"], runs["sql_admission"])),
        }

    # --- cleanup -----------------------------------------------------------------------

    def cleanup(self) -> None:
        """Delete the bench's rows (their events go by the cascade) and its Redis keys."""
        self._full_users = None
        with sql_errors(), self.engine.begin() as conn:
            conn.execute(
                delete(orders_table).where(OC.user_id.startswith(self.tag, autoescape=True))
            )
        for part in chunks(self.bench_keys(), 1000):
            self.client.delete(*part)

    def bench_keys(self) -> list[str]:
        pattern = _glob_escape(self.key_tag) + "*"
        found = self.client.scan_iter(match=pattern, count=1000)
        return [k.decode() if isinstance(k, bytes) else str(k) for k in found]

    def left_behind(self) -> dict[str, int]:
        mine = OC.user_id.startswith(self.tag, autoescape=True)
        events_mine = events_table.c.user_id.startswith(self.tag, autoescape=True)
        with sql_errors(), self.engine.connect() as conn:
            rows = conn.scalar(select(func.count()).select_from(orders_table).where(mine))
            events = conn.scalar(select(func.count()).select_from(events_table).where(events_mine))
        return {"rows": int(rows or 0), "events": int(events or 0), "keys": len(self.bench_keys())}

    def machine(self) -> dict[str, Any]:
        server: dict[str, Any] = self.client.info("server")
        dialect = self.engine.dialect.name
        if dialect == "sqlite":
            sql_version = sqlite3.sqlite_version
        else:
            with sql_errors(), self.engine.connect() as conn:
                sql_version = str(
                    conn.exec_driver_sql(
                        "SHOW server_version" if dialect == "postgresql" else "SELECT version()"
                    ).scalar()
                )
        return {
            "nproc": os.cpu_count() or 0,
            "load_average": os.getloadavg()[0],
            "python": platform.python_version(),
            "platform": platform.platform(),
            "redis": str(server.get("redis_version", "?")),
            "sql_engine": dialect,
            "sql_version": sql_version,
            "sqlalchemy": sqlalchemy.__version__,
            "redis_py": redis.__version__,
        }


# --- running it ----------------------------------------------------------------------------


#: Progress units per figure (a unit is one timed run, roughly).
def _units(sizes: Sizes, figure: str) -> float:
    per_measure = 1 + sizes.reps
    return {
        "create": 4 * per_measure * (1 if sizes.threads == 1 else 2),
        "refusal": 2 * per_measure,
        "mark_paid": 2 * per_measure,
        "sweep": 3 * (1 + len(sizes.batch_sizes) * (1 + min(sizes.reps, 3))),
        "close_lag": 10,
        "redis_memory": 2 * sizes.memory_reps,
        "sql_admission": 4 * per_measure,
    }[figure]


def run_bench(
    service: OrderService,
    sizes: Sizes,
    figures: Sequence[str],
    *,
    step: Callable[[float], None] = lambda _units: None,
    status: Callable[[str], None] = lambda _text: None,
) -> dict[str, Any]:
    """Run the chosen figures; always clean up. Returns the report (JSON-able)."""
    started = time.monotonic()
    bench = Bench(service, sizes, step=step, status=status)
    report: dict[str, Any] = {
        "engine": service.engine.dialect.name,
        "machine": bench.machine(),
        "sizes": asdict(sizes),
        "figures": {},
        "durations_s": {},
    }
    try:
        holder = SweeperLease(service.index.client, key_prefix=service.index.key_prefix).owner()
    except OrdersError:
        holder = None
    if holder is not None and {"sweep", "close_lag"} & set(figures):
        bench.notes.append(
            f"a scheduler holds the sweeper lease ({holder}): it may close the bench's due "
            "orders before the bench's own sweeps do; stop it for clean sweep figures"
        )
    makers: dict[str, Callable[[], dict[str, Any] | None]] = {
        "create": bench.fig_create,
        "refusal": bench.fig_refusal,
        "mark_paid": bench.fig_mark_paid,
        "sweep": bench.fig_sweep,
        "close_lag": bench.fig_close_lag,
        "redis_memory": bench.fig_redis_memory,
        "sql_admission": bench.fig_sql_admission,
    }
    try:
        for name in figures:
            figure_started = time.monotonic()
            result = makers[name]()
            if result is not None:
                report["figures"][name] = result
            status(f"{name}: cleaning up")
            bench.cleanup()
            report["durations_s"][name] = round(time.monotonic() - figure_started, 2)
    finally:
        bench.cleanup()
    report["machine"]["load_average_end"] = os.getloadavg()[0]
    report["left_behind"] = bench.left_behind()
    report["notes"] = bench.notes
    report["targets"] = targets(report)
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    return report


def _target(
    name: str, measured: float, required: str, ratio: float | None, ok: bool, note: str = ""
) -> dict[str, Any]:
    return {
        "name": name,
        "measured": measured,
        "required": required,
        "ratio": ratio,
        "verdict": "ok" if ok else "missed",
        "note": note,
    }


def targets(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each target with the measured figure, the ratio it is stated in, and ok/missed."""
    fig = report["figures"]
    engine = report["engine"]
    out: list[dict[str, Any]] = []
    t = TARGETS
    if "create" in fig:
        for part in fig["create"].values():
            threads = part["threads"]
            ratio = part["create_vs_floor"]["median"]
            out.append(
                _target(
                    f"create >= {t['create_vs_floor']} x raw floor ({engine}, {threads} thr)",
                    part["variants"]["create"]["ops_s"]["median"],
                    f">= {t['create_vs_floor'] * part['floor_ops_s']['median']:.0f} ops/s",
                    ratio,
                    ratio >= t["create_vs_floor"],
                )
            )
            naive = part["create_vs_naive"]["median"]
            out.append(
                _target(
                    f"create >= {t['create_vs_naive']} x naive ({engine}, {threads} thr)",
                    part["variants"]["create"]["ops_s"]["median"],
                    f">= {t['create_vs_naive'] * part['variants']['naive']['ops_s']['median']:.0f}"
                    " ops/s",
                    naive,
                    naive >= t["create_vs_naive"],
                    "not expected",
                )
            )
    if "refusal" in fig:
        part = fig["refusal"]
        out.append(
            _target(
                "refusal issues 0 SQL statements",
                part["sql_statements"],
                "0",
                None,
                part["sql_statements"] == 0,
            )
        )
        ratio = part["refusal_vs_evalsha"]["median"]
        out.append(
            _target(
                f"refusal >= {t['refusal_vs_evalsha']} x raw EVALSHA",
                part["variants"]["refusal"]["ops_s"]["median"],
                f">= {t['refusal_vs_evalsha'] * part['variants']['evalsha']['ops_s']['median']:.0f}"
                " ops/s",
                ratio,
                ratio >= t["refusal_vs_evalsha"],
            )
        )
    if "sweep" in fig:
        part = fig["sweep"]
        best = part["best_closes_s"]
        out.append(
            _target(
                f"sweep >= {t['sweep_closes_s']:.0f} closes/s "
                f"({engine}, batch {part['best_batch']})",
                best,
                f">= {t['sweep_closes_s']:.0f} closes/s",
                best / t["sweep_closes_s"],
                best >= t["sweep_closes_s"],
            )
        )
        cost = part["cost_10x"]
        out.append(
            _target(
                f"sweep on a 10x table costs <= {t['sweep_cost_10x']} x ({engine})",
                cost,
                f"<= {t['sweep_cost_10x']}",
                cost,
                cost <= t["sweep_cost_10x"],
                f"sizes as phases 1x 10x 1x; 1x drifted {part['drift_1x']:.2f} x",
            )
        )
    if "close_lag" in fig:
        part = fig["close_lag"]
        p99 = part["p99_ms"]
        out.append(
            _target(
                f"close lag p99 <= {t['close_lag_p99_ms']:.0f} ms at {part['rate_s']:g} expiries/s",
                p99,
                f"<= {t['close_lag_p99_ms']:.0f} ms",
                p99 / t["close_lag_p99_ms"],
                p99 <= t["close_lag_p99_ms"] and part["closed"] == part["orders"],
                "" if part["rate_s"] >= 1000 else "target is stated at 1,000/s",
            )
        )
    if "redis_memory" in fig:
        part = fig["redis_memory"]
        for k in (1, 3):
            per = part[f"per_user_{k}"]["bytes_per_order"]["median"]
            out.append(
                _target(
                    f"redis <= {t['redis_bytes_per_order']:.0f} B per open order ({k} per user)",
                    per,
                    f"<= {t['redis_bytes_per_order']:.0f} B",
                    per / t["redis_bytes_per_order"],
                    per <= t["redis_bytes_per_order"],
                )
            )
    return out


# --- output --------------------------------------------------------------------------------


def _rate(s: Mapping[str, float]) -> tuple[str, str]:
    return f"{s['median']:,.0f}", f"{s['min']:,.0f} - {s['max']:,.0f}"


def _times(s: Mapping[str, float]) -> tuple[str, str]:
    return f"{s['median']:.2f} x", f"{s['min']:.2f} - {s['max']:.2f}"


def results_table(report: Mapping[str, Any]) -> Table:
    m = report["machine"]
    table = Table(
        "figure",
        "measure",
        "median",
        "min - max",
        "p50 ms",
        "p99 ms",
        "client CPU us/op",
        title=(
            f"orders bench on {m['sql_engine']} {m['sql_version']} + redis {m['redis']} "
            f"({m['nproc']} cpus, load {m['load_average']:.1f}, python {m['python']}), "
            f"{report['elapsed_s']:.0f} s"
        ),
    )
    fig = report["figures"]

    def add(figure: str, measure: str, median: str, span: str = "", *more: str) -> None:
        table.add_row(figure, measure, median, span, *more)

    def variants(figure: str, part: Mapping[str, Any]) -> None:
        for name, v in part["variants"].items():
            add(figure, f"{name} ops/s", *_rate(v["ops_s"]), f"{v['p50_ms']:.3f}",
                f"{v['p99_ms']:.3f}", f"{v['cpu_us']:,.0f}")  # fmt: skip

    def ratio(figure: str, label: str, s: Mapping[str, float]) -> None:
        add(figure, label, *_times(s))

    for part in fig.get("create", {}).values():
        label = f"create, {part['threads']} thr"
        variants(label, part)
        add(label, "raw floor ops/s", *_rate(part["floor_ops_s"]))
        ratio(label, "create / floor", part["create_vs_floor"])
        ratio(label, "create / naive", part["create_vs_naive"])
        table.add_section()
    if "refusal" in fig:
        part = fig["refusal"]
        variants("refusal", part)
        ratio("refusal", "refusal / evalsha", part["refusal_vs_evalsha"])
        add("refusal", "SQL statements", f"{part['sql_statements']}",
            f"in {part['refusals']:,} refusals")  # fmt: skip
        table.add_section()
    if "mark_paid" in fig:
        part = fig["mark_paid"]
        variants("mark_paid", part)
        ratio("mark_paid", "mark_paid / raw update", part["mark_paid_vs_raw_update"])
        table.add_section()
    if "sweep" in fig:
        part = fig["sweep"]
        for label in ("table_1x", "table_10x", "table_1x_again"):
            again = " (again)" if label.endswith("again") else ""
            for b in part["batch_sizes"]:
                add(f"sweep, {part[label]['rows']:,} rows{again}", f"batch {b} closes/s",
                    *_rate(part[label][f"batch_{b}"]["closes_s"]))  # fmt: skip
        add("sweep", f"10x table cost (batch {part['best_batch']})", f"{part['cost_10x']:.2f} x")
        add("sweep", "1x again / 1x (drift)", f"{part['drift_1x']:.2f} x")
        table.add_section()
    if "close_lag" in fig:
        part = fig["close_lag"]
        measure = f"{part['closed']:,} of {part['orders']:,} at {part['rate_s']:g}/s, ms"
        add("close lag", measure, f"max {part['max_ms']:.0f}", "", f"{part['p50_ms']:.0f}",
            f"{part['p99_ms']:.0f}")  # fmt: skip
        table.add_section()
    if "redis_memory" in fig:
        part = fig["redis_memory"]
        for k in (1, 3):
            s = part[f"per_user_{k}"]["bytes_per_order"]
            add(f"redis memory, {k}/user", f"bytes per open order ({part['users']:,} users)",
                f"{s['median']:.0f}", f"{s['min']:.0f} - {s['max']:.0f}")  # fmt: skip
        table.add_section()
    if "sql_admission" in fig:
        part = fig["sql_admission"]
        variants("sql admission", part)
        ratio("sql admission", "refusal: redis / sql", part["refusal_redis_vs_sql"])
        ratio("sql admission", "admission: create / sql", part["admission_create_vs_sql"])
    return table


def targets_table(report: Mapping[str, Any]) -> Table:
    table = Table("target", "measured", "required", "ratio", "verdict", title="targets")
    for t in report["targets"]:
        colour = "green" if t["verdict"] == "ok" else "red"
        ratio = "" if t["ratio"] is None else f"{t['ratio']:.2f}"
        note = f" ({t['note']})" if t["note"] else ""
        table.add_row(
            t["name"],
            f"{t['measured']:,.1f}",
            t["required"],
            ratio,
            f"[{colour}]{t['verdict']}[/{colour}]{note}",
        )
    return table


def _database_holds_orders(service_settings: Any) -> bool:
    """Whether the configured database holds any order (a missing schema holds none)."""
    from orders.bootstrap import build_engine  # noqa: PLC0415

    engine = build_engine(service_settings)
    try:
        with sql_errors(), engine.connect() as conn:
            return conn.scalar(select(OC.id).limit(1)) is not None
    except OrdersError:
        return False
    finally:
        engine.dispose()


def _parse_figures(only: str | None) -> list[str]:
    if not only:
        return list(FIGURES)
    chosen = [name.strip() for name in only.split(",") if name.strip()]
    if not chosen or any(name not in FIGURES for name in chosen):
        # The message names the choices, never the value given (it may be anything).
        raise click.UsageError(f"--only takes figures from: {', '.join(FIGURES)}")
    return [name for name in FIGURES if name in chosen]


def _parse_batches(text: str) -> tuple[int, ...]:
    problem = "--batch-sizes takes comma-separated integers from 1 to 10000"
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.UsageError(problem) from None
    if not sizes or any(not 1 <= b <= 10_000 for b in sizes):
        raise click.UsageError(problem)
    return sizes


@click.command("bench")
@click.option("--quick", is_flag=True, help="Small sizes: a smoke test in well under a minute.")
@click.option(
    "--yes",
    is_flag=True,
    help="Run even on a database holding orders (the bench touches only its own).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Threads of the multi-threaded create figure.",
)
@click.option("--reps", type=click.IntRange(1, 100), help="Repetitions. [default: 5; quick 3]")
@click.option(
    "--ops",
    type=click.IntRange(10, 1_000_000),
    help="Operations per variant and repetition. [default: 1000; quick 150]",
)
@click.option(
    "--sweep-rows",
    type=click.IntRange(1, 10_000_000),
    help="Unpaid orders in the sweep's table (x10 for the large one). [default: 50000; quick 5000]",
)
@click.option(
    "--sweep-due",
    type=click.IntRange(1, 1_000_000),
    help="How many of them are due. [default: 10000; quick 1000]",
)
@click.option(
    "--batch-sizes", default="100,500,2000", show_default=True, help="Sweep batch sizes to compare."
)
@click.option(
    "--lag-rate",
    type=click.FloatRange(1, 100_000, min_open=False),
    help="Expiries per second of the close-lag figure. [default: 1000; quick 200]",
)
@click.option(
    "--lag-seconds",
    type=click.FloatRange(0.1, 3600),
    help="How long they keep expiring. [default: 10; quick 2]",
)
@click.option(
    "--memory-users",
    type=click.IntRange(1, 10_000_000),
    help="Users of the Redis memory figure. [default: 10000; quick 1000]",
)
@click.option("--only", help=f"Comma-separated figures to run, of: {', '.join(FIGURES)}.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.pass_context
def bench(
    ctx: click.Context,
    quick: bool,
    yes: bool,
    threads: int,
    reps: int | None,
    ops: int | None,
    sweep_rows: int | None,
    sweep_due: int | None,
    batch_sizes: str,
    lag_rate: float | None,
    lag_seconds: float | None,
    memory_users: int | None,
    only: str | None,
    as_json: bool,
) -> None:
    """Measure the service on the configured stores against raw floors and the naive way.

    The bench adds users bench-<random>-..., their orders and Redis keys, and removes them
    all at the end. It refuses a database that already holds orders unless --yes.
    """
    from orders.cli.app import cli_state  # noqa: PLC0415

    figures = _parse_figures(only)
    base = Sizes.quick() if quick else Sizes()
    sizes = replace(
        base,
        threads=threads,
        batch_sizes=_parse_batches(batch_sizes),
        reps=base.reps if reps is None else reps,
        ops=base.ops if ops is None else ops,
        sweep_rows=base.sweep_rows if sweep_rows is None else sweep_rows,
        sweep_due=base.sweep_due if sweep_due is None else sweep_due,
        lag_rate=base.lag_rate if lag_rate is None else lag_rate,
        lag_seconds=base.lag_seconds if lag_seconds is None else lag_seconds,
        memory_users=base.memory_users if memory_users is None else memory_users,
    )
    sizes = replace(sizes, warmup=min(sizes.warmup, sizes.ops))
    state = cli_state(ctx)
    if not yes and _database_holds_orders(state.settings):
        click.echo(
            "error: the database already holds orders; the bench adds and removes only its "
            "own, pass --yes to run it there anyway",
            err=True,
        )
        ctx.exit(2)
    service = state.service()
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    with progress:
        total = sum(_units(sizes, name) for name in figures)
        task = progress.add_task("starting", total=total)
        report = run_bench(
            service,
            sizes,
            figures,
            step=lambda units: progress.advance(task, units),
            status=lambda text: progress.update(task, description=text),
        )
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    console.print(results_table(report))
    console.print(targets_table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")
    left = report["left_behind"]
    if any(left.values()):
        console.print(f"[red]left behind[/red]: {left}")
