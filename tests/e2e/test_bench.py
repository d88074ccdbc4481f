"""``orders bench``: a quick run reports every figure beside its floors, touches only its
own orders and keys, and refuses what it cannot measure in one line.

No speed is asserted here (the suite runs on machines of every size); only that each figure
is there and positive, that a refusal costs no SQL statement, that every order of the
close-lag figure was closed by its scheduler, and that nothing of the bench is left.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from sqlalchemy import Engine, text

from orders.cli import main
from orders.cli.bench_command import lines
from orders.service import OrderService


@pytest.fixture
def run(database_url: str, redis_url: str, redis_client: redis.Redis) -> Any:
    env = {"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": redis_url}

    def invoke(*args: str) -> Result:
        return CliRunner().invoke(main, ["bench", *args], env=env, catch_exceptions=False)

    return invoke


def rows(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        orders = conn.scalar(text("SELECT count(*) FROM oes_orders"))
        events = conn.scalar(text("SELECT count(*) FROM oes_order_events"))
    return int(orders or 0), int(events or 0)


def assert_beside_its_floors(fig: dict[str, Any], variants: list[str]) -> None:
    assert list(fig["variants"]) == variants
    for v in fig["variants"].values():
        assert 0 < v["ops_s"]["min"] <= v["ops_s"]["median"] <= v["ops_s"]["max"]
        assert 0 < v["p50_ms"] <= v["p99_ms"]
    first, *others = variants
    assert list(fig["ratios"]) == [f"{first}_vs_{other}" for other in others]
    assert all(s["min"] > 0 for s in fig["ratios"].values())


@pytest.mark.rotate("database_url")  # CI time: one engine (both: --full)
def test_quick_bench_beside_other_orders_reports_every_figure_and_leaves_them_alone(
    run: Any, service: OrderService, engine: Engine, redis_client: redis.Redis
) -> None:
    order = service.create_unpaid_order("someone")
    keys = set(redis_client.keys("*"))

    result = run("--quick", "--json", "--yes")

    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    figures = report["figures"]
    assert list(figures) == ["create", "refusal", "mark_paid", "sweep", "close_lag"], report
    # Only a machine too busy to create the close-lag orders in time may add a note.
    assert [note for note in report["notes"] if "created late" not in note] == []
    assert_beside_its_floors(figures["create"], ["create", "naive", "floor"])
    assert_beside_its_floors(figures["refusal"], ["refusal", "naive", "floor"])
    assert_beside_its_floors(figures["mark_paid"], ["mark_paid", "floor"])
    sizes = report["sizes"]
    refusal = figures["refusal"]
    assert refusal["refusals"] == sizes["ops"] * sizes["reps"] + sizes["ops"] // 10  # + warm-up
    assert refusal["sql_statements"] == 0
    sweep = figures["sweep"]
    assert (sweep["due"], sweep["closes_s"]["min"] > 0) == (sizes["sweep_due"], True)
    lag = figures["close_lag"]
    assert lag["orders"] == lag["closed"] == round(sizes["lag_rate_s"] * sizes["lag_s"])
    assert 0 <= lag["p50_ms"] <= lag["p99_ms"] <= lag["max_ms"]
    assert report["left_behind"] == {"rows": 0, "events": 0, "keys": 0}
    assert rows(engine) == (1, 1)
    assert service.get_order(order.id) == order
    # As sets: KEYS lists in hash-table order, which the bench's keys come and go through.
    assert set(redis_client.keys("*")) == keys
    printed = lines(report)
    assert printed[0].startswith(f"orders bench on {report['engine']}, ")
    shown = [line.split()[:2] for line in printed[1:4]]
    assert shown == [["create", "create"], ["create", "naive"], ["create", "floor"]]
    refused = f"refusal    0 SQL statements in {refusal['refusals']:,}"
    assert refused in printed


def test_bench_refuses_a_database_holding_orders_in_one_line(
    run: Any, service: OrderService, engine: Engine
) -> None:
    service.create_unpaid_order("someone")

    result = run("--quick", "--json")

    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.startswith("error: the database already holds orders")
    assert result.stderr.count("\n") == 1
    assert "--yes" in result.stderr
    assert rows(engine) == (1, 1)


def test_bench_refuses_a_redis_cluster_in_one_line(database_url: str, engine: Engine) -> None:
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


@pytest.mark.parametrize("option", ["--only", "--reps", "--plot"])
def test_the_lab_s_options_are_a_one_line_usage_error(tmp_path: Path, option: str) -> None:
    home = tmp_path / "home"
    args = ["--home", str(home), "bench", "--quick", option, "1"]

    result = CliRunner().invoke(main, args, catch_exceptions=False)

    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr.startswith(f"error: No such option '{option}'.")
    assert result.stderr.count("\n") == 1
    assert not home.exists()
