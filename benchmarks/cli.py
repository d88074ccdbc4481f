"""``python -m benchmarks``: the lab's command, its options, and the refusal of a busy database.

It runs on the stores the ``ORDERS_*`` variables name (ORDERS_DATABASE_URL, ORDERS_REDIS_URL,
else the embedded ones under ORDERS_HOME), and ends an error as ``orders`` does: one line
and its exit code.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from sqlalchemy import select

from benchmarks.compare import compare_lines, load_report
from benchmarks.figures import FIGURES
from benchmarks.measure import Sizes
from benchmarks.plot import require_matplotlib, write_plots
from benchmarks.report import progress_units, run_bench
from benchmarks.tables import results_table, targets_table
from orders.cli.app import in_one_line
from orders.config import Settings
from orders.errors import OrdersError
from orders.sql.failures import sql_errors
from orders.sql.models import orders_table


class _LabCommand(click.Command):
    """The command, with ``orders``'s one-line errors and exit codes."""

    def invoke(self, ctx: click.Context) -> Any:
        return in_one_line(ctx, super().invoke)


def _database_holds_orders(service_settings: Any) -> bool:
    """Whether the configured database holds any order (a missing schema holds none)."""
    from orders.bootstrap import build_engine  # noqa: PLC0415

    engine = build_engine(service_settings)
    try:
        with sql_errors(), engine.connect() as conn:
            return conn.scalar(select(orders_table.c.id).limit(1)) is not None
    except OrdersError:
        return False
    finally:
        engine.dispose()


def _parse_figures(only: str | None) -> list[str]:
    if not only:
        return list(FIGURES)
    chosen = [name.strip() for name in only.split(",") if name.strip()]
    if not chosen or any(name not in FIGURES for name in chosen):
        # The message names the choices, never the value given (it may be anything).
        raise click.UsageError(f"--only takes figures from: {', '.join(FIGURES)}")
    return [name for name in FIGURES if name in chosen]


def _parse_batches(text: str) -> tuple[int, ...]:
    problem = "--batch-sizes takes comma-separated integers from 1 to 10000"
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.UsageError(problem) from None
    if not sizes or any(not 1 <= b <= 10_000 for b in sizes):
        raise click.UsageError(problem)
    return sizes


@click.command("bench", cls=_LabCommand)
@click.option("--quick", is_flag=True, help="Small sizes: a smoke test in well under a minute.")
@click.option(
    "--yes",
    is_flag=True,
    help="Run even on a database holding orders (the bench touches only its own).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 64),
    default=4,
    show_default=True,
    help="Threads of the multi-threaded create figure (on PostgreSQL also 8).",
)
@click.option(
    "--tasks",
    type=click.IntRange(1, 1024),
    default=64,
    show_default=True,
    help="Tasks on one event loop of the async create and refusal figures (also 1).",
)
@click.option("--reps", type=click.IntRange(1, 100), help="Repetitions. [default: 5; quick 3]")
@click.option(
    "--ops",
    type=click.IntRange(10, 1_000_000),
    help="Operations per variant and repetition. [default: 1000; quick 150]",
)
@click.option(
    "--sweep-rows",
    type=click.IntRange(1, 10_000_000),
    help="Unpaid orders in the sweep's table (x10 for the large one). [default: 50000; quick 5000]",
)
@click.option(
    "--sweep-due",
    type=click.IntRange(1, 1_000_000),
    help="How many of them are due. [default: 10000; quick 1000]",
)
@click.option(
    "--batch-sizes", default="100,500,2000", show_default=True, help="Sweep batch sizes to compare."
)
@click.option(
    "--lag-rate",
    type=click.FloatRange(1, 100_000, min_open=False),
    help="Expiries per second of the close-lag and waiting figures. [default: 1000; quick 200]",
)
@click.option(
    "--lag-seconds",
    type=click.FloatRange(0.1, 3600),
    help="How long they keep expiring. [default: 10; quick 2]",
)
@click.option(
    "--memory-users",
    type=click.IntRange(1, 10_000_000),
    help="Users of the Redis memory figure. [default: 10000; quick 1000]",
)
@click.option("--only", help=f"Comma-separated figures to run, of: {', '.join(FIGURES)}.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report as JSON (benchmarks/README.md)."
)
@click.option(
    "--report",
    "saved",
    metavar="REPORT.json",
    help="Do not run: show (or --compare, or --plot) this saved --json report instead.",
)
@click.option(
    "--compare",
    metavar="OLD.json",
    help="Then print each headline figure of this earlier --json report beside the new one.",
)
@click.option(
    "--plot",
    metavar="DIR",
    help="Then draw the figures into DIR (needs matplotlib, in the dev extra).",
)
@click.option("--plot-format", type=click.Choice(["png", "svg"]), default="png", show_default=True)
@click.pass_context
def bench(
    ctx: click.Context,
    quick: bool,
    yes: bool,
    threads: int,
    tasks: int,
    reps: int | None,
    ops: int | None,
    sweep_rows: int | None,
    sweep_due: int | None,
    batch_sizes: str,
    lag_rate: float | None,
    lag_seconds: float | None,
    memory_users: int | None,
    only: str | None,
    as_json: bool,
    saved: str | None,
    compare: str | None,
    plot: str | None,
    plot_format: str,
) -> None:
    """The lab: the service on the configured stores against raw floors and the naive way.

    The bench adds users bench-<random>-..., their orders and Redis keys, and removes them
    all at the end. It refuses a database that already holds orders unless --yes. With
    --report it runs nothing (the run options are then ignored).
    """
    if plot is not None:
        require_matplotlib()  # before a run of minutes, not after it
    old = None if compare is None else load_report(compare, "--compare")
    if saved is not None:
        report = load_report(saved, "--report")
    else:
        report = _run(ctx, _sizes(ctx.params), _parse_figures(only), yes)
    # With --json, stdout holds the one JSON document; what follows it goes to stderr.
    _show(report, as_json)
    if old is not None:
        for line in compare_lines(old, report):
            click.echo(line, err=as_json)
    if plot is not None:
        for path in write_plots(report, Path(plot), plot_format):
            click.echo(f"wrote {path}", err=as_json)


#: The size options that default to the full or the --quick size.
_SIZE_OPTIONS = (
    "reps", "ops", "sweep_rows", "sweep_due", "lag_rate", "lag_seconds", "memory_users"
)  # fmt: skip


def _sizes(params: dict[str, Any]) -> Sizes:
    """The run's sizes from the command's options."""
    base = Sizes.quick() if params["quick"] else Sizes()
    given = {name: params[name] for name in _SIZE_OPTIONS if params[name] is not None}
    sizes = replace(
        base,
        threads=params["threads"],
        tasks=params["tasks"],
        batch_sizes=_parse_batches(params["batch_sizes"]),
        **given,
    )
    return replace(sizes, warmup=min(sizes.warmup, sizes.ops))


def _run(ctx: click.Context, sizes: Sizes, figures: list[str], yes: bool) -> dict[str, Any]:
    from orders.bootstrap import build_service  # noqa: PLC0415

    settings = Settings.from_env()
    if settings.redis_cluster:
        # Its floors and memory figures are one server's (one raw EVALSHA, INFO memory).
        click.echo(
            "error: the bench measures one Redis server: run it with a single node's "
            "URL and without ORDERS_REDIS_CLUSTER",
            err=True,
        )
        ctx.exit(2)
    if not yes and _database_holds_orders(settings):
        click.echo(
            "error: the database already holds orders; the bench adds and removes only its "
            "own, pass --yes to run it there anyway",
            err=True,
        )
        ctx.exit(2)
    service = build_service(settings, startup_warnings=False)
    ctx.call_on_close(service.close)
    progress = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    engine = service.engine.dialect.name
    with progress:
        total = sum(progress_units(sizes, name, engine) for name in figures)
        task = progress.add_task("starting", total=total)
        return run_bench(
            service,
            sizes,
            figures,
            step=lambda units: progress.advance(task, units),
            status=lambda text: progress.update(task, description=text),
        )


def _show(report: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 132))
    console.print(results_table(report))
    console.print(targets_table(report))
    for note in report["notes"]:
        console.print(f"note: {note}")
    left = report["left_behind"]
    if any(left.values()):
        console.print(f"[red]left behind[/red]: {left}")
