"""Saved lab reports (``python -m benchmarks --json``) written by hand in the documented
shape (benchmarks/README.md), their targets computed by the lab's own ``targets``, so every
figure a test expects from them is exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.report import targets


def spread(median: float, low: float | None = None, high: float | None = None) -> dict[str, float]:
    return {"median": median, "min": median if low is None else low, "max": high or median}


def variant(ops_s: float) -> dict[str, Any]:
    return {"ops_s": spread(ops_s, ops_s * 0.9, ops_s * 1.1), "p50_ms": 1.0, "p99_ms": 2.0,
            "cpu_us": 100.0}  # fmt: skip


def create_figure(create_ops_s: float) -> dict[str, Any]:
    def part(threads: int, create: float) -> dict[str, Any]:
        floor, core, naive = 2000.0 * threads, 1600.0 * threads, 1000.0 * threads
        return {
            "threads": threads,
            "ops_per_rep": 100,
            "variants": {"create": variant(create), "floor": variant(floor),
                         "floor_core": variant(core), "naive": variant(naive)},
            "create_vs_floor": spread(create / floor),
            "create_vs_floor_core": spread(create / core),
            "create_vs_naive": spread(create / naive),
        }  # fmt: skip

    return {
        "thread_counts": [1, 4],
        "threads_1": part(1, create_ops_s),
        "threads_4": part(4, create_ops_s * 3),
        "scaling": {"threads_4_vs_1": {"create": spread(3.0), "floor": spread(4.0)}},
    }


def with_tasks(
    figure: dict[str, Any], name: str, ops_s: float, against: dict[str, float], floors_threads: int
) -> dict[str, Any]:
    """``figure`` with its async parts at 1 and 64 tasks (64 tasks: 2x the ops/s)."""
    out = {**figure, "task_counts": [1, 64]}
    for n, rate in ((1, ops_s), (64, ops_s * 2)):
        threads = 1 if n == 1 else floors_threads
        out[f"tasks_{n}"] = {
            "tasks": n,
            "ops_per_rep": 100,
            "floors_threads": threads,
            "variants": {name: variant(rate)},
        }
        for other, theirs in against.items():
            out[f"tasks_{n}"][f"{name}_vs_{other}"] = spread(rate / (theirs * threads))
    return out  # fmt: skip


def sweep_figure() -> dict[str, Any]:
    def table(rows: int, scale: float) -> dict[str, Any]:
        rates = {100: 20_000.0, 500: 35_000.0, 2000: 46_000.0}
        return {"rows": rows} | {
            f"batch_{b}": {"closes_s": spread(r * scale)} for b, r in rates.items()
        }

    return {
        "due": 1000, "batch_sizes": [100, 500, 2000],
        "table_1x": table(5000, 1.0), "table_10x": table(50_000, 0.9),
        "table_1x_again": table(5000, 1.0),
        "best_batch": 2000, "best_closes_s": 46_000.0, "best_closes_s_10x": 41_400.0,
        "cost_10x": 1.11, "cost_10x_by_batch": {"batch_100": 1.11}, "drift_1x": 1.0,
    }  # fmt: skip


def close_lag_figure() -> dict[str, Any]:
    lags = [1, 2, 3, 30, 2]
    return {
        "rate_s": 1000.0, "seconds": 0.005, "orders": 5, "closed": 5, "batch_size": 500,
        "p50_ms": 2.0, "p99_ms": 30.0, "max_ms": 30.0,
        "samples": {"due_s": [0.0, 0.001, 0.002, 0.003, 0.004], "lag_ms": lags},
    }  # fmt: skip


def make_report(
    create_ops_s: float, refusal_ops_s: float, *, cancel: bool, tasks: bool = False
) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "create": create_figure(create_ops_s),
        "refusal": {
            "ops_per_rep": 100,
            "variants": {"refusal": variant(refusal_ops_s), "refusal_given_id": variant(400.0),
                         "evalsha": variant(1000.0)},
            "refusals": 300, "sql_statements": 0, "sql_statements_given_id": 300,
            "refusal_vs_evalsha": spread(refusal_ops_s / 1000),
            "refusal_given_id_vs_evalsha": spread(0.4),
        },
        "sweep": sweep_figure(),
        "close_lag": close_lag_figure(),
    }  # fmt: skip
    if tasks:  # a report of the asyncio API too (the floors scale with threads, see above)
        figures["create"] = with_tasks(
            figures["create"], "create_async", 1500.0, {"floor": 2000.0, "naive": 1000.0}, 4
        )
        figures["create"]["task_scaling"] = {"tasks_64_vs_1": {"create_async": spread(2.0)}}
        figures["refusal"] = with_tasks(
            figures["refusal"], "refusal_async", 700.0, {"evalsha": 1000.0}, 1
        )
        for n in (1, 64):
            figures["refusal"][f"tasks_{n}"].update(refusals=300, sql_statements=0)
    if cancel:
        figures["cancel"] = {
            "ops_per_rep": 100,
            "variants": {"cancel": variant(900.0), "raw": variant(1000.0)},
            "cancel_vs_raw": spread(0.9),
        }
    report: dict[str, Any] = {
        "schema_version": 1,
        "engine": "sqlite",
        "machine": {"nproc": 2, "load_average": 1.0, "python": "3.11.7", "platform": "Linux",
                    "redis": "7.0.15", "sql_engine": "sqlite", "sql_version": "3.40.1",
                    "sqlalchemy": "2.0.30", "redis_py": "5.3.0",
                    "sql_settings": {"journal_mode": "wal", "synchronous": "full"},
                    "durable": True, "load_average_end": 1.0},
        "sizes": {"threads": 4},
        "figures": figures,
        "durations_s": {},
        "left_behind": {"rows": 0, "events": 0, "keys": 0},
        "notes": [],
        "elapsed_s": 12.0,
    }  # fmt: skip
    report["targets"] = targets(report)
    return report


OLD = make_report(create_ops_s=800.0, refusal_ops_s=800.0, cancel=False)
NEW = make_report(create_ops_s=1800.0, refusal_ops_s=900.0, cancel=True, tasks=True)


def save(folder: Path, name: str, report: dict[str, Any]) -> str:
    path = folder / name
    path.write_text(json.dumps(report))
    return str(path)
