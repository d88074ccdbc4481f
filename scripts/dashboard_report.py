"""The report of scripts/dashboard_at_scale.py: the machine, the timings and every captured
statement with its plans, as markdown."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

import psycopg
from dashboard_fill import FAR


def short(sql: str, width: int = 150) -> str:
    one = re.sub(r"\s+", " ", sql)
    one = re.sub(r"CASE WHEN .* END AS upper_ms", "CASE ... END AS upper_ms", one)
    return one if len(one) <= width else one[: width - 3] + "..."


def trimmed(plan: str, width: int = 140) -> str:
    cut = [line if len(line) <= width else line[: width - 3] + "..." for line in plan.splitlines()]
    return "\n".join(cut)


def index_summary(plan: str) -> str:
    found = re.findall(
        r"((?:Index Only|Index|Bitmap Index) Scan(?: Backward)?)(?: using)? (\w+)", plan
    )
    seq = re.findall(r"Seq Scan on (\w+)", plan)
    parts = [f"{node} {index}" for node, index in dict.fromkeys(found)]
    parts += [f"**Seq Scan {table}**" for table in dict.fromkeys(seq)]
    return "; ".join(parts) or "none"


# --- the run --------------------------------------------------------------------------------


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with contextlib.suppress(OSError, IndexError, ValueError):
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.1f} GiB"
    return f"{platform.system()} {platform.release()}, {os.cpu_count()} CPUs ({cpu}), {mem} RAM"


def render(
    args: argparse.Namespace,
    steps: list[tuple[str, float]],
    counts: list[tuple[str, int]],
    timings: dict[str, dict[str, float]],
    plans: list[tuple[str, Any, str, str]],
    shown: dict[str, Any],
    damaged: dict[str, Any],
    behind_plan: str,
    **versions: str,
) -> str:
    import sqlalchemy  # noqa: PLC0415

    out = [
        f"# The dashboard with {args.orders:,} orders",
        "",
        f"Written by `python scripts/dashboard_at_scale.py --orders {args.orders} "
        f"--users {args.users} --runs {args.runs}` on {time.strftime('%Y-%m-%d')}.",
        "",
        f"- Machine: {machine()}; load average at the end "
        f"{os.getloadavg()[0]:.1f} (the machine is shared).",
        f"- PostgreSQL {versions['pg_version']} (fsync={versions['fsync']}, "
        "synchronous_commit=on, shared_buffers=128MB, unix socket); "
        f"redis-server {versions['redis_version']}; Python {platform.python_version()}, "
        f"SQLAlchemy {sqlalchemy.__version__}, psycopg {_psycopg_version()}.",
        "",
        "## Rows",
        "",
        "| table | rows |",
        "|---|---:|",
        *(f"| {name} | {n:,} |" if n >= 0 else f"| {name} | |" for name, n in counts),
        "",
        f"What the overview showed: `{_figures(shown)}`.",
        "",
        "## Loading (durable server: every commit synced)",
        "",
        "| step | seconds |",
        "|---|---:|",
        *(f"| {label} | {seconds:.1f} |" for label, seconds in steps),
        "",
        f"## Response time ({args.runs} runs each after 5 warm-up runs, warm cache, ms)",
        "",
        "| what | p50 | p95 | max | in SQL, p50 | SQL statements |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {what} | {t['p50']:.1f} | {t['p95']:.1f} | {t['max']:.1f} "
            f"| {t['sql_p50']:.1f} | {t['statements']:.0f} |"
            for what, t in timings.items()
        ),
        "",
        f"The last row: the same overview with a third consumer `{FAR}` whose cursor is at "
        "the start, so its lag is every event (a consumer added to an old database); its lag "
        "count, as sent, was:",
        "",
        "```",
        trimmed(behind_plan),
        "```",
        "",
        "The four calls took turns, run after run. *In SQL*: the time inside the driver's "
        "execute calls (sending, the server's work, the first reply), the rest is Python "
        "and Redis. Each `GET /api/overview` sent the overview's statements: no request was "
        "served from the cache.",
        "",
        "## The statements and their plans",
        "",
        "Every statement `read_overview` and `compare_user` sent (the latter for a user "
        f"whose index holds a member with no row and a paid order: {damaged['differences']} "
        "differences), captured on the engine. For each: the index it reads, then EXPLAIN "
        "(ANALYZE, BUFFERS) as sent (parameters bound: a custom plan), and of the generic "
        "plan (`plan_cache_mode = force_generic_plan`), the one a statement psycopg has "
        "prepared may settle on. Long lines are cut.",
        "",
        "| # | statement | custom plan reads | generic plan reads | ms (custom) |",
        "|---|---|---|---|---:|",
    ]
    for n, (sql, _params, custom, generic) in enumerate(plans, 1):
        ms = re.search(r"Execution Time: ([\d.]+) ms", custom)
        out.append(
            f"| {n} | `{short(sql, 90)}` | {index_summary(custom)} | {index_summary(generic)} "
            f"| {ms[1] if ms else '?'} |"
        )
    rows = dict(counts)
    scanned = sorted({t for _, _, c, g in plans for t in re.findall(r"Seq Scan on (\w+)", c + g)})
    if scanned:
        out += [
            "",
            "Sequential scans, only on: "
            + ", ".join(f"{table} ({rows.get(table, '?')} rows)" for table in scanned)
            + ". PostgreSQL rightly reads a page rather than an index there; "
            "tests/integration/test_dashboard_plans.py plans every statement with "
            "sequential scans off to see which index could serve it (event_retries: its "
            "primary key, read whole; event_cursors: none, list_consumers reads it with no "
            "ORDER BY an index could serve).",
        ]
    for n, (sql, params, custom, generic) in enumerate(plans, 1):
        out += [
            "",
            f"### {n}. `{short(sql)}`",
            "",
            f"Parameters: `{short(repr(params), 200)}`",
            "",
            "As sent:",
            "",
            "```",
            trimmed(custom),
            "```",
            "",
            "Generic plan:",
            "",
            "```",
            trimmed(generic),
            "```",
        ]
    return "\n".join(out) + "\n"


def _psycopg_version() -> str:
    return str(psycopg.__version__)


def _figures(shown: dict[str, Any]) -> str:
    stats = shown["sql"]["stats"]
    consumers = [
        f"{c['name']}: lag {c['lag_events']}, parked {c['parked']}, retrying {c['retrying']}"
        for c in shown["consumers"]
    ]
    return (
        f"by_status (window) {stats['by_status']}, open {stats['open_unpaid']}, backlog "
        f"{stats['backlog']}, lag p50/p99 {stats['lag_p50_ms']}/{stats['lag_p99_ms']} ms; "
        f"{'; '.join(consumers)}; redis keys {shown['redis']['keys']}"
    )
