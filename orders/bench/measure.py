"""Timing side by side: variants take turns, figures are medians, ratios per repetition."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event

ns = time.perf_counter_ns


@dataclass(frozen=True, slots=True)
class Run:
    """One timed run of one variant: ``ops`` operations in ``elapsed_ns``, each one's time."""

    ops: int
    elapsed_ns: int
    latencies_ns: Sequence[int] = ()

    @property
    def ops_s(self) -> float:
        return self.ops * 1e9 / max(1, self.elapsed_ns)


#: Given n, prepares its data (untimed), then times n operations.
Variant = Callable[[int], Run]


def timed(op: Callable[[int], object], n: int) -> Run:
    """Call ``op(i)`` for i in 0..n-1, timing each call and the whole."""
    latencies = []
    started = ns()
    for i in range(n):
        t0 = ns()
        op(i)
        latencies.append(ns() - t0)
    return Run(n, ns() - started, latencies)


def side_by_side(
    variants: Mapping[str, Variant], ops: int, reps: int, warmup: int
) -> dict[str, list[Run]]:
    """A warm-up run of each variant, then ``reps`` rounds of A B C ..., in turn: a machine
    that speeds up or slows down meanwhile affects each of them alike."""
    for variant in variants.values():
        variant(warmup)
    runs: dict[str, list[Run]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, variant in variants.items():
            runs[name].append(variant(ops))
    return runs


@contextlib.contextmanager
def counting_statements(engine: Engine, counter: dict[str, int]) -> Iterator[None]:
    """Adds each statement SQLAlchemy sends on ``engine`` in the block to ``counter``."""

    def sent(*_: Any) -> None:
        counter["sql_statements"] += 1

    event.listen(engine, "before_cursor_execute", sent)
    try:
        yield
    finally:
        event.remove(engine, "before_cursor_execute", sent)


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of ``values`` (0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max: how every figure is given."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0}
    low, high = float(min(values)), float(max(values))
    return {"median": float(statistics.median(values)), "min": low, "max": high}


def compared(runs: Mapping[str, list[Run]]) -> dict[str, Any]:
    """Each variant's ops/s and latency, and the first one's ratio to each of the others,
    taken per repetition (A_r / B_r) before the median."""
    first, *others = runs
    described = {}
    for name, each in runs.items():
        latencies = [x / 1e6 for run in each for x in run.latencies_ns]
        described[name] = {
            "ops_s": spread([run.ops_s for run in each]),
            "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99),
        }
    ratios = {
        f"{first}_vs_{other}": spread(
            [a.ops_s / b.ops_s for a, b in zip(runs[first], runs[other], strict=True)]
        )
        for other in others
    }
    return {"variants": described, "ratios": ratios}
