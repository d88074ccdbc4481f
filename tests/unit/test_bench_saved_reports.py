"""Saved ``orders bench --json`` reports: --report, --compare and --plot, with no stores.

The reports are written here by hand in the documented shape (docs/bench.md), with targets
computed by the bench's own ``targets``, so every expected figure below is exact.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from orders.bench.compare import compare_lines
from orders.bench.plot import write_plots
from orders.bench.report import targets
from orders.cli import main


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


def make_report(create_ops_s: float, refusal_ops_s: float, *, cancel: bool) -> dict[str, Any]:
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
NEW = make_report(create_ops_s=1800.0, refusal_ops_s=900.0, cancel=True)


def save(folder: Path, name: str, report: dict[str, Any]) -> str:
    path = folder / name
    path.write_text(json.dumps(report))
    return str(path)


def bench(*args: str) -> Result:
    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def test_compare_prints_old_new_and_the_change_of_every_headline_figure() -> None:
    lines = compare_lines(OLD, NEW)

    assert lines[0].split() == ["figure", "unit", "old", "new", "change"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["create_vs_floor_1"] == ["x", "0.40", "0.90", "2.25", "x", "(+125.0%)"]
    assert rows["create_vs_naive_4"] == ["x", "0.60", "1.35", "2.25", "x", "(+125.0%)"]
    assert rows["refusal_vs_evalsha"] == ["x", "0.80", "0.90", "1.12", "x", "(+12.5%)"]
    assert rows["refusal_sql_statements"] == ["statements", "0", "0", "-"]
    assert rows["sweep_closes_s"] == ["closes/s", "46,000", "46,000", "1.00", "x", "(+0.0%)"]
    assert rows["close_lag_p99_ms"] == ["ms", "30.0", "30.0", "1.00", "x", "(+0.0%)"]
    assert rows["create.threads_1.create"] == ["ops/s", "800", "1,800", "2.25", "x", "(+125.0%)"]
    assert rows["refusal.refusal"] == ["ops/s", "800", "900", "1.12", "x", "(+12.5%)"]
    # Only the new report has the cancel figure.
    assert rows["cancel_vs_raw"] == ["x", "-", "0.90", "-"]
    assert rows["cancel.cancel"] == ["ops/s", "-", "900", "-"]
    assert list(rows)[:3] == ["create_vs_floor_1", "create_vs_naive_1", "create_vs_naive_4"]


def test_compare_of_two_saved_reports_runs_nothing_and_prints_the_changes(
    tmp_path: Path,
) -> None:
    old, new = save(tmp_path, "old.json", OLD), save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--compare", old)

    assert result.exit_code == 0, result.output
    assert "targets" in result.stdout  # the saved report's tables, then the comparison
    assert result.stdout.splitlines()[-len(compare_lines(OLD, NEW)) :] == compare_lines(OLD, NEW)


def test_with_json_the_saved_report_alone_goes_to_stdout_and_the_comparison_to_stderr(
    tmp_path: Path,
) -> None:
    old, new = save(tmp_path, "old.json", OLD), save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--compare", old, "--json")

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == NEW
    assert result.stderr.splitlines() == compare_lines(OLD, NEW)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "error: --compare: cannot read that file"),
        (b"\x89PNG not json", "error: --compare: not a JSON file"),
        (b"[1, 2]", "error: --compare: not an orders bench --json report of schema_version 1"),
        (json.dumps({**OLD, "schema_version": 2}).encode(), "schema_version 1"),
        (json.dumps({**OLD, "targets": [{"id": "x"}]}).encode(), "malformed figures"),
    ],
    ids=["missing", "binary", "not-a-report", "other-schema", "malformed"],
)
def test_a_bad_file_to_compare_is_a_one_line_usage_error(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "old.json"
    if content is not None:
        path.write_bytes(content)
    new = save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--compare", str(path))

    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: --compare: ")
    assert message in result.stderr
    assert str(tmp_path) not in result.stderr


@pytest.mark.parametrize("fmt", ["png", "svg"])
def test_plot_draws_close_lag_throughput_per_figure_and_sweep_rate_per_batch(
    tmp_path: Path, fmt: str
) -> None:
    written = write_plots(NEW, tmp_path / "plots", fmt)

    names = sorted(path.name for path in written)
    expected = ["close_lag", "sweep", "throughput_cancel", "throughput_create",
                "throughput_refusal"]  # fmt: skip
    assert names == [f"{name}.{fmt}" for name in expected]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == names
    for path in written:
        data = path.read_bytes()
        if fmt == "png":
            assert data.startswith(b"\x89PNG\r\n\x1a\n"), path.name
            assert data.endswith(b"IEND\xaeB`\x82"), path.name
        else:
            assert ET.fromstring(data).tag == "{http://www.w3.org/2000/svg}svg", path.name


def test_plot_of_a_saved_report_says_what_it_wrote(tmp_path: Path) -> None:
    new = save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--plot", str(tmp_path / "out"), "--plot-format", "svg")

    assert result.exit_code == 0, result.output
    wrote = [line for line in result.stdout.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == 5
    assert (tmp_path / "out" / "close_lag.svg").stat().st_size > 0


def test_without_matplotlib_plot_says_how_to_install_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    new = save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--plot", str(tmp_path / "out"))

    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr == "error: --plot needs matplotlib: pip install 'orders[plot]'\n"
    assert not (tmp_path / "out").exists()
