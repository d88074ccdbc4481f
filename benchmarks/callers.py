"""The callers figure: create, mark_paid and refusal at 1, 8 and 64 concurrent callers.

Each use case runs as that many threads on the synchronous service and as that many tasks
gathered on the asyncio API's one event loop, beside its floor on the same number of
threads: the raw floor of a create (one EVALSHA, then the raw driver writing the order and
its event in one commit), the raw ``UPDATE`` plus event of a payment, the raw EVALSHA that
refuses. Every variant of every count takes its turn in one interleaved measure, so the
ratios at 64 callers and at 1 are taken on the same machine in the same minutes. The
1-thread create also runs beside the naive create (ZCARD, ZADD, INSERT). The service
combines concurrent creates by default (``Settings.combine_creates``) and, on SQLite,
concurrent payments (``Settings.combine_transitions``); so at every count the creates also
run by a service that combines nothing (``create_single``), and on SQLite the payments too
(``mark_paid_single``): combining is to measure no worse than the single path at 1 and 8
callers and better at 64 (issue 45).

A floor on N threads holds at most as many connections as the service's pool may open
(``Workload.connections``): 64 threads share them, as the service's 64 callers share its
pool. A ``tasks_N`` part is compared with the floors on N threads.

Its targets (:func:`targets`) are the ones the project holds a caller's cost to: a create
on 1 thread at least as fast as the naive one; a refusal at 0.9 of its EVALSHA; a payment
at 0.8 of the raw UPDATE; 64 concurrent creates at 3x the 1-thread floor on SQLite (where
the floor cannot share a commit) and 2x the 8-thread floor elsewhere, with a p99 of at
most 10 ms.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

from benchmarks import floors, variants
from benchmarks.measure import Run, Variant, describe, ratios, spread
from benchmarks.verdicts import check
from benchmarks.workload import Workload
from orders.domain import EventKind
from orders.rules.transition import combines_on

#: The concurrent callers of every use case: threads, and tasks on one event loop.
CALLERS = (1, 8, 64)

#: The thread counts the single-path service's creates also run at.
SINGLE = CALLERS

#: A use case's variant on ``threads`` threads, or on the asyncio API as ``tasks`` tasks.
UseCaseMaker = Callable[[Workload, int, int | None], Variant]

#: Each use case: its variant, its floor's name, and its floor on N threads.
USE_CASES: dict[str, tuple[UseCaseMaker, str, Callable[[Workload, int], Variant]]] = {
    "create": (lambda w, t, tasks: variants.create(w, t, tasks=tasks), "floor", floors.floor),
    "mark_paid": (
        lambda w, t, tasks: variants.transition(w, EventKind.PAID, t, tasks=tasks),
        "raw",
        lambda w, t: floors.raw_transition(w, EventKind.PAID, t),
    ),
    "refusal": (
        lambda w, t, tasks: variants.refusal(w, threads=t, tasks=tasks),
        "evalsha",
        floors.evalsha_refused,
    ),
}

#: Issue 30's bounds.
BOUNDS = {
    "create_vs_naive": 1.0,
    "refusal_vs_evalsha": 0.9,
    "mark_paid_vs_raw": 0.8,
    "p99_ms": 10.0,
}
#: 64 concurrent creates against the floor on how many threads, and how many times it.
CONCURRENT_BOUND = {"sqlite": (1, 3.0)}
CONCURRENT_BOUND_ELSEWHERE = (8, 2.0)


def _chosen(w: Workload) -> dict[str, Variant]:
    chosen: dict[str, Variant] = {}
    for n in CALLERS:
        for use, (make, floor_name, make_floor) in USE_CASES.items():
            chosen[f"{use}@{n}"] = make(w, n, None)
            chosen[f"{floor_name}@{n}"] = make_floor(w, n)
            chosen[f"{use}_async@{n}tasks"] = make(w, 1, n)
    chosen["naive@1"] = floors.naive(w)
    for n in SINGLE:
        chosen[f"create_single@{n}"] = variants.create(w, n, single=True)
        if combines_transitions(w):
            chosen[f"mark_paid_single@{n}"] = variants.transition(w, EventKind.PAID, n, single=True)
    return chosen


def combines_transitions(w: Workload) -> bool:
    """Whether the service shares transitions' transactions (SQLite, by default)."""
    return w.service.transitions.queue is not None


def _threads_part(w: Workload, n: int, runs: Mapping[str, list[Run]]) -> dict[str, Any]:
    part: dict[str, Any] = {"threads": n, "ops_per_rep": w.sizes.ops, "variants": {}}
    names = [name for use, (_m, floor_name, _f) in USE_CASES.items() for name in (use, floor_name)]
    names += ["naive"] if n == 1 else []
    names += ["create_single"] if n in SINGLE else []
    paid_single = n in SINGLE and combines_transitions(w)
    names += ["mark_paid_single"] if paid_single else []
    part["variants"] = {name: describe(runs[f"{name}@{n}"]) for name in names}
    for use, (_make, floor_name, _floor) in USE_CASES.items():
        part[f"{use}_vs_{floor_name}"] = spread(
            ratios(runs[f"{use}@{n}"], runs[f"{floor_name}@{n}"])
        )
    if n == 1:
        part["create_vs_naive"] = spread(ratios(runs["create@1"], runs["naive@1"]))
    if n in SINGLE:  # the default (combining) against the single path
        single = runs[f"create_single@{n}"]
        part["create_single_vs_floor"] = spread(ratios(single, runs[f"floor@{n}"]))
        part["create_vs_create_single"] = spread(ratios(runs[f"create@{n}"], single))
    if paid_single:
        single = runs[f"mark_paid_single@{n}"]
        part["mark_paid_single_vs_raw"] = spread(ratios(single, runs[f"raw@{n}"]))
        part["mark_paid_vs_mark_paid_single"] = spread(ratios(runs[f"mark_paid@{n}"], single))
    return part


def _tasks_part(w: Workload, n: int, runs: Mapping[str, list[Run]]) -> dict[str, Any]:
    part: dict[str, Any] = {
        "tasks": n,
        "ops_per_rep": w.sizes.ops,
        "floors_threads": n,
        "variants": {f"{use}_async": describe(runs[f"{use}_async@{n}tasks"]) for use in USE_CASES},
    }
    for use, (_make, floor_name, _floor) in USE_CASES.items():
        part[f"{use}_async_vs_{floor_name}"] = spread(
            ratios(runs[f"{use}_async@{n}tasks"], runs[f"{floor_name}@{n}"])
        )
    return part


def concurrent_against(engine: str) -> tuple[int, float]:
    """The floor's thread count the 64 concurrent creates are held against, and the bound."""
    return CONCURRENT_BOUND.get(engine, CONCURRENT_BOUND_ELSEWHERE)


def callers(w: Workload) -> dict[str, Any]:
    shown = f"callers: create, mark_paid, refusal at {'/'.join(map(str, CALLERS))}"
    runs = w.measure(shown, _chosen(w))
    out: dict[str, Any] = {"thread_counts": list(CALLERS), "task_counts": list(CALLERS)}
    for n in CALLERS:
        out[f"threads_{n}"] = _threads_part(w, n, runs)
        out[f"tasks_{n}"] = _tasks_part(w, n, runs)
    most = CALLERS[-1]
    floor_threads, _bound = concurrent_against(w.engine.dialect.name)
    against = runs[f"floor@{floor_threads}"]
    out["concurrent_creates"] = {
        "callers": most,
        "floor_threads": floor_threads,
        "threads_vs_floor": spread(ratios(runs[f"create@{most}"], against)),
        "tasks_vs_floor": spread(ratios(runs[f"create_async@{most}tasks"], against)),
        "single_vs_floor": spread(ratios(runs[f"create_single@{most}"], against)),
    }
    combiner = w.service.combiner
    if combiner is not None:  # what the combining service did, over all its runs
        out["combiner"] = asdict(combiner.stats)
    queue = w.service.transitions.queue
    if queue is not None:
        out["transition_combiner"] = asdict(queue.stats)
    return out


def progress_units(reps: int, engine: str) -> int:
    """Timed runs of the figure (a unit of the progress bar each), warm-up included; on
    SQLite the single path's payments too."""
    single = len(SINGLE) * (2 if combines_on(engine) else 1)
    return (len(CALLERS) * len(USE_CASES) * 3 + 1 + single) * (1 + reps)


def targets(fig: Mapping[str, Any], engine: str) -> list[dict[str, Any]]:
    """Issue 30's bounds on one caller's cost and on 64 concurrent creates."""
    one = fig["threads_1"]
    out = [
        check(
            f"callers_{key}_1",
            f"{key.replace('_vs_', ' / ')}, 1 thread",
            one[key]["median"],
            ">=",
            BOUNDS[key],
            "x",
        )
        for key in ("create_vs_naive", "refusal_vs_evalsha", "mark_paid_vs_raw")
    ]
    most = fig["concurrent_creates"]
    floor_threads, bound = concurrent_against(engine)
    for way, part, name in (
        ("threads", fig[f"threads_{most['callers']}"], "create"),
        ("tasks", fig[f"tasks_{most['callers']}"], "create_async"),
    ):
        p99 = part["variants"][name]["p99_ms"]
        shown = f"{most['callers']} concurrent creates ({way})"
        out.append(
            check(
                f"callers_creates_{most['callers']}_{way}",
                f"{shown} / floor, {floor_threads} thread{'s' * (floor_threads > 1)}",
                most[f"{way}_vs_floor"]["median"],
                ">=",
                bound,
                "x",
                f"p99 {p99:.1f} ms",
            )
        )
        out.append(
            check(
                f"callers_creates_{most['callers']}_{way}_p99",
                f"{shown}, p99 latency",
                p99,
                "<=",
                BOUNDS["p99_ms"],
                "ms",
            )
        )
    return out
