"""The lab's ``holds`` figure (benchmarks/holds.py) in a tiny run on both engines: every
variant is measured, the sold-out refusal sends no SQL statement while it is timed, issue
43's targets are reported, and nothing of the bench (orders, holds, resources, keys) is
left. No speed is asserted: the suite runs on machines of every size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select

from benchmarks.holds import HOT_CALLERS
from benchmarks.measure import Sizes
from benchmarks.report import run_bench
from orders import OrderService
from orders.sql.inventory_tables import holds_table, resources_table
from orders.sql.models import orders_table

TINY = Sizes(ops=12, reps=1, warmup=4)


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def test_the_holds_figure_measures_every_variant_and_leaves_nothing_behind(
    make_service: Callable[..., OrderService], engine: Engine, redis_client: Any
) -> None:
    service = make_service()
    keys = set(redis_client.keys("*"))

    report = run_bench(service, TINY, ["holds"])

    fig = report["figures"]["holds"]
    one, hot = fig["threads_1"], fig[f"threads_{HOT_CALLERS}"]
    assert list(one["variants"]) == [
        "refusal", "evalsha", "create", "create_1_hold", "create_10_holds",
        "create_1_hold_crowded", "commit",
    ]  # fmt: skip
    assert list(hot["variants"]) == ["create", "create_hot_sku", "raw_hot_sku"]
    for part in (one, hot):
        for v in part["variants"].values():
            assert 0 < v["ops_s"]["min"] <= v["ops_s"]["max"]
    assert (one["refusals"], one["sql_statements"]) == (TINY.ops + TINY.warmup, 0)
    assert fig["commit_ms"] > 0
    assert [t["id"] for t in report["targets"]] == [
        "holds_refusal_sql_statements", "holds_refusal_vs_evalsha",
        "holds_create_1_hold_cost", "holds_create_10_holds_cost",
    ]  # fmt: skip
    # The test servers do not fsync: the one note a run here may give.
    assert [note for note in report["notes"] if "not make each commit durable" not in note] == []
    assert report["left_behind"] == {"rows": 0, "events": 0, "keys": 0}
    assert (count(engine, orders_table), count(engine, holds_table)) == (0, 0)
    assert count(engine, resources_table) == 0
    assert set(redis_client.keys("*")) == keys
