"""The lab (``python -m benchmarks``) on saved reports (--report, --compare, --plot): no run,
no stores."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from benchmarks.cli import bench as lab
from benchmarks.compare import compare_lines
from tests.support.bench_reports import NEW, OLD, save


def bench(*args: str) -> Result:
    return CliRunner().invoke(lab, list(args), catch_exceptions=False)


def test_compare_of_two_saved_reports_runs_nothing_and_prints_the_changes(
    tmp_path: Path,
) -> None:
    old, new = save(tmp_path, "old.json", OLD), save(tmp_path, "new.json", NEW)

    result = bench("--report", new, "--compare", old)

    assert result.exit_code == 0, result.output
    assert "targets" in result.stdout  # the saved report's tables, then the comparison
    assert result.stdout.splitlines()[-len(compare_lines(OLD, NEW)) :] == compare_lines(OLD, NEW)


def cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.split("│")[1:-1]]


def test_a_saved_report_shows_each_async_row_with_the_floors_it_is_compared_with(
    tmp_path: Path,
) -> None:
    result = bench("--report", save(tmp_path, "new.json", NEW))

    assert result.exit_code == 0, result.output
    rows = [cells(line)[:4] for line in result.stdout.splitlines() if "task" in line]
    assert rows == [
        ["create, 1 task", "create_async ops/s", "1,500", "1,350 - 1,650"],
        ["create, 1 task", "create_async / floor (1 thr)", "0.75 x", "0.75 - 0.75"],
        ["create, 1 task", "create_async / naive (1 thr)", "1.50 x", "1.50 - 1.50"],
        ["create, 64 tasks", "create_async ops/s", "3,000", "2,700 - 3,300"],
        ["create, 64 tasks", "create_async / floor (4 thr)", "0.38 x", "0.38 - 0.38"],
        ["create, 64 tasks", "create_async / naive (4 thr)", "0.75 x", "0.75 - 0.75"],
        ["create, scaling", "create_async, 64 tasks / 1 task", "2.00 x", "2.00 - 2.00"],
        ["refusal, 1 task", "refusal_async ops/s", "700", "630 - 770"],
        ["refusal, 1 task", "refusal_async / evalsha (1 thr)", "0.70 x", "0.70 - 0.70"],
        ["refusal, 1 task", "refusal_async: SQL statements", "0", "in 300 refusals"],
        ["refusal, 64 tasks", "refusal_async ops/s", "1,400", "1,260 - 1,540"],
        ["refusal, 64 tasks", "refusal_async / evalsha (1 thr)", "1.40 x", "1.40 - 1.40"],
        ["refusal, 64 tasks", "refusal_async: SQL statements", "0", "in 300 refusals"],
    ]


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
        (b"[1, 2]", "error: --compare: not a benchmarks --json report of schema_version 1"),
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
    assert result.stderr == "error: --plot needs matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "out").exists()
