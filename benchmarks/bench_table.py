"""The benchmark table of benchmarks/README.md, from two saved lab reports (``--json``).

    .venv/bin/python benchmarks/bench_table.py /tmp/bench/sqlite.json /tmp/bench/postgresql.json

Prints one Markdown row per target (the measured value of each engine, its bound, and
pass or miss), then the headline rates, then (reports with the ``callers`` figure) the
README's table of create, mark_paid and refusal at 1, 8 and 64 callers beside their
floors. Every number comes from the reports as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _fmt(value: float, unit: str) -> str:
    if unit == "x":
        return f"{value:.2f}"
    if value >= 1000:
        return f"{value:,.0f}"
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _targets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["id"]: t for t in report["targets"]}


def _rate(report: dict[str, Any], *path: str) -> str:
    node: Any = report["figures"]
    for key in path:
        if key not in node:
            return "-"
        node = node[key]
    return f"{node['ops_s']['median']:,.0f}"


def main(sqlite_path: str, postgresql_path: str) -> None:
    reports = [json.loads(Path(p).read_text()) for p in (sqlite_path, postgresql_path)]
    print("| target | SQLite | PostgreSQL | bound |")
    print("| --- | --- | --- | --- |")
    order = list(dict.fromkeys(t["id"] for r in reports for t in r["targets"]))
    for target_id in order:
        cells = []
        name = bound = ""
        for report in reports:
            target = _targets(report).get(target_id)
            if target is None:
                cells.append("-")
                continue
            name = target["name"]
            bound = f"{target['op']} {_fmt(target['required'], target['unit'])} {target['unit']}"
            mark = "" if target["verdict"] == "pass" else " (miss)"
            cells.append(_fmt(target["measured"], target["unit"]) + mark)
        print(f"| {name} | {cells[0]} | {cells[1]} | {bound} |")
    print()
    print("| ops/s, 1 thread (median) | SQLite | PostgreSQL |")
    print("| --- | --- | --- |")
    rows = [
        ("create", ("create", "threads_1", "variants", "create")),
        ("floor: EVALSHA + raw driver (order + event, one commit)",
         ("create", "threads_1", "variants", "floor")),
        ("the same through SQLAlchemy Core", ("create", "threads_1", "variants", "floor_core")),
        ("naive: ZCARD, ZADD, INSERT", ("create", "threads_1", "variants", "naive")),
        ("create, 8 threads", ("create", "threads_8", "variants", "create")),
        ("create, asyncio, 1 task", ("create", "tasks_1", "variants", "create_async")),
        ("create, asyncio, 64 tasks on one loop",
         ("create", "tasks_64", "variants", "create_async")),
        ("refusal at the limit", ("refusal", "variants", "refusal")),
        ("raw EVALSHA that refuses", ("refusal", "variants", "evalsha")),
        ("refusal with the caller's order id", ("refusal", "variants", "refusal_given_id")),
        ("refusal, asyncio, 1 task", ("refusal", "tasks_1", "variants", "refusal_async")),
        ("refusal, asyncio, 64 tasks on one loop",
         ("refusal", "tasks_64", "variants", "refusal_async")),
        ("mark_paid", ("mark_paid", "variants", "mark_paid")),
        ("raw UPDATE + event, one commit", ("mark_paid", "variants", "raw")),
        ("cancel", ("cancel", "variants", "cancel")),
    ]  # fmt: skip
    for label, path in rows:
        print(f"| {label} | {_rate(reports[0], *path)} | {_rate(reports[1], *path)} |")
    callers_table(reports)


#: The callers table's rows: label, the part's kind (threads or tasks), the variant.
CALLER_ROWS = (
    ("create", "threads", "create"),
    ("create, asyncio tasks", "tasks", "create_async"),
    ("create, nothing combined (ORDERS_COMBINE_CREATES=false)", "threads", "create_single"),
    ("floor: EVALSHA + raw insert of order and event", "threads", "floor"),
    ("mark_paid", "threads", "mark_paid"),
    ("mark_paid, asyncio tasks", "tasks", "mark_paid_async"),
    (
        "mark_paid, nothing combined (ORDERS_COMBINE_TRANSITIONS=false)",
        "threads",
        "mark_paid_single",
    ),
    ("floor: raw UPDATE + event", "threads", "raw"),
    ("refusal at the limit", "threads", "refusal"),
    ("refusal, asyncio tasks", "tasks", "refusal_async"),
    ("floor: raw EVALSHA that refuses", "threads", "evalsha"),
)


def callers_table(reports: list[dict[str, Any]]) -> None:
    """ops/s (median) and p99 ms per caller, at 1, 8 and 64 callers, on each engine."""
    found = [r["figures"].get("callers") for r in reports]
    if not all(found):
        return
    names = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
    heads = [f"{names.get(r['engine'], r['engine'])}, {n}" for r in reports for n in (1, 8, 64)]
    print()
    print("| ops/s (p99 ms), by callers | " + " | ".join(heads) + " |")
    print("| --- |" + " --- |" * len(heads))
    for label, kind, variant in CALLER_ROWS:
        cells = []
        for fig in found:
            for n in fig["thread_counts"]:
                v = fig[f"{kind}_{n}"]["variants"].get(variant)
                cells.append(
                    "-" if v is None else f"{v['ops_s']['median']:,.0f} ({v['p99_ms']:.1f})"
                )
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
