"""``orders bench``: the quick run reports every figure, cleans up, and spares other orders.

No speed is asserted here (the suite runs on machines of every size); only that each figure
is there and numeric, that a refusal costs no SQL statement, and that the bench leaves no
row and no key behind.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from sqlalchemy import Engine, func, select

from orders.aio import AsyncOrderService
from orders.bench import FIGURES
from orders.bench.candidates import NAMES, PAIRS, ratio_key
from orders.bench.loop import BenchLoop
from orders.cli import main
from orders.config import Settings
from orders.domain import Order
from orders.service import OrderService
from orders.sql.models import events_table, orders_table


@pytest.fixture
def run(database_url: str, redis_url: str, redis_client: redis.Redis) -> Any:
    env = {"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": redis_url}

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(main, ["bench", *args], env=env, catch_exceptions=False)

    return invoke


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def rows(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        orders = conn.scalar(select(func.count()).select_from(orders_table))
        events = conn.scalar(select(func.count()).select_from(events_table))
    return int(orders or 0), int(events or 0)


def assert_floors_thread_counts_and_keyed_refusal(report: Any, postgres: bool) -> None:
    create = report["figures"]["create"]
    assert create["thread_counts"] == ([1, 4, 8] if postgres else [1, 4])
    assert list(create["scaling"]) == [f"threads_{t}_vs_1" for t in create["thread_counts"][1:]]
    for t in create["thread_counts"]:
        part = create[f"threads_{t}"]
        assert list(part["variants"]) == ["create", "floor", "floor_core", "naive"]
        for variant in part["variants"].values():
            assert variant["ops_s"]["min"] > 0
        for ratio in ("create_vs_floor", "create_vs_floor_core", "create_vs_naive"):
            assert part[ratio]["median"] > 0
    refusal = report["figures"]["refusal"]
    assert list(refusal["variants"]) == ["refusal", "refusal_given_id", "evalsha"]
    assert refusal["sql_statements"] == 0
    # At most the one read by primary key per refusal of a caller-supplied id.
    assert 0 <= refusal["sql_statements_given_id"] <= refusal["refusals"]
    for name in ("mark_paid", "cancel"):
        assert list(report["figures"][name]["variants"])[:2] == [name, "raw"]
        assert report["figures"][name][f"{name}_vs_raw"]["min"] > 0
    # Beside the payment: one stating its amount (a read first) and a refused one.
    paid = report["figures"]["mark_paid"]
    assert list(paid["variants"])[2:] == ["stating_amount", "refused"]
    assert paid["refused_vs_mark_paid"]["min"] > 0
    assert list(report["figures"]["cancel"]["variants"]) == ["cancel", "raw"]
    ids = [t["id"] for t in report["targets"]]
    assert ids[:3] == ["create_vs_floor_1", "create_vs_naive_1", "create_vs_naive_4"]
    assert ("threads_8_vs_1" in ids) == postgres
    assert {"mark_paid_vs_raw", "cancel_vs_raw", "refusal_vs_evalsha"} <= set(ids)


def assert_async_rows_beside_the_same_floors(report: Any) -> None:
    create, refusal = report["figures"]["create"], report["figures"]["refusal"]
    most_threads = create["thread_counts"][-1]
    for fig, name, against, floors in (
        (create, "create_async", ["create", "floor", "floor_core", "naive"], most_threads),
        (refusal, "refusal_async", ["refusal", "evalsha"], 1),
    ):
        assert fig["task_counts"] == [1, 64]
        for n, threads in ((1, 1), (64, floors)):
            part = fig[f"tasks_{n}"]
            assert (part["tasks"], part["floors_threads"]) == (n, threads)
            assert list(part["variants"]) == [name]
            assert part["variants"][name]["ops_s"]["min"] > 0
            assert [k for k in part if k.startswith(f"{name}_vs_")] == [
                f"{name}_vs_{other}" for other in against
            ]
            assert all(part[f"{name}_vs_{other}"]["min"] > 0 for other in against)
        # Not a speed: 64 operations in flight at once wait for one another (Little's
        # law); tasks run one after another would each take as long as 1 task's.
        one, many = (fig[f"tasks_{n}"]["variants"][name]["p50_ms"] for n in (1, 64))
        assert many > 2 * one, (one, many)
    assert list(create["task_scaling"]) == ["tasks_64_vs_1"]
    for n in (1, 64):
        assert refusal[f"tasks_{n}"]["sql_statements"] == 0
        assert refusal[f"tasks_{n}"]["refusals"] == refusal["refusals"]
    verdicts = {t["id"]: t["verdict"] for t in report["targets"]}
    assert verdicts["refusal_async_sql_statements"] == "pass"


def assert_callers_at_1_8_64_beside_their_floors(report: Any, postgres: bool) -> None:
    fig = report["figures"]["callers"]
    sqlite = not postgres
    assert fig["thread_counts"] == fig["task_counts"] == [1, 8, 64]
    for n in (1, 8, 64):
        threaded, tasks = fig[f"threads_{n}"], fig[f"tasks_{n}"]
        floors = ["create", "floor", "mark_paid", "raw", "refusal", "evalsha"]
        # On SQLite the payments combined too (Settings.combine_transitions).
        more = ["naive"] if n == 1 else ["create_combined"] + ["mark_paid_combined"] * sqlite
        assert list(threaded["variants"]) == floors + more
        assert list(tasks["variants"]) == ["create_async", "mark_paid_async", "refusal_async"]
        assert tasks["floors_threads"] == n
        for part in (threaded, tasks):
            for variant in part["variants"].values():
                assert variant["ops_s"]["min"] > 0
                assert 0 < variant["p50_ms"] <= variant["p99_ms"]
        for use, floor in (("create", "floor"), ("mark_paid", "raw"), ("refusal", "evalsha")):
            assert threaded[f"{use}_vs_{floor}"]["min"] > 0
            assert tasks[f"{use}_async_vs_{floor}"]["min"] > 0
    # Not a speed: 64 callers in flight at once wait for one another (Little's law).
    one, many = (fig[f"threads_{n}"]["variants"]["create"]["p50_ms"] for n in (1, 64))
    assert many > 2 * one, (one, many)
    most = fig["concurrent_creates"]
    assert (most["callers"], most["floor_threads"]) == (64, 8 if postgres else 1)
    ids = [t["id"] for t in report["targets"] if t["id"].startswith("callers_")]
    assert ids == [
        "callers_create_vs_naive_1",
        "callers_refusal_vs_evalsha_1",
        "callers_mark_paid_vs_raw_1",
        "callers_creates_64_threads",
        "callers_creates_64_threads_p99",
        "callers_creates_64_tasks",
        "callers_creates_64_tasks_p99",
        "callers_creates_64_combined",
        "callers_creates_64_combined_p99",
    ]
    # The combining service's creates ran beside the others, and formed batches.
    assert fig["threads_64"]["create_combined_vs_create"]["min"] > 0
    combiner = fig["combiner"]
    assert combiner["batches"] > 0, combiner
    assert 2 * combiner["batches"] <= combiner["combined"] <= 64 * combiner["batches"]
    if sqlite:  # and so did its payments, in shared transactions
        assert fig["threads_64"]["mark_paid_combined_vs_mark_paid"]["min"] > 0
        shared = fig["transition_combiner"]
        assert shared["batches"] > 0, shared
        assert 2 * shared["batches"] <= shared["combined"] <= 64 * shared["batches"]
    else:
        assert "transition_combiner" not in fig


#: The figures of the quick run below; ``aio`` has a smaller run of its own (CI time).
QUICK_FIGURES = [name for name in FIGURES if name != "aio"]


@pytest.mark.rotate("database_url")  # CI time: one engine (both: --full)
def test_quick_bench_reports_every_figure_and_leaves_nothing_behind(
    run: Any, engine: Engine, redis_client: redis.Redis, database_url: str
) -> None:
    # One repetition, not the quick default of three: a smoke test of every figure (CI time).
    result = run("--quick", "--json", "--only", ",".join(QUICK_FIGURES), "--reps", "1")

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["figures"]) == QUICK_FIGURES, report["notes"]
    for path, leaf in leaves(report["figures"]):
        assert is_number(leaf), f"figures{path} = {leaf!r}"
    assert report["figures"]["refusal"]["sql_statements"] == 0
    lag = report["figures"]["close_lag"]
    assert lag["closed"] == lag["orders"]
    assert len(lag["samples"]["due_s"]) == len(lag["samples"]["lag_ms"]) == lag["closed"]
    assert lag["samples"]["due_s"] == sorted(lag["samples"]["due_s"])
    assert max(lag["samples"]["lag_ms"]) == lag["max_ms"]
    assert report["targets"]
    for target in report["targets"]:
        assert target["verdict"] in ("pass", "miss")
        assert is_number(target["measured"])
        assert is_number(target["required"])
    assert report["schema_version"] == 1
    for key in ("python_loop_ms", "python_loop_ms_end"):
        assert report["machine"][key] > 0
    # Each figure starts alone: none leaves a thread of its own running for the next.
    assert report["threads_left"] == {name: [] for name in QUICK_FIGURES}, report["notes"]
    assert_floors_thread_counts_and_keyed_refusal(report, database_url.startswith("postgresql"))
    assert_async_rows_beside_the_same_floors(report)
    assert_callers_at_1_8_64_beside_their_floors(report, database_url.startswith("postgresql"))
    # Within the admission window each user also holds its admissions record.
    memory = report["figures"]["redis_memory"]
    for k in (1, 3):
        part = memory[f"per_user_{k}"]
        assert part["bytes_per_order_in_flight"]["min"] > part["bytes_per_order"]["max"] > 0
    assert report["left_behind"] == {"rows": 0, "events": 0, "keys": 0}
    assert rows(engine) == (0, 0)
    assert redis_client.keys("*") == []


def test_the_aio_figure_runs_each_design_side_by_side_and_counts_every_engine_s_sql(
    run: Any, engine: Engine, redis_client: redis.Redis, database_url: str
) -> None:
    result = run("--quick", "--json", "--only", "aio", "--ops", "64", "--reps", "1")

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["figures"]) == ["aio"], report["notes"]
    for path, leaf in leaves(report["figures"]):
        assert is_number(leaf), f"figures{path} = {leaf!r}"
    aio = report["figures"]["aio"]
    assert list(aio["variants"]) == list(NAMES)
    assert all(v["ops_s"]["min"] > 0 for v in aio["variants"].values())
    assert list(aio["ratios"]) == [ratio_key(a, b) for a, b in PAIRS]
    ops = aio["ops_per_variant"]
    assert ops == 64 + 20  # one repetition and the warm-up
    statements = aio["sql_statements"]
    assert statements["refusal_sync_1thr"] == statements["refusal_async_1task"] == 0
    # The counter watches every engine of the process: the sync service's, the async
    # service's (whatever it runs on) and the native floor's AsyncEngine.
    for name in NAMES[:-2]:
        assert statements[name] >= ops, name
    # Not a speed: 64 creates in flight at once wait for one another; one task's do not.
    for design in ("create_async", "native_floor"):
        one, many = (aio["variants"][f"{design}_{n}"]["p50_ms"] for n in ("1task", "64tasks"))
        assert many > 2 * one, (design, one, many)
    ids = [t["id"] for t in report["targets"]]
    postgres = database_url.startswith("postgresql")
    assert ids == [
        "aio_create_16_vs_sync_1",
        *(["aio_create_64_vs_sync_1", "aio_create_16_vs_sync_8", "aio_create_64_vs_sync_8"]
          if postgres else []),
        "aio_refusal_vs_sync",
        "aio_refusal_sql_statements",
    ]  # fmt: skip
    assert report["targets"][-1]["verdict"] == "pass"
    assert report["left_behind"] == {"rows": 0, "events": 0, "keys": 0}
    assert rows(engine) == (0, 0)
    assert redis_client.keys("*") == []


def test_the_async_variants_share_one_event_loop_closed_with_the_bench(
    database_url: str, redis_options: dict[str, Any], service: OrderService, clock: Any
) -> None:
    bench_loop = BenchLoop(Settings(database_url=database_url, **redis_options), clock)
    loops: list[asyncio.AbstractEventLoop] = []
    created: list[Order] = []

    async def op(aio: AsyncOrderService, i: int) -> None:
        loops.append(asyncio.get_running_loop())
        created.append(await aio.create_unpaid_order(f"u{len(loops)}"))

    try:
        bench_loop.run(op, 2, 1)
        bench_loop.run(op, 6, 3)
    finally:
        bench_loop.close()

    assert len(loops) == 8
    assert {id(loop) for loop in loops} == {id(loops[0])}
    assert loops[0].is_closed()
    assert sorted(o.user_id for o in created) == sorted(f"u{i}" for i in range(1, 9))
    for order in created:
        assert service.get_order(order.id) == order
        assert service.index.members(order.user_id) == {order.id: order.expires_at_ms}


def test_the_machine_block_says_what_a_commit_waits_for(run: Any, database_url: str) -> None:
    result = run("--quick", "--json", "--only", "refusal", "--ops", "10", "--reps", "1")

    assert result.exit_code == 0, result.output
    machine = json.loads(result.stdout)["machine"]
    found = machine["sql_settings"]
    if database_url.startswith("postgresql"):
        assert set(found) == {"fsync", "synchronous_commit", "full_page_writes"}
        durable = found["fsync"] == found["full_page_writes"] == "on"
        durable = durable and found["synchronous_commit"] != "off"
    else:
        assert found["journal_mode"] == "wal"  # the engine's own connection: WAL
        assert set(found) == {"journal_mode", "synchronous"}
        assert found["synchronous"] in ("off", "normal", "full", "extra")
        durable = found["synchronous"] in ("full", "extra")
    assert machine["durable"] is durable


def test_bench_refuses_a_database_holding_orders_in_one_line(
    run: Any, service: OrderService, engine: Engine
) -> None:
    service.create_unpaid_order("someone")

    result = run("--quick", "--json")

    assert result.exit_code != 0
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: ")
    assert "--yes" in result.stderr
    assert rows(engine) == (1, 1)


def test_bench_refuses_a_redis_cluster_in_one_line(
    database_url: str, redis_url: str, engine: Engine
) -> None:
    env = {
        "ORDERS_DATABASE_URL": database_url,
        "ORDERS_REDIS_URL": "redis://127.0.0.1:1",  # never reached: refused before
        "ORDERS_REDIS_CLUSTER": "true",
    }

    result = CliRunner().invoke(main, ["bench", "--quick"], env=env, catch_exceptions=False)

    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: orders bench measures one Redis server")
    assert rows(engine) == (0, 0)


def test_with_yes_the_bench_runs_beside_other_orders_and_leaves_them_alone(
    run: Any, service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    order = service.create_unpaid_order("someone")
    keys = redis_client.keys("*")

    result = run(
        "--quick", "--yes", "--json", "--only", "refusal,sweep,close_lag",
        "--sweep-rows", "2000", "--sweep-due", "500", "--lag-seconds", "1",
    )  # fmt: skip

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["figures"]) == ["refusal", "sweep", "close_lag"], report["notes"]
    assert rows(engine) == (1, 1)
    assert service.get_order(order.id) == order
    # As sets: KEYS lists in hash-table order, which the bench's keys come and go through
    # (the user's set and its admissions hash swapped places once).
    assert set(redis_client.keys("*")) == set(keys)
    assert service.index.members("someone") == {order.id: order.expires_at_ms}
