"""The throughput figures: a use case's operations timed side by side with its floors.

``create`` and ``refusal`` also run on the asyncio API (:mod:`benchmarks.concurrency`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Engine

from benchmarks import floors, variants
from benchmarks.concurrency import floors_threads, task_counts, thread_counts
from benchmarks.measure import Run, Variant, counted, describe, ratios, spread
from benchmarks.workload import Workload
from orders.domain import EventKind

#: The variants of the create figure, at each thread count.
CREATE_VARIANTS: dict[str, Callable[[Workload, int], Variant]] = {
    "create": variants.create,
    "floor": floors.floor,
    "floor_core": floors.floor_core,
    "naive": floors.naive,
}


def _tasks_part(
    w: Workload,
    tasks: int,
    threads: int,
    name: str,
    mine: list[Run],
    against: Mapping[str, list[Run]],
) -> dict[str, Any]:
    """``tasks_N``: an async variant at N tasks, and its ratio to each threaded variant of
    ``against`` (measured in the same repetitions, at ``threads`` threads)."""
    part: dict[str, Any] = {
        "tasks": tasks,
        "ops_per_rep": w.sizes.ops,
        "floors_threads": threads,
        "variants": {name: describe(mine)},
    }
    for other, theirs in against.items():
        part[f"{name}_vs_{other}"] = spread(ratios(mine, theirs))
    return part


def create(w: Workload) -> dict[str, Any]:
    counts = thread_counts(w.engine.dialect.name, w.sizes.threads)
    tasks = task_counts(w.sizes.tasks)
    # Every thread and task count in one measure: the scaling ratios are side by side too.
    chosen = {f"{name}@{t}": make(w, t) for t in counts for name, make in CREATE_VARIANTS.items()}
    chosen |= {f"create_async@{n}tasks": variants.create(w, tasks=n) for n in tasks}
    shown = f"create, {'/'.join(map(str, counts))} threads, {'/'.join(map(str, tasks))} tasks"
    runs = w.measure(shown, chosen)
    out: dict[str, Any] = {"thread_counts": list(counts)}
    for t in counts:
        mine = {name: runs[f"{name}@{t}"] for name in CREATE_VARIANTS}
        out[f"threads_{t}"] = {
            "threads": t,
            "ops_per_rep": w.sizes.ops,
            "variants": {name: describe(r) for name, r in mine.items()},
            "create_vs_floor": spread(ratios(mine["create"], mine["floor"])),
            "create_vs_floor_core": spread(ratios(mine["create"], mine["floor_core"])),
            "create_vs_naive": spread(ratios(mine["create"], mine["naive"])),
        }
    out["scaling"] = {
        f"threads_{t}_vs_1": {
            name: spread(ratios(runs[f"{name}@{t}"], runs[f"{name}@1"]))
            for name in ("create", "floor")
        }
        for t in counts
        if t > 1
    }
    out["task_counts"] = list(tasks)
    on_loop = {n: runs[f"create_async@{n}tasks"] for n in tasks}
    for n in tasks:
        t = floors_threads(counts, n)
        against = {name: runs[f"{name}@{t}"] for name in CREATE_VARIANTS}
        out[f"tasks_{n}"] = _tasks_part(w, n, t, "create_async", on_loop[n], against)
    out["task_scaling"] = {
        f"tasks_{n}_vs_1": {"create_async": spread(ratios(on_loop[n], on_loop[1]))}
        for n in tasks
        if n > 1
    }
    return out


def refusal(w: Workload) -> dict[str, Any]:
    tasks = task_counts(w.sizes.tasks)
    statements = {name: [0] for name in ("refusal", "refusal_given_id", *map(str, tasks))}
    on_loop = w.loop.service.engine  # the async service's statements: built_async_service
    if not isinstance(on_loop, Engine):  # gives it a synchronous engine, its threads' own
        raise TypeError("the bench's async service runs on a synchronous engine")
    chosen = {
        "refusal": counted(w.engine, variants.refusal(w), statements["refusal"]),
        "refusal_given_id": counted(
            w.engine, variants.refusal(w, given_id=True), statements["refusal_given_id"]
        ),
        "evalsha": floors.evalsha_refused(w),
    }
    chosen |= {
        f"refusal_async@{n}tasks": counted(
            on_loop, variants.refusal(w, tasks=n), statements[str(n)]
        )
        for n in tasks
    }
    runs = w.measure(f"refusal, 1 thread, {'/'.join(map(str, tasks))} tasks", chosen)
    threaded = ("refusal", "refusal_given_id", "evalsha")
    refusals = w.ops_per_variant
    out: dict[str, Any] = {
        "ops_per_rep": w.sizes.ops,
        "variants": {name: describe(runs[name]) for name in threaded},
        "refusals": refusals,
        "sql_statements": statements["refusal"][0],
        "sql_statements_given_id": statements["refusal_given_id"][0],
        "refusal_vs_evalsha": spread(ratios(runs["refusal"], runs["evalsha"])),
        "refusal_given_id_vs_evalsha": spread(ratios(runs["refusal_given_id"], runs["evalsha"])),
        "task_counts": list(tasks),
    }
    against = {name: runs[name] for name in ("refusal", "evalsha")}
    for n in tasks:
        mine = runs[f"refusal_async@{n}tasks"]
        out[f"tasks_{n}"] = _tasks_part(w, n, 1, "refusal_async", mine, against)
        out[f"tasks_{n}"].update(refusals=refusals, sql_statements=statements[str(n)][0])
    return out


def _transition(w: Workload, kind: EventKind, name: str) -> dict[str, Any]:
    runs = w.measure(
        name, {name: variants.transition(w, kind), "raw": floors.raw_transition(w, kind)}
    )
    return {
        "ops_per_rep": w.sizes.ops,
        "variants": {v: describe(r) for v, r in runs.items()},
        f"{name}_vs_raw": spread(ratios(runs[name], runs["raw"])),
    }


def mark_paid(w: Workload) -> dict[str, Any]:
    """The payment, its floor, and beside them (issue 27) a payment stating its amount and
    a refused one (a refund recorded)."""
    runs = w.measure(
        "mark_paid",
        {
            "mark_paid": variants.transition(w, EventKind.PAID),
            "raw": floors.raw_transition(w, EventKind.PAID),
            "stating_amount": variants.paid_stating_amount(w),
            "refused": variants.refused_payment(w),
        },
    )
    return {
        "ops_per_rep": w.sizes.ops,
        "variants": {v: describe(r) for v, r in runs.items()},
        "mark_paid_vs_raw": spread(ratios(runs["mark_paid"], runs["raw"])),
        "stating_amount_vs_mark_paid": spread(ratios(runs["stating_amount"], runs["mark_paid"])),
        "refused_vs_mark_paid": spread(ratios(runs["refused"], runs["mark_paid"])),
    }


def cancel(w: Workload) -> dict[str, Any]:
    return _transition(w, EventKind.CANCELLED, "cancel")


def sql_admission(w: Workload) -> dict[str, Any]:
    runs = w.measure(
        "sql admission",
        {
            "redis_refusal": variants.refusal(w),
            "sql_refusal": variants.sql_guard(w, refuse=True),
            "create": variants.create(w),
            "sql_admission": variants.sql_guard(w, refuse=False),
        },
    )
    return {
        "ops_per_rep": w.sizes.ops,
        "variants": {name: describe(r) for name, r in runs.items()},
        "refusal_redis_vs_sql": spread(ratios(runs["redis_refusal"], runs["sql_refusal"])),
        "admission_create_vs_sql": spread(ratios(runs["create"], runs["sql_admission"])),
    }
