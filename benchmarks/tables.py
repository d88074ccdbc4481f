"""The report as rich tables: the results, one section per figure, and the targets."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rich.table import Table

from benchmarks.concurrency import part_label
from benchmarks.figures import FIGURES
from benchmarks.holds import section as holds_section
from benchmarks.waiting import section as waiting_section


def _rate(s: Mapping[str, float]) -> tuple[str, str]:
    return f"{s['median']:,.0f}", f"{s['min']:,.0f} - {s['max']:,.0f}"


def _times(s: Mapping[str, float]) -> tuple[str, str]:
    return f"{s['median']:.2f} x", f"{s['min']:.2f} - {s['max']:.2f}"


class _Rows:
    """Adds the rows of the results table, in the shapes the figures share."""

    def __init__(self, table: Table, engine: str) -> None:
        self.table = table
        self.engine = engine

    def add(self, figure: str, measure: str, median: str, span: str = "", *more: str) -> None:
        self.table.add_row(figure, measure, median, span, *more)

    def variants(
        self, figure: str, part: Mapping[str, Any], label: Callable[[str], str] = str
    ) -> None:
        for name, v in part["variants"].items():
            self.add(figure, f"{label(name)} ops/s", *_rate(v["ops_s"]), f"{v['p50_ms']:.3f}",
                     f"{v['p99_ms']:.3f}", f"{v['cpu_us']:,.0f}")  # fmt: skip

    def ratio(self, figure: str, label: str, s: Mapping[str, float]) -> None:
        self.add(figure, label, *_times(s))

    def tasks(self, figure: str, fig: Mapping[str, Any]) -> None:
        """The async parts ``tasks_N``: the variant, then its ratio to each threaded one
        (the floors at ``floors_threads``), then ``task_scaling`` (reports without async
        figures have none of it)."""
        for n in fig.get("task_counts", []):
            part = fig[f"tasks_{n}"]
            name = f"{figure}, {part_label(f'tasks_{n}')}"
            self.variants(name, part)
            (mine,) = part["variants"]
            against = part_label(f"threads_{part['floors_threads']}")
            for key, s in part.items():
                if key.startswith(f"{mine}_vs_"):
                    self.ratio(name, f"{mine} / {key.removeprefix(f'{mine}_vs_')} ({against})", s)
            if "sql_statements" in part:
                self.add(name, f"{mine}: SQL statements", f"{part['sql_statements']:,}",
                         f"in {part['refusals']:,} refusals")  # fmt: skip
            self.table.add_section()
        for key, by_variant in fig.get("task_scaling", {}).items():
            n = key.removeprefix("tasks_").removesuffix("_vs_1")
            for variant, s in by_variant.items():
                self.ratio(f"{figure}, scaling", f"{variant}, {n} tasks / 1 task", s)
        if fig.get("task_scaling"):
            self.table.add_section()


def _create(rows: _Rows, fig: Mapping[str, Any]) -> None:
    for t in fig["thread_counts"]:
        part = fig[f"threads_{t}"]
        label = f"create, {t} thr"
        rows.variants(label, part)
        rows.ratio(label, "create / floor", part["create_vs_floor"])
        rows.ratio(label, "create / floor_core", part["create_vs_floor_core"])
        rows.ratio(label, "create / naive", part["create_vs_naive"])
        rows.table.add_section()
    for key, by_variant in fig["scaling"].items():
        n = key.removeprefix("threads_").removesuffix("_vs_1")
        for name, s in by_variant.items():
            rows.ratio("create, scaling", f"{name}, {n} thr / 1 thr", s)
    if fig["scaling"]:
        rows.table.add_section()
    rows.tasks("create", fig)


def _refusal(rows: _Rows, part: Mapping[str, Any]) -> None:
    rows.variants("refusal", part)
    rows.ratio("refusal", "refusal / evalsha", part["refusal_vs_evalsha"])
    rows.ratio("refusal", "refusal_given_id / evalsha", part["refusal_given_id_vs_evalsha"])
    for name, key in (
        ("refusal", "sql_statements"),
        ("refusal_given_id", "sql_statements_given_id"),
    ):
        rows.add("refusal", f"{name}: SQL statements", f"{part[key]:,}",
                 f"in {part['refusals']:,} refusals")  # fmt: skip
    rows.table.add_section()
    rows.tasks("refusal", part)


def _transition(name: str) -> Callable[[_Rows, Mapping[str, Any]], None]:
    def section(rows: _Rows, part: Mapping[str, Any]) -> None:
        rows.variants(name, part)
        rows.ratio(name, f"{name} / raw", part[f"{name}_vs_raw"])
        for other in ("stating_amount", "refused"):  # mark_paid's, from issue 27 on
            if f"{other}_vs_{name}" in part:
                rows.ratio(name, f"{other} / {name}", part[f"{other}_vs_{name}"])
        rows.table.add_section()

    return section


def _callers(rows: _Rows, fig: Mapping[str, Any]) -> None:
    """Each count's variants (threads, then tasks), then each ratio to its floor."""
    for key in [f"threads_{n}" for n in fig["thread_counts"]] + [
        f"tasks_{n}" for n in fig["task_counts"]
    ]:
        part, label = fig[key], f"callers, {part_label(key)}"
        rows.variants(label, part)
        against = part_label(f"threads_{part.get('floors_threads', part.get('threads'))}")
        for name, s in part.items():
            if "_vs_" in name:
                rows.ratio(label, f"{name.replace('_vs_', ' / ')} ({against})", s)
        rows.table.add_section()
    most = fig["concurrent_creates"]
    against = part_label(f"threads_{most['floor_threads']}")
    for way in ("threads", "tasks", "single"):
        shown = f"create, {most['callers']} {way} / floor ({against})"
        rows.ratio("callers, concurrent", shown, most[f"{way}_vs_floor"])
    rows.table.add_section()


def _sweep(rows: _Rows, part: Mapping[str, Any]) -> None:
    for label in ("table_1x", "table_10x", "table_1x_again"):
        again = " (again)" if label.endswith("again") else ""
        for b in part["batch_sizes"]:
            rows.add(f"sweep, {part[label]['rows']:,} rows{again}", f"batch {b} closes/s",
                     *_rate(part[label][f"batch_{b}"]["closes_s"]))  # fmt: skip
    rows.add("sweep", f"10x table cost (batch {part['best_batch']})", f"{part['cost_10x']:.2f} x")
    rows.add("sweep", "1x again / 1x (drift)", f"{part['drift_1x']:.2f} x")
    rows.table.add_section()


def _close_lag(rows: _Rows, part: Mapping[str, Any]) -> None:
    measure = f"{part['closed']:,} of {part['orders']:,} at {part['rate_s']:g}/s, ms"
    rows.add("close lag", measure, f"max {part['max_ms']:.0f}", "", f"{part['p50_ms']:.0f}",
             f"{part['p99_ms']:.0f}")  # fmt: skip
    rows.table.add_section()


def _redis_memory(rows: _Rows, part: Mapping[str, Any]) -> None:
    for k in (1, 3):
        s = part[f"per_user_{k}"]["bytes_per_order"]
        rows.add(f"redis memory, {k}/user", f"bytes per open order ({part['users']:,} users)",
                 f"{s['median']:.0f}", f"{s['min']:.0f} - {s['max']:.0f}")  # fmt: skip
        s = part[f"per_user_{k}"].get("bytes_per_order_in_flight")
        if s is not None:  # reports from before the admissions hash have none
            rows.add(f"redis memory, {k}/user",
                     f"the same within {part['window_s']:g} s of its admission",
                     f"{s['median']:.0f}", f"{s['min']:.0f} - {s['max']:.0f}")  # fmt: skip
    rows.table.add_section()


def _sql_admission(rows: _Rows, part: Mapping[str, Any]) -> None:
    rows.variants("sql admission", part)
    rows.ratio("sql admission", "refusal: redis / sql", part["refusal_redis_vs_sql"])
    rows.ratio("sql admission", "admission: create / sql", part["admission_create_vs_sql"])


_SECTIONS: dict[str, Callable[[_Rows, Mapping[str, Any]], None]] = {
    "create": _create,
    "refusal": _refusal,
    "mark_paid": _transition("mark_paid"),
    "cancel": _transition("cancel"),
    "callers": _callers,
    "sweep": _sweep,
    "close_lag": _close_lag,
    "redis_memory": _redis_memory,
    "sql_admission": _sql_admission,
    "holds": holds_section,
    "waiting": waiting_section,
}


def _loop(machine: Mapping[str, Any]) -> str:
    """The machine's Python speed, in the reports that measured it."""
    if "python_loop_ms" not in machine:
        return ""
    return f", a 10^6-step Python loop {machine['python_loop_ms']:.0f} ms"


def results_table(report: Mapping[str, Any]) -> Table:
    m = report["machine"]
    settings = ", ".join(f"{k} {v}" for k, v in m["sql_settings"].items())
    durable = {True: "durable", False: "NOT durable", None: "durability unknown"}[m["durable"]]
    table = Table(
        "figure",
        "measure",
        "median",
        "min - max",
        "p50 ms",
        "p99 ms",
        "client CPU us/op",
        title=(
            f"benchmarks on {m['sql_engine']} {m['sql_version']} ({durable}: {settings}) "
            f"+ redis {m['redis']} "
            f"({m['nproc']} cpus, load {m['load_average']:.1f}, python {m['python']}"
            f"{_loop(m)}), "
            f"{report['elapsed_s']:.0f} s"
        ),
    )
    rows = _Rows(table, report["engine"])
    for name in FIGURES:
        if name in report["figures"]:
            _SECTIONS[name](rows, report["figures"][name])
    return table


def targets_table(report: Mapping[str, Any]) -> Table:
    table = Table("target", "measured", "required", "verdict", "note", title="targets")
    for t in report["targets"]:
        colour = "green" if t["verdict"] == "pass" else "red"
        table.add_row(
            t["name"],
            f"{format_value(t['measured'], t['unit'])} {t['unit']}",
            f"{t['op']} {format_value(t['required'], t['unit'])} {t['unit']}",
            f"[{colour}]{t['verdict']}[/{colour}]",
            t["note"],
        )
    return table


def format_value(value: float, unit: str) -> str:
    """A figure as the tables show it: ratios to 2 decimals, rates and counts whole."""
    if unit == "x":
        return f"{value:.2f}"
    if unit == "ms":
        return f"{value:,.1f}"
    return f"{value:,.0f}"
