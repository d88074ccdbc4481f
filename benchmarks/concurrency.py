"""How many operations a figure runs at once, and the parts of the report keyed by it.

The create figure runs its variants on 1 thread, on ``--threads`` and (PostgreSQL) on 8;
create and refusal also run on the asyncio API, as 1 task (awaited in turn) and as
``--tasks`` tasks gathered on one event loop. A figure's part per count is ``threads_N``
(listed in ``thread_counts``) or ``tasks_N`` (listed in ``task_counts``); a figure without
thread counts holds its threaded (1-thread) variants at its top level.

The floors are threaded only. ``tasks_N`` is compared with the floors measured in the same
run at the most threads the figure ran that are not more than N (:func:`floors_threads`):
1 task with 1 thread, 64 tasks with 8 threads on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def thread_counts(engine: str, threads: int) -> tuple[int, ...]:
    """1 and ``--threads``; on PostgreSQL also 8, where commits can share an fsync."""
    counts = {1, threads, *((8,) if engine == "postgresql" else ())}
    return tuple(sorted(counts))


def task_counts(tasks: int) -> tuple[int, ...]:
    """1 (sequential awaits) and ``--tasks`` (tasks gathered on one event loop)."""
    return tuple(sorted({1, tasks}))


def floors_threads(threads: Sequence[int], tasks: int) -> int:
    """The thread count whose floors ``tasks`` tasks are compared with."""
    return max((t for t in threads if t <= tasks), default=1)


def parts(figure: Mapping[str, Any], top: str) -> dict[str, Mapping[str, Any]]:
    """A figure's parts that hold ``variants``, by label: ``threads_N`` for each thread
    count (else the figure itself, labelled ``top``), then ``tasks_N`` for each task count."""
    counts = figure.get("thread_counts")
    found: dict[str, Mapping[str, Any]] = (
        {f"threads_{t}": figure[f"threads_{t}"] for t in counts}
        if counts is not None
        else ({top: figure} if "variants" in figure else {})
    )
    found.update({f"tasks_{n}": figure[f"tasks_{n}"] for n in figure.get("task_counts", [])})
    return found


def part_label(key: str) -> str:
    """``threads_8`` -> ``8 thr``, ``tasks_64`` -> ``64 tasks``, ``tasks_1`` -> ``1 task``."""
    kind, _, count = key.partition("_")
    if kind == "threads" and count:
        return f"{count} thr"
    if kind == "tasks" and count:
        return f"{count} task{'s' * (count != '1')}"
    return key
