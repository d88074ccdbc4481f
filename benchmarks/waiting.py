"""The ``waiting`` figure (issue 44): from an order's deadline to the waiting user's new
order, while orders expire at ``--lag-rate`` per second for ``--lag-seconds``.

Two variants, each ``n = rate x seconds`` units, each unit held by an unpaid order of its
own whose expiries are ``1 / rate`` apart, and one waiting entry (``service.wait_for``,
quantity 1, a user of its own) per unit:

* ``counted``: ``n`` counted resources of capacity 1 (entries spread over many
  resources, so over the serving threads);
* ``named``: one named resource of ``n`` seats (every entry in one queue, walked by one
  serving thread).

The setup is untimed: the service's clock stands still a minute before the run's start
(``SWEEP_NOW_MS``, 2001) while the resources, the holding orders (``expires_at`` each) and
the entries are made through the service, on ``SETUP_THREADS`` threads. Then the clock runs
at real speed from ``SWEEP_NOW_MS`` and the real scheduler sweeps: the ``orders
scheduler`` process's :class:`~orders.scheduler.sweeper.Sweeper` in its APScheduler jobs
(:func:`~orders.scheduler.jobs.build_scheduler`), in this process as the close-lag figure
runs it. In process, not the ``orders scheduler`` command: the process cannot be given the
shifted clock that keeps every foreign order out of the bench's sweeps; the jobs, the
ticks (each asks for the next run at the earliest open expiry), the batches and the
serving threads are the same code. The sweep closes each batch, hands the resources it
released to ``service.serving`` and goes on; the serving threads create each entry's
order (``waiting-<entry id>``).

Measured, for each entry served: its order's ``created_at_ms`` minus the ``expires_at_ms``
of the order that held the unit it got (the resource, for counted; the seat, for named);
beside it the close lag (``closed_at_ms - expires_at_ms``) of the holding orders in the
same run, and the entries served per second. Checked: every entry served, exactly once
(one order and one ``created`` event by the waiting list per entry).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, delete, event, func, select

from benchmarks.measure import chunks, percentile, quiet
from benchmarks.verdicts import check
from benchmarks.workload import FOREIGN_MARGIN_MS, OC, SWEEP_NOW_MS, Workload
from orders.bootstrap import build_engine
from orders.domain import ActorKind, EventKind, OrderStatus
from orders.rules.serving import WORKERS
from orders.rules.waiting import order_id_for
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.failures import sql_errors
from orders.sql.inventory_tables import holds_table, resources_table, units_table, waiting_table
from orders.sql.models import events_table

VARIANTS = ("counted", "named")
#: Threads making the (untimed) setup through the service.
SETUP_THREADS = 4
#: From the clock's start to the first expiry: the scheduler's start.
LEAD_MS = 1500
#: How long past the last expiry the run waits for the last entries.
GRACE_S = 60.0
#: The issue's goal: within the close lag, "a few milliseconds" (the close lag's target).
GOAL_P99_MS = 10.0


class BenchClock:
    """Stands still for the setup, then runs at real speed from a given instant."""

    def __init__(self, at_ms: int) -> None:
        self.still_ms: int | None = at_ms
        self.shift_ms = 0

    def run_from(self, start_ms: int) -> None:
        self.shift_ms = int(time.time() * 1000) - start_ms
        self.still_ms = None

    def __call__(self) -> int:
        if self.still_ms is not None:
            return self.still_ms
        return int(time.time() * 1000) - self.shift_ms


@dataclass
class Plan:
    """What the setup made: the resources, the holding orders with their expiries, and the
    entries; ``unit_expiry`` maps (resource, seat or "") to the deadline that frees it."""

    resources: list[str]
    holders: list[str] = field(default_factory=list)
    unit_expiry: dict[tuple[str, str], int] = field(default_factory=dict)
    entries: list[int] = field(default_factory=list)


def _in_threads(work: Callable[[int], object], n: int) -> list[Any]:
    with ThreadPoolExecutor(SETUP_THREADS, thread_name_prefix="bench-setup") as pool:
        return list(pool.map(work, range(n)))


def _aware(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


def set_up(w: Workload, service: OrderService, variant: str, expiries: Sequence[int]) -> Plan:
    """Resources, one holding order per unit (expiring at ``expiries``), one entry per unit."""
    n = len(expiries)
    holders, waiters = w.users("wh", n), w.users("ww", n)
    if variant == "counted":
        plan = Plan([f"{w.tag}wr{i}" for i in range(n)])
        _in_threads(lambda i: service.set_capacity(plan.resources[i], 1), n)
        wants: list[tuple[str, str]] = [(rid, "") for rid in plan.resources]
    else:
        seats = [f"S{i:06d}" for i in range(n)]
        plan = Plan([f"{w.tag}wn"])
        service.set_units(plan.resources[0], seats)
        wants = [(plan.resources[0], seat) for seat in seats]

    def hold(i: int) -> str:
        rid, seat = wants[i]
        holds: dict[str, int | list[str]] = {rid: [seat] if seat else 1}
        order = service.create_unpaid_order(holders[i], holds=holds, expires_at=_aware(expiries[i]))
        return order.id

    plan.holders = _in_threads(hold, n)
    plan.unit_expiry = dict(zip(wants, expiries, strict=True))
    plan.entries = _in_threads(lambda i: service.wait_for(waiters[i], wants[i][0]).id, n)
    return plan


def _wait_all_served(w: Workload, plan: Plan, clock: BenchClock, last_ms: int) -> None:
    waiting = (
        select(func.count()).select_from(waiting_table).where(waiting_table.c.status == "waiting")
    )
    deadline = time.monotonic() + (last_ms - clock()) / 1000 + GRACE_S
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if clock() <= last_ms:
            continue
        with sql_errors(), w.engine.connect() as conn:
            if not any(conn.scalar(waiting.where(waiting_table.c.id.in_(part))) for part in
                       chunks(plan.entries, 1000)):  # fmt: skip
                return


def setup_engine(w: Workload) -> Engine:
    """The setup's engine: on PostgreSQL one whose connections never prepare statements.

    ``wait_for``'s INSERT ... ON CONFLICT names its partial unique index by a predicate
    with a bound value (``orders/sql/waiting.py``); once psycopg prepares the statement
    (its 5th run on a connection) and PostgreSQL plans it generically, the index is no
    longer inferred and the INSERT fails ("no unique or exclusion constraint matching the
    ON CONFLICT specification"). Unprepared, each run is planned with its values. The run
    itself uses the bench's own engine, untouched (serving never runs that statement).
    """
    if w.engine.dialect.name != "postgresql":
        return w.engine
    url = w.engine.url.render_as_string(hide_password=False)
    made = build_engine(w.service.settings, url)

    def unprepared(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.prepare_threshold = None

    event.listen(made, "connect", unprepared)
    return made


def run_variant(w: Workload, variant: str) -> dict[str, Any]:
    sz = w.sizes
    n = max(1, round(sz.lag_rate * sz.lag_seconds))
    gap_ms = 1000 / sz.lag_rate
    clock = BenchClock(SWEEP_NOW_MS - 60_000)
    settings = replace(w.service.settings, key_prefix=w.key_tag + f"wait-{variant}-")
    expiries = [SWEEP_NOW_MS + LEAD_MS + round(i * gap_ms) for i in range(n)]
    w.status(f"waiting, {variant}: setting up {n:,} units, holders and entries")
    engine = setup_engine(w)
    setup = OrderService(engine, w.client, settings, clock=clock)
    try:
        plan = set_up(w, setup, variant, expiries)
    finally:
        setup.serving.close()
        setup.sweep.close()
        setup.payments.close()
        if engine is not w.engine:
            engine.dispose()
    service = OrderService(w.engine, w.client, settings, clock=clock)
    sweeper = Sweeper(service, reconcile_at_start=False)
    service.index.epoch.set("orders-bench")  # as the close-lag figure: no startup rebuild
    scheduler = build_scheduler(sweeper, blocking=False)
    w.status(f"waiting, {variant}: {n:,} expiries at {sz.lag_rate:g}/s")
    clock.run_from(SWEEP_NOW_MS)
    try:
        with quiet("orders.sweeper"), quiet("apscheduler"), quiet("orders.service"):
            scheduler.start()
            try:
                _wait_all_served(w, plan, clock, expiries[-1])
            finally:
                scheduler.shutdown(wait=True)
                sweeper.close()
                drained = service.serving.drain(30)
        return {**measure(w, plan, variant), "drained": drained,
                "batch_size": sweeper.batch_size}  # fmt: skip
    finally:
        service.serving.close()
        service.sweep.close()
        service.payments.close()
        remove(w, plan)


def _rows(w: Workload, query: Any, ids: Sequence[Any], column: Any) -> list[Any]:
    out: list[Any] = []
    with sql_errors(), w.engine.connect() as conn:
        for part in chunks(list(ids), 1000):
            out.extend(conn.execute(query.where(column.in_(part))).all())
    return out


def measure(w: Workload, plan: Plan, variant: str) -> dict[str, Any]:
    """Latencies, close lags, the served rate, and the exactly-once counts."""
    closes = _rows(w, select(OC.expires_at_ms, OC.closed_at_ms, OC.status), plan.holders, OC.id)
    lags = [int(c - e) for e, c, s in closes if s == OrderStatus.CLOSED.value and c is not None]
    entries = _rows(w, select(waiting_table.c.id, waiting_table.c.status, waiting_table.c.order_id),
                    plan.entries, waiting_table.c.id)  # fmt: skip
    served = [(eid, oid) for eid, status, oid in entries if status == "served"]
    wanted = [order_id_for(eid) for eid in plan.entries]
    made = dict(_rows(w, select(OC.id, OC.created_at_ms), wanted, OC.id))
    events = _rows(
        w,
        select(events_table.c.order_id).where(
            events_table.c.kind == EventKind.CREATED.value,
            events_table.c.actor_kind == ActorKind.WAITING_LIST.value,
        ),
        wanted,
        events_table.c.order_id,
    )
    if variant == "counted":
        got = _rows(w, select(holds_table.c.order_id, holds_table.c.resource_id), wanted,
                    holds_table.c.order_id)  # fmt: skip
        unit_of = {oid: (rid, "") for oid, rid in got}
    else:
        got = _rows(w, select(units_table.c.order_id, units_table.c.resource_id,
                              units_table.c.name), wanted, units_table.c.order_id)  # fmt: skip
        unit_of = {oid: (rid, name) for oid, rid, name in got}
    latencies = [
        int(made[oid]) - plan.unit_expiry[unit_of[oid]]
        for _, oid in served
        if oid in made and oid in unit_of
    ]
    first = min(plan.unit_expiry.values())
    window_ms = max((int(made[oid]) for _, oid in served if oid in made), default=first) - first
    return {
        "resources": len(plan.resources),
        "units": len(plan.unit_expiry),
        "entries": len(plan.entries),
        "served": len(served),
        "served_right_order": sum(oid == order_id_for(eid) for eid, oid in served),
        "orders_made": len(made),
        "created_events": len(events),
        "distinct_units": len(set(unit_of.values())),
        "latency_ms": _percentiles(latencies),
        "closed": len(lags),
        "close_lag_ms": _percentiles(lags),
        "window_s": round(window_ms / 1000, 3),
        "served_per_s": round(len(served) * 1000 / max(1, window_ms), 1),
    }


def _percentiles(values: Sequence[int]) -> dict[str, float]:
    return {
        "p50": percentile(list(values), 50),
        "p99": percentile(list(values), 99),
        "max": float(max(values, default=0)),
    }


def remove(w: Workload, plan: Plan) -> None:
    """The bench's orders (holds and events go by the cascade), then the entries, seats
    and resources it made; its keys go with the bench's cleanup (under its key tag)."""
    w.cleanup()
    with sql_errors(), w.engine.begin() as conn:
        for part in chunks(plan.resources, 500):
            chosen = list(part)
            conn.execute(delete(waiting_table).where(waiting_table.c.resource_id.in_(chosen)))
            conn.execute(delete(units_table).where(units_table.c.resource_id.in_(chosen)))
            conn.execute(delete(holds_table).where(holds_table.c.resource_id.in_(chosen)))
            conn.execute(delete(resources_table).where(resources_table.c.id.in_(chosen)))


def waiting(w: Workload) -> dict[str, Any] | None:
    sz = w.sizes
    last_ms = SWEEP_NOW_MS + LEAD_MS + round(sz.lag_seconds * 1000) + 60_000
    if w.foreign_unpaid_due(last_ms + FOREIGN_MARGIN_MS):
        w.notes.append("waiting skipped: the database holds other users' orders due in 2001")
        return None
    out: dict[str, Any] = {
        "rate_s": sz.lag_rate,
        "seconds": sz.lag_seconds,
        "sweeper": "orders.scheduler Sweeper in build_scheduler (APScheduler), in process",
        "serving_threads": WORKERS,
        "kinds": {},
    }
    for variant in VARIANTS:
        part = run_variant(w, variant)
        out["kinds"][variant] = part
        if part["served"] != part["entries"]:
            w.notes.append(f"waiting, {variant}: {part['served']:,} of {part['entries']:,} served")
        w.step(5)
    return out


def progress_units() -> int:
    return 5 * len(VARIANTS)


def targets(fig: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every entry served exactly once, and the p99 from deadline to new order within the
    issue's goal (beside the close lag of the same run)."""
    out = []
    for name, part in fig["kinds"].items():
        once = min(part["served"], part["orders_made"], part["created_events"],
                   part["distinct_units"], part["served_right_order"])  # fmt: skip
        out.append(check(f"waiting_{name}_served_once", f"waiting ({name}): served exactly once",
                         once, "==", part["entries"], "entries"))  # fmt: skip
        lag = part["close_lag_ms"]["p99"]
        out.append(check(f"waiting_{name}_p99_ms",
                         f"waiting ({name}): deadline to new order p99 at {fig['rate_s']:g}/s",
                         part["latency_ms"]["p99"], "<=", GOAL_P99_MS, "ms",
                         f"close lag p99 {lag:,.0f} ms"))  # fmt: skip
    return out


def section(rows: Any, fig: Mapping[str, Any]) -> None:
    """The results table's rows (``benchmarks.tables``)."""
    for name, part in fig["kinds"].items():
        label = f"waiting, {name}"
        lat, lag = part["latency_ms"], part["close_lag_ms"]
        rows.add(label, f"deadline to new order, {part['served']:,} of {part['entries']:,}, ms",
                 f"max {lat['max']:.0f}", "", f"{lat['p50']:.0f}", f"{lat['p99']:.0f}")  # fmt: skip
        rows.add(label, f"close lag, {part['closed']:,} closed, ms", f"max {lag['max']:.0f}",
                 "", f"{lag['p50']:.0f}", f"{lag['p99']:.0f}")  # fmt: skip
        rows.add(label, "entries served per s", f"{part['served_per_s']:,.0f}",
                 f"over {part['window_s']:.1f} s")  # fmt: skip
    rows.table.add_section()
