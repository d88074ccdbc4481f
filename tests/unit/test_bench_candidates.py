"""The ``aio`` figure's pure parts: its variants and labels, the ratios it reports, the
targets on each engine with their verdicts, and how the table says met or missed."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console

from orders.bench import candidates
from orders.bench.candidates import NAMES, PAIRS, TARGETS, count_of, label, ratio_key, target_of
from orders.bench.report import targets
from orders.bench.tables import results_table


def spread(median: float) -> dict[str, float]:
    return {"median": median, "min": median * 0.9, "max": median * 1.1}


def aio_figure(ratio: float, *, refused: int = 0, created: int = 1200) -> dict[str, Any]:
    """Every ratio at ``ratio``; the async refusal's and the async creates' statements."""
    statements = {name: created if name.startswith("create") else 0 for name in NAMES}
    statements["refusal_async_1task"] = refused
    return {
        "ops_per_rep": 100,
        "ops_per_variant": 600,
        "variants": {
            name: {"ops_s": spread(1000.0), "p50_ms": 1.0, "p99_ms": 2.0 + i, "cpu_us": 100.0}
            for i, name in enumerate(NAMES)
        },
        "sql_statements": statements,
        "ratios": {ratio_key(a, b): spread(ratio) for a, b in PAIRS},
    }


def report(engine: str, figure: dict[str, Any]) -> dict[str, Any]:
    out = {"engine": engine, "sizes": {"threads": 4}, "figures": {"aio": figure}}
    out["targets"] = targets(out)
    return out


def test_every_variant_has_its_count_and_the_native_floor_says_it_is_an_upper_bound() -> None:
    assert NAMES == (
        "create_sync_1thr", "create_sync_8thr",
        "create_async_1task", "create_async_16tasks", "create_async_64tasks",
        "create_to_thread_16tasks", "create_to_thread_64tasks",
        "native_floor_1task", "native_floor_16tasks", "native_floor_64tasks",
        "refusal_sync_1thr", "refusal_async_1task",
    )  # fmt: skip
    assert [count_of(n) for n in ("create_sync_1thr", "create_sync_8thr")] == [
        "1 thread",
        "8 threads",
    ]
    assert [count_of(n) for n in ("create_async_1task", "native_floor_64tasks")] == [
        "1 task",
        "64 tasks",
    ]
    for name in NAMES:
        assert label(name).endswith(f", {count_of(name)}")
        assert ("UPPER BOUND" in label(name)) == name.startswith("native_floor")
    assert "asyncio.to_thread" in label("create_to_thread_16tasks")


def test_the_ratios_include_every_target_and_compare_each_design_at_16_and_64_tasks() -> None:
    keys = [ratio_key(a, b) for a, b in PAIRS]
    assert len(set(keys)) == len(keys)
    assert {t.ratio for t in TARGETS} <= set(keys)
    for n in (16, 64):
        for design in ("create_async", "create_to_thread", "native_floor"):
            for sync in ("create_sync_1thr", "create_sync_8thr"):
                assert ratio_key(f"{design}_{n}tasks", sync) in keys
        assert ratio_key(f"create_async_{n}tasks", f"native_floor_{n}tasks") in keys


POSTGRESQL_BOUNDS = {
    "aio_create_16_vs_sync_1": 1.4,
    "aio_create_64_vs_sync_1": 1.4,
    "aio_create_16_vs_sync_8": 1.0,
    "aio_create_64_vs_sync_8": 1.0,
    "aio_refusal_vs_sync": 0.8,
    "aio_refusal_sql_statements": 0.0,
}
SQLITE_BOUNDS = {
    "aio_create_16_vs_sync_1": 1.0,
    "aio_refusal_vs_sync": 0.8,
    "aio_refusal_sql_statements": 0.0,
}


@pytest.mark.parametrize(
    ("engine", "bounds"), [("postgresql", POSTGRESQL_BOUNDS), ("sqlite", SQLITE_BOUNDS)]
)
def test_the_targets_of_each_engine_and_their_verdicts(
    engine: str, bounds: dict[str, float]
) -> None:
    met = {t["id"]: t for t in report(engine, aio_figure(1.4))["targets"]}
    missed = {t["id"]: t for t in report(engine, aio_figure(0.79))["targets"]}

    assert {i: t["required"] for i, t in met.items()} == bounds
    assert {i: t["verdict"] for i, t in met.items()} == dict.fromkeys(bounds, "pass")
    assert {i: t["verdict"] for i, t in missed.items()} == {
        i: "pass" if i == "aio_refusal_sql_statements" else "miss" for i in bounds
    }
    # The p99 of the async create at 64 tasks, beside each create target.
    p99 = 2.0 + NAMES.index("create_async_64tasks")
    assert met["aio_create_16_vs_sync_1"]["note"] == f"async create p99 at 64 tasks {p99:.1f} ms"
    assert met["aio_refusal_vs_sync"]["note"] == ""
    assert met["aio_refusal_sql_statements"]["note"] == (
        "in 600 refusals; the async creates sent 1,200 in as many"
    )


def test_a_refusal_that_sent_sql_or_a_counter_that_saw_no_create_misses() -> None:
    def verdict(figure: dict[str, Any]) -> str:
        (check,) = [
            t for t in report("postgresql", figure)["targets"]
            if t["id"] == "aio_refusal_sql_statements"
        ]  # fmt: skip
        return str(check["verdict"])

    assert verdict(aio_figure(1.0)) == "pass"
    assert verdict(aio_figure(1.0, refused=1)) == "miss"
    # 0 from a counter that saw no statement of the async service proves nothing.
    assert verdict(aio_figure(1.0, created=0)) == "miss"


def test_target_of_finds_a_ratio_s_bound_on_an_engine() -> None:
    found = target_of("create_async_64tasks", "create_sync_8thr", "postgresql")
    assert found is not None
    assert found[1] == 1.0
    assert target_of("create_async_64tasks", "create_sync_8thr", "sqlite") is None
    assert target_of("create_to_thread_16tasks", "create_sync_1thr", "postgresql") is None
    # Another server engine is held to PostgreSQL's bounds.
    assert target_of("create_async_16tasks", "create_sync_1thr", "mysql") == (TARGETS[0], 1.4)
    assert candidates.met(1.4, 1.4) == "met"
    assert candidates.met(1.39, 1.4) == "missed"


def test_the_table_says_met_or_missed_beside_each_targeted_ratio() -> None:
    full = report("postgresql", aio_figure(1.2))
    full.update(
        elapsed_s=1.0,
        machine={"sql_engine": "postgresql", "sql_version": "15", "durable": True,
                 "sql_settings": {"fsync": "on"}, "redis": "7.0", "nproc": 2,
                 "load_average": 0.5, "python": "3.11"},
    )  # fmt: skip
    console = Console(width=400, record=True)
    console.print(results_table(full))
    lines = console.export_text().splitlines()

    def row(measure: str) -> str:
        (found,) = [line for line in lines if measure in line]
        return found

    assert "(target >= 1.40: missed)" in row("create_async_16tasks / create_sync_1thr")
    assert "(target >= 1.00: met)" in row("create_async_64tasks / create_sync_8thr")
    assert "(target >= 0.80: met)" in row("refusal_async_1task / refusal_sync_1thr")
    assert "target" not in row("create_to_thread_16tasks / create_sync_1thr")
    assert "[2.0 SQL/op]" in row("AsyncOrderService, tasks on one loop, 16 tasks")
    assert "[0.0 SQL/op]" in row("refusal at the limit, AsyncOrderService, 1 task")
