"""Comparing two saved bench reports and plotting one: exact lines, valid image files."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from benchmarks.compare import compare_lines
from benchmarks.plot import write_plots
from tests.support.bench_reports import NEW, OLD


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
    # Only the new report has the cancel figure, and the asyncio API's figures.
    assert rows["cancel_vs_raw"] == ["x", "-", "0.90", "-"]
    assert rows["cancel.cancel"] == ["ops/s", "-", "900", "-"]
    assert rows["create.tasks_1.create_async"] == ["ops/s", "-", "1,500", "-"]
    assert rows["create.tasks_64.create_async"] == ["ops/s", "-", "3,000", "-"]
    assert rows["refusal.tasks_64.refusal_async"] == ["ops/s", "-", "1,400", "-"]
    assert rows["refusal_async_sql_statements"] == ["statements", "-", "0", "-"]
    assert list(rows)[:3] == ["create_vs_floor_1", "create_vs_naive_1", "create_vs_naive_4"]


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
