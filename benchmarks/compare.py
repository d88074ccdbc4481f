"""Saved reports: reading one back, and comparing two figure by figure.

The compared figures are the headline ones: each target's measured figure (keyed by its
id) and every variant's median ops/s (keyed ``figure.variant``, the create figure's as
``create.threads_N.variant``, an async one's as ``figure.tasks_N.variant``). A figure
only one report has shows ``-`` on the other side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from benchmarks.concurrency import parts
from benchmarks.report import SCHEMA_VERSION
from benchmarks.tables import format_value

#: The top-level keys every report has.
_KEYS = ("engine", "machine", "sizes", "figures", "notes", "left_behind", "targets")
#: Headline figure -> (value, unit).
Headline = dict[str, tuple[float, str]]


def load_report(path: str, option: str) -> dict[str, Any]:
    """The report saved at ``path`` by ``python -m benchmarks --json``, else a one-line usage error
    naming ``option`` (never the path: it is the caller's to know)."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        raise click.UsageError(f"{option}: cannot read that file") from None
    try:
        report = json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        raise click.UsageError(f"{option}: not a JSON file") from None
    if (
        not isinstance(report, dict)
        or report.get("schema_version") != SCHEMA_VERSION
        or any(key not in report for key in _KEYS)
    ):
        raise click.UsageError(
            f"{option}: not a benchmarks --json report of schema_version {SCHEMA_VERSION}"
        )
    try:
        headline(report)
    except (KeyError, TypeError, ValueError, AttributeError):
        raise click.UsageError(f"{option}: a report with missing or malformed figures") from None
    return report


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("not a number")
    return float(value)


def headline(report: Mapping[str, Any]) -> Headline:
    """The figures a comparison shows, in report order."""
    out: Headline = {}
    for target in report["targets"]:
        out[str(target["id"])] = (_number(target["measured"]), str(target["unit"]))
    for name, figure in report["figures"].items():
        for key, part in parts(figure, name).items():
            prefix = name if key == name else f"{name}.{key}"
            for variant, described in part["variants"].items():
                out[f"{prefix}.{variant}"] = (_number(described["ops_s"]["median"]), "ops/s")
    return out


def change(old: float | None, new: float | None) -> str:
    """``new / old`` and the same as a percentage; ``-`` when either is missing or 0."""
    if old is None or new is None or old == 0:
        return "-"
    ratio = new / old
    return f"{ratio:.2f} x ({(ratio - 1) * 100:+.1f}%)"


def compare_lines(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """The comparison as aligned text lines: figure, unit, old, new, change."""
    before, after = headline(old), headline(new)
    width = max((len(k) for k in [*before, *after]), default=6)
    lines = [
        f"{'figure':<{width}}  {'unit':<10} {'old':>12} {'new':>12}  change",
    ]
    if old["engine"] != new["engine"]:
        lines.insert(0, f"note: old ran on {old['engine']}, new on {new['engine']}")
    for key in dict.fromkeys([*before, *after]):
        o, n = before.get(key), after.get(key)
        unit = (n or o or (0.0, ""))[1]
        shown = [format_value(v[0], unit) if v else "-" for v in (o, n)]
        lines.append(
            f"{key:<{width}}  {unit:<10} {shown[0]:>12} {shown[1]:>12}  "
            f"{change(o[0] if o else None, n[0] if n else None)}"
        )
    return lines
