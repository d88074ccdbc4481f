"""The ``holds`` figure (issue 43): what counted holds cost a create, a sold-out refusal
beside its raw EVALSHA, and one hot SKU under 64 concurrent callers.

Two interleaved measures, each variant on resources of its own made fresh for each run
(``set_capacity``, then the index built from SQL, untimed):

* 1 thread: ``refusal`` (a create whose one hold names a resource of capacity 0, refused by
  the Redis index: ``HoldRefused`` with ``source == "redis"``, its SQL statements counted)
  beside ``evalsha`` (the lab's raw EVALSHA of the admission script that refuses, the floor
  of the limit's refusal); ``create`` (no holds) beside ``create_1_hold`` and
  ``create_10_holds`` (a ten-resource cart, one unit each, capacities 10^9) and
  ``create_1_hold_crowded`` (one hold of a resource that already has ``10 x ops`` held
  units, one per open order: the SQL guard sums them under the resource's lock); and
  ``commit``, the raw driver's smallest durable transaction (an UPDATE of one resource row,
  then COMMIT): 1 / its rate is the commit time that bounds one resource's holds.
* 64 threads: ``create`` beside ``create_hot_sku`` (every create holds 1 unit of the same
  resource, capacity 10^9) and ``raw_hot_sku``, the raw driver doing what such a create
  writes (the order, its event, the resource row locked, the hold row, one COMMIT).

The resource row is locked from the hold until the commit, so the holds of one resource
take turns: one resource's holds per second stay under the ``commit`` rate, whatever the
callers. ``hot_sku_vs_commit`` says how near they come.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Mapping
from typing import Any

from sqlalchemy import delete, insert

from benchmarks import floors, variants
from benchmarks.driver import RawDriver
from benchmarks.measure import (
    Run,
    Variant,
    counting_statements,
    describe,
    ratios,
    run_ops,
    spread,
)
from benchmarks.verdicts import check
from benchmarks.workload import Workload
from orders.domain import OrderStatus
from orders.errors import HoldRefused
from orders.sql.failures import sql_errors
from orders.sql.inventory_tables import HOLD_HELD, holds_table, resources_table

#: A capacity no run sells out.
LARGE = 10**9
#: The resources of the cart figure.
CART = 10
#: Concurrent callers of the hot SKU.
HOT_CALLERS = 64
#: Held units already on the crowded resource, per operation of a run.
CROWD_PER_OP = 10
#: Issue 43's bounds.
BOUNDS = {"refusal_vs_evalsha": 0.9, "create_1_hold_cost": 1.15, "create_10_holds_cost": 2.0}

_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


class Resources:
    """The bench's resources (ids under its tag), made known to the index, and removed."""

    def __init__(self, w: Workload) -> None:
        self.w = w
        self.made: list[str] = []

    def make(self, n: int, capacity: int = LARGE) -> list[str]:
        """``n`` new resources of ``capacity``, each built in the index from SQL (as the
        first create holding it would), so that no timed create pays a rebuild."""
        service = self.w.service
        start = len(self.made)
        ids = [f"{self.w.tag}r{start + i}" for i in range(n)]
        self.made += ids
        for resource_id in ids:
            service.set_capacity(resource_id, capacity)
            service.holding.rebuild(resource_id, service.clock())
        return ids

    def crowd(self, resource_id: str, n: int) -> None:
        """``n`` open orders holding 1 unit of the resource each, inserted directly, then the
        index rebuilt from SQL with them."""
        w = self.w
        now = w.service.clock()
        ids, users = w.bulk_ids(n), w.users("hc", n)
        w.insert_rows([w.row(o, u, now, now + w.ttl_ms) for o, u in zip(ids, users, strict=True)])
        rows = [
            {"order_id": o, "resource_id": resource_id, "user_id": u, "quantity": 1,
             "status": HOLD_HELD}
            for o, u in zip(ids, users, strict=True)
        ]  # fmt: skip
        with sql_errors(), w.engine.begin() as conn:
            conn.execute(insert(holds_table), rows)
        w.service.holding.rebuild(resource_id, w.service.clock())

    def remove(self) -> None:
        """Delete the bench's orders (their holds go with them), then its resources' rows
        and keys."""
        self.w.cleanup()
        made, self.made = self.made, []
        with sql_errors(), self.w.engine.begin() as conn:
            for part in range(0, len(made), 500):
                chosen = made[part : part + 500]
                conn.execute(delete(holds_table).where(holds_table.c.resource_id.in_(chosen)))
                conn.execute(delete(resources_table).where(resources_table.c.id.in_(chosen)))
        for resource_id in made:
            self.w.service.resource_index.forget(resource_id)


# --- variants --------------------------------------------------------------------------


def refused(w: Workload, resources: Resources, statements: list[int]) -> Variant:
    """A create holding 1 unit of a sold-out resource: refused by the index, with no SQL
    (the statements of the timed calls are added to ``statements[0]``)."""
    service = w.service

    def variant(n: int) -> Run:
        (sold_out,) = resources.make(1, capacity=0)
        users = w.users("hr", n)

        def op(i: int) -> None:
            try:
                service.create_unpaid_order(users[i], holds={sold_out: 1})
            except HoldRefused as refusal:
                if refusal.source != "redis":
                    raise RuntimeError("a sold-out hold was refused by SQL, not Redis") from None
                return
            raise RuntimeError("a hold of a sold-out resource was taken")

        with counting_statements(w.engine) as sent:
            run = run_ops(op, n)
        statements[0] += sent[0]
        return run

    return variant


def holding(
    w: Workload,
    resources: Resources,
    count: int,
    threads: int = 1,
    *,
    crowd: int = 0,
) -> Variant:
    """``create_unpaid_order`` of a new user per op holding 1 unit of each of ``count``
    fresh resources (the same ones for every op of a run), on ``threads`` threads; with
    ``crowd``, the one resource already has that many units held."""
    service = w.service

    def variant(n: int) -> Run:
        ids = resources.make(count)
        if crowd:
            resources.crowd(ids[0], crowd)
        users = w.users("hh", n)
        holds = dict.fromkeys(ids, 1)
        return run_ops(lambda i: service.create_unpaid_order(users[i], holds=holds), n, threads)

    return variant


class RawHold:
    """The raw driver's statements of a hold (:class:`benchmarks.driver.RawDriver`'s held
    connections and, on SQLite, its writer queue)."""

    def __init__(self, w: Workload, threads: int) -> None:
        self.driver = RawDriver(w.engine, w.connections(threads))
        style = getattr(w.engine.dialect.dbapi, "paramstyle", None)
        mark = _PLACEHOLDERS[str(style)]
        lock = " FOR UPDATE" if w.engine.dialect.name == "postgresql" else ""
        res, holds = resources_table.name, holds_table.name
        # S608: the text is built from the schema's own constants, never from input.
        self.lock = f"SELECT capacity, sold FROM {res} WHERE id = {mark}{lock}"  # noqa: S608
        self.insert_hold = (
            f"INSERT INTO {holds} (order_id, resource_id, user_id, quantity, status) "  # noqa: S608
            f"VALUES ({', '.join([mark] * 5)})"
        )
        self.touch = f"UPDATE {res} SET updated_at_ms = {mark} WHERE id = {mark}"  # noqa: S608

    def hold(self, order_id: str, user_id: str, resource_id: str, now_ms: int, ttl_ms: int) -> None:
        """The order and its event, the resource row locked, the hold row; one COMMIT."""
        d = self.driver
        with d.connection() as conn, d.writer, contextlib.closing(conn.cursor()) as cursor:
            cursor.execute(
                d.insert_order,
                (order_id, user_id, OrderStatus.UNPAID.value, now_ms, now_ms + ttl_ms, now_ms),
            )
            cursor.execute(d.insert_event, (order_id, user_id, "created", now_ms))
            cursor.execute(self.lock, (resource_id,))
            cursor.fetchall()
            cursor.execute(self.insert_hold, (order_id, resource_id, user_id, 1, HOLD_HELD))
            conn.commit()

    def commit(self, resource_id: str, value: int) -> None:
        """The smallest durable write: one row updated to ``value``, COMMIT (give a new value
        each time: SQLite writes nothing, and syncs nothing, for a row left as it was)."""
        d = self.driver
        with d.connection() as conn, d.writer, contextlib.closing(conn.cursor()) as cursor:
            cursor.execute(self.touch, (value, resource_id))
            conn.commit()


def raw_hot_sku(w: Workload, resources: Resources, threads: int) -> Variant:
    clock = w.service.clock

    def variant(n: int) -> Run:
        (hot,) = resources.make(1)
        raw, users, ids = RawHold(w, threads), w.users("hw", n), w.order_ids(n)
        try:
            return run_ops(lambda i: raw.hold(ids[i], users[i], hot, clock(), w.ttl_ms), n, threads)
        finally:
            raw.driver.release()

    return variant


def raw_commit(w: Workload, resources: Resources) -> Variant:
    def variant(n: int) -> Run:
        (resource_id,) = resources.make(1)
        raw = RawHold(w, 1)
        try:
            return run_ops(lambda i: raw.commit(resource_id, i), n)
        finally:
            raw.driver.release()

    return variant


# --- the figure --------------------------------------------------------------------------


def holds(w: Workload) -> dict[str, Any]:
    resources = Resources(w)
    statements = [0]
    one: dict[str, Variant] = {
        "refusal": refused(w, resources, statements),
        "evalsha": floors.evalsha_refused(w),
        "create": variants.create(w),
        "create_1_hold": holding(w, resources, 1),
        "create_10_holds": holding(w, resources, CART),
        "create_1_hold_crowded": holding(w, resources, 1, crowd=CROWD_PER_OP * w.sizes.ops),
        "commit": raw_commit(w, resources),
    }
    many: dict[str, Variant] = {
        "create": variants.create(w, HOT_CALLERS),
        "create_hot_sku": holding(w, resources, 1, HOT_CALLERS),
        "raw_hot_sku": raw_hot_sku(w, resources, HOT_CALLERS),
    }
    try:
        runs_1 = w.measure("holds, 1 thread", one)
        resources.remove()
        runs_64 = w.measure(f"holds, one hot SKU, {HOT_CALLERS} threads", many)
    finally:
        resources.remove()
    return summary(w, runs_1, runs_64, statements[0])


def summary(
    w: Workload, one: Mapping[str, list[Run]], many: Mapping[str, list[Run]], statements: int
) -> dict[str, Any]:
    commit_ms = [1000 / run.ops_s for run in one["commit"]]
    hot = many["create_hot_sku"]
    return {
        "resource_capacity": LARGE,
        "cart": CART,
        "crowd": CROWD_PER_OP * w.sizes.ops,
        "thread_counts": [1, HOT_CALLERS],
        "threads_1": {
            "threads": 1,
            "ops_per_rep": w.sizes.ops,
            "variants": {name: describe(runs) for name, runs in one.items()},
            "refusals": w.ops_per_variant,
            "sql_statements": statements,
            "refusal_vs_evalsha": spread(ratios(one["refusal"], one["evalsha"])),
            # A cost: how many times the time of a create without holds (ops/s inverted).
            "create_1_hold_cost": spread(ratios(one["create"], one["create_1_hold"])),
            "create_10_holds_cost": spread(ratios(one["create"], one["create_10_holds"])),
            "create_1_hold_crowded_cost": spread(
                ratios(one["create"], one["create_1_hold_crowded"])
            ),
        },
        f"threads_{HOT_CALLERS}": {
            "threads": HOT_CALLERS,
            "ops_per_rep": w.sizes.ops,
            "variants": {name: describe(runs) for name, runs in many.items()},
            "hot_sku_vs_create": spread(ratios(hot, many["create"])),
            "hot_sku_vs_raw_hot_sku": spread(ratios(hot, many["raw_hot_sku"])),
            "hot_sku_vs_commit": spread(ratios(hot, one["commit"])),
        },
        "commit_ms": statistics.median(commit_ms),
    }


def progress_units(reps: int) -> int:
    return 10 * (1 + reps)


def targets(fig: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Issue 43's bounds: the refusal beside its EVALSHA, what one hold and a cart cost."""
    one = fig["threads_1"]
    return [
        check("holds_refusal_sql_statements", "sold-out refusal's SQL statements",
              one["sql_statements"], "==", 0, "statements", f"in {one['refusals']:,} refusals"),
        check("holds_refusal_vs_evalsha", "sold-out refusal / raw EVALSHA",
              one["refusal_vs_evalsha"]["median"], ">=", BOUNDS["refusal_vs_evalsha"], "x"),
        check("holds_create_1_hold_cost", "create with 1 hold, cost",
              one["create_1_hold_cost"]["median"], "<=", BOUNDS["create_1_hold_cost"], "x"),
        check("holds_create_10_holds_cost", "create with a 10-resource cart, cost",
              one["create_10_holds_cost"]["median"], "<=", BOUNDS["create_10_holds_cost"], "x"),
    ]  # fmt: skip


def section(rows: Any, fig: Mapping[str, Any]) -> None:
    """The results table's rows (``benchmarks.tables``)."""
    for n in fig["thread_counts"]:
        part, label = fig[f"threads_{n}"], f"holds, {n} thr"
        rows.variants(label, part)
        for key, s in part.items():
            if key.endswith("_cost") or "_vs_" in key:
                rows.ratio(label, key.replace("_vs_", " / ").replace("_", " "), s)
        if "sql_statements" in part:
            rows.add(label, "refusal: SQL statements", f"{part['sql_statements']:,}",
                     f"in {part['refusals']:,} refusals")  # fmt: skip
        rows.table.add_section()
    rows.add("holds", "commit time (raw, 1 thread), ms", f"{fig['commit_ms']:.2f}")
    rows.table.add_section()
