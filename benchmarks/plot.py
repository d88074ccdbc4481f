"""``python -m benchmarks --plot DIR``: the figures a reader would rather look at than read.

matplotlib (in the ``dev`` extra, not a dependency of ``orders``) is imported only here and
only when plotting; the figures are drawn with its object API (no pyplot, no GUI backend).
Files written, each where the report has the figure:

* ``close_lag.<fmt>``: each order's close lag (ms) against when it fell due (s);
* ``throughput_<figure>.<fmt>``: median ops/s per variant with its min-max, one file per
  figure (one group of bars per thread count and per async task count);
* ``sweep.<fmt>``: closes/s per batch size, one line per table size.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from benchmarks.concurrency import part_label, parts
from benchmarks.report import SWEEP_TARGET_CLOSES_S, TARGETS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMATS = ("png", "svg")
INSTALL_HINT = "--plot needs matplotlib: pip install matplotlib"


def require_matplotlib() -> None:
    """A one-line usage error unless matplotlib can be imported (checked before a run)."""
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError:
        raise click.UsageError(INSTALL_HINT) from None


def _figure(width: float = 7.0, height: float = 4.0) -> Figure:
    from matplotlib.figure import Figure  # noqa: PLC0415

    return Figure(figsize=(width, height), layout="constrained")


def _bars(ax: Axes, groups: Mapping[str, Mapping[str, Any]]) -> None:
    """Bars of median ops/s with min-max whiskers: per variant, one bar per group."""
    names = list(dict.fromkeys(v for part in groups.values() for v in part["variants"]))
    width = 0.8 / max(1, len(groups))
    for g, (label, part) in enumerate(groups.items()):
        xs, medians, low, high = [], [], [], []
        for i, name in enumerate(names):
            if name in part["variants"]:
                s = part["variants"][name]["ops_s"]
                xs.append(i + (g - (len(groups) - 1) / 2) * width)
                medians.append(s["median"])
                low.append(max(0.0, s["median"] - s["min"]))
                high.append(max(0.0, s["max"] - s["median"]))
        ax.bar(xs, medians, width, yerr=[low, high], capsize=3, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("ops/s (median, min-max)")
    if len(groups) > 1:
        ax.legend()


def _throughput(report: Mapping[str, Any], folder: Path, fmt: str) -> list[Path]:
    written = []
    engine = report["engine"]
    for name, fig in report["figures"].items():
        groups = {part_label(key): part for key, part in parts(fig, name).items()}
        if not groups:
            continue
        figure = _figure()
        ax = figure.add_subplot()
        _bars(ax, groups)
        ax.set_title(f"{name} on {engine}: throughput per variant")
        written.append(_save(figure, folder / f"throughput_{name}.{fmt}"))
    return written


def _close_lag(part: Mapping[str, Any], engine: str, folder: Path, fmt: str) -> Path:
    figure = _figure()
    ax = figure.add_subplot()
    samples = part["samples"]
    ax.plot(samples["due_s"], samples["lag_ms"], ".", markersize=2, label="an order")
    ax.axhline(part["p99_ms"], color="tab:orange", label=f"p99 {part['p99_ms']:.0f} ms")
    ax.axhline(TARGETS["close_lag_p99_ms"], color="tab:red", linestyle="--", label="target p99")
    ax.set_xlabel("due at (s from the first expiry)")
    ax.set_ylabel("close lag (ms)")
    ax.set_title(f"close lag on {engine}, {part['rate_s']:g} expiries/s")
    ax.legend()
    return _save(figure, folder / f"close_lag.{fmt}")


def _sweep(part: Mapping[str, Any], engine: str, folder: Path, fmt: str) -> Path:
    figure = _figure()
    ax = figure.add_subplot()
    batches = part["batch_sizes"]
    for label in ("table_1x", "table_10x", "table_1x_again"):
        rates = [part[label][f"batch_{b}"]["closes_s"]["median"] for b in batches]
        again = " (again)" if label.endswith("again") else ""
        ax.plot(batches, rates, "o-", label=f"{part[label]['rows']:,} orders{again}")
    bound = SWEEP_TARGET_CLOSES_S.get(engine, SWEEP_TARGET_CLOSES_S["postgresql"])
    ax.axhline(bound, color="tab:red", linestyle="--", label="target")
    ax.set_xscale("log")
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("closes/s (median)")
    ax.set_title(f"sweep on {engine}: {part['due']:,} due orders")
    ax.legend()
    return _save(figure, folder / f"sweep.{fmt}")


def _save(figure: Figure, path: Path) -> Path:
    figure.savefig(path, format=path.suffix[1:])
    return path


def write_plots(report: Mapping[str, Any], folder: Path, fmt: str = "png") -> list[Path]:
    """Draw the report's figures into ``folder`` (created if missing); the files written."""
    require_matplotlib()
    folder.mkdir(parents=True, exist_ok=True)
    figures, engine = report["figures"], report["engine"]
    written = _throughput(report, folder, fmt)
    if "close_lag" in figures:
        written.append(_close_lag(figures["close_lag"], engine, folder, fmt))
    if "sweep" in figures:
        written.append(_sweep(figures["sweep"], engine, folder, fmt))
    return written
