"""The lab's ``waiting`` figure (benchmarks/waiting.py) in a tiny run on both engines: both
variants run, every entry is served exactly once (one order and one ``created`` event by the
waiting list each, every unit to one entry), the report has its latencies, close lags and
targets, and nothing of the bench (orders, entries, seats, resources, keys) is left. No speed
is asserted: the suite runs on machines of every size."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select

from benchmarks.compare import headline
from benchmarks.measure import Sizes
from benchmarks.report import run_bench
from benchmarks.waiting import VARIANTS
from orders import OrderService
from orders.sql.inventory_tables import resources_table, units_table, waiting_table
from orders.sql.models import orders_table

#: 20 units expiring at 50 a second: under half a second of expiries per variant.
TINY = Sizes(ops=10, reps=1, warmup=2, lag_rate=50.0, lag_seconds=0.4)


def count(engine: Engine, table: Any) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(table)) or 0)


def test_the_waiting_figure_serves_every_entry_once_and_leaves_nothing_behind(
    make_service: Callable[..., OrderService], engine: Engine, redis_client: Any
) -> None:
    service = make_service()
    keys = set(redis_client.keys("*"))

    report = run_bench(service, TINY, ["waiting"])

    fig = report["figures"]["waiting"]
    assert (fig["rate_s"], fig["seconds"]) == (50.0, 0.4)
    assert list(fig["kinds"]) == list(VARIANTS)
    counted, named = fig["kinds"]["counted"], fig["kinds"]["named"]
    assert (counted["resources"], named["resources"]) == (20, 1)
    for part in (counted, named):
        assert part["units"] == part["entries"] == 20
        assert part["served"] == part["orders_made"] == part["created_events"] == 20
        assert part["distinct_units"] == part["served_right_order"] == 20
        assert part["closed"] == 20
        assert part["drained"] is True
        for key in ("latency_ms", "close_lag_ms"):
            assert set(part[key]) == {"p50", "p99", "max"}
            assert part[key]["p50"] <= part[key]["p99"] <= part[key]["max"]
        assert part["served_per_s"] > 0
    assert [t["id"] for t in report["targets"]] == [
        "waiting_counted_served_once", "waiting_counted_p99_ms",
        "waiting_named_served_once", "waiting_named_p99_ms",
    ]  # fmt: skip
    assert [t["verdict"] for t in report["targets"][::2]] == ["pass", "pass"]
    assert [note for note in report["notes"] if "not make each commit durable" not in note] == []
    assert "waiting_named_p99_ms" in headline(report)  # --report and --compare read it
    assert report["threads_left"] == {"waiting": []}
    assert report["left_behind"] == {"rows": 0, "events": 0, "keys": 0}
    assert count(engine, orders_table) == 0
    for table in (resources_table, units_table, waiting_table):
        assert count(engine, table) == 0
    assert set(redis_client.keys("*")) == keys
