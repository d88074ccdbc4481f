"""Operations commands: sweep, scheduler, stats, reconcile, demo."""

from __future__ import annotations

import json
import logging
import sys
import time

import click

from orders.cli.app import cli_state, json_option, main, secure_cookie_option
from orders.cli.render import dataclass_json, print_stats


@main.command()
@click.option("--dry-run", is_flag=True, help="Only count the orders a sweep would close.")
@click.option(
    "--batch-size",
    type=int,
    envvar="ORDERS_SWEEP_BATCH_SIZE",
    show_envvar=True,
    help="Orders closed per transaction.",
)
@click.option(
    "--max-batches",
    type=int,
    help="Stop after this many batches, even if more orders are due. [default: no limit]",
)
@json_option
@click.pass_context
def sweep(
    ctx: click.Context,
    dry_run: bool,
    batch_size: int | None,
    max_batches: int | None,
    as_json: bool,
) -> None:
    """Close the unpaid orders whose time is up, once, then exit (orders scheduler repeats)."""
    state = cli_state(ctx)
    service = state.service()
    if dry_run:
        due = service.count_due()
        click.echo(json.dumps({"due": due}) if as_json else f"{due} orders due")
        return
    # The close events name the operator who ran it, not the scheduler's sweeper.
    result = service.sweep_expired(
        batch_size=batch_size, max_batches=max_batches, actor=state.actor
    )
    if as_json:
        click.echo(json.dumps(dataclass_json(result)))
    else:
        click.echo(f"closed {result.closed} orders in {result.batches} batches")


@main.command()
@click.option(
    "--interval",
    "interval_s",
    type=float,
    envvar="ORDERS_SWEEP_INTERVAL_S",
    show_envvar=True,
    help="Longest time between sweeps, seconds. [default: 1]",
)
@click.option(
    "--lease-ttl",
    "lease_ttl_s",
    type=float,
    envvar="ORDERS_LEASE_TTL_S",
    show_envvar=True,
    help="Seconds a standby waits before taking over from a dead scheduler. [default: 5]",
)
@click.option(
    "--batch-size",
    type=int,
    envvar="ORDERS_SWEEP_BATCH_SIZE",
    show_envvar=True,
    help="Orders closed per transaction. [default: 500]",
)
@click.option(
    "--ops-port",
    type=int,
    envvar="ORDERS_OPS_PORT",
    show_envvar=True,
    help="Serve /metrics, /healthz, /readyz and the dashboard on this port (0: any free "
    "one, logged). [default: off]",
)
@click.option(
    "--ops-addr",
    default="127.0.0.1",
    show_default=True,
    envvar="ORDERS_OPS_ADDR",
    show_envvar=True,
    help="Address the pages listen on; anything but loopback needs ORDERS_DASHBOARD_TOKEN "
    "(the dashboard is among them).",
)
@secure_cookie_option
@click.pass_context
def scheduler(
    ctx: click.Context,
    interval_s: float | None,
    lease_ttl_s: float | None,
    batch_size: int | None,
    ops_port: int | None,
    ops_addr: str,
    secure_cookie: bool,
) -> None:
    """Run the sweeper until SIGTERM/SIGINT (several may run; one is active)."""
    from orders.scheduler.health import SchedulerHealth  # noqa: PLC0415
    from orders.scheduler.process import run_scheduler  # noqa: PLC0415

    health = SchedulerHealth()
    served = None
    token = None
    if ops_port is not None:
        from orders.dashboard import Dashboard, OperatorApp, bind, serve, token_from_env  # noqa: PLC0415

        token = token_from_env()
        # Served before the stores are reached: a bad or taken port ends the command at once.
        # The probes answer "starting" until the scheduler runs; the dashboard's paths are
        # 404 until its service is built.
        served = serve(OperatorApp(health), bind(ops_addr, ops_port, field="ops_port", token=token))
        logging.getLogger("orders.health").info(
            "metrics, health and dashboard on %s/ (/metrics, /healthz, /readyz)", served.url
        )
    try:
        service = cli_state(ctx).service(long_running=True)
        if served is not None:
            served.app.dashboard = Dashboard(service, token=token, secure_cookie=secure_cookie)
        run_scheduler(
            service,
            interval_s=interval_s,
            lease_ttl_s=lease_ttl_s,
            batch_size=batch_size,
            health=health,
        )
    finally:
        if served is not None:
            served.close()


@main.command()
@click.option(
    "--window",
    "window_s",
    type=int,
    default=3600,
    show_default=True,
    help="Paid, cancelled and closed counts and close-lag percentiles over the last SECONDS.",
)
@click.option(
    "--ahead",
    "horizon_s",
    type=int,
    default=600,
    show_default=True,
    help="Chart the expiries due in the next SECONDS.",
)
@json_option
@click.pass_context
def stats(ctx: click.Context, window_s: int, horizon_s: int, as_json: bool) -> None:
    """Unpaid orders now; paid, cancelled, closed and the close lag in a window; expiries ahead."""
    from orders.sql.stats import collect_stats  # noqa: PLC0415

    service = cli_state(ctx).service()
    found = collect_stats(service.engine, service.clock, window_s=window_s, horizon_s=horizon_s)
    if as_json:
        click.echo(json.dumps(found.as_dict()))
        return
    print_stats(found, window_s, horizon_s)


@main.command("reconcile")
@click.option("--user", "user_id", help="Only this user's key.")
@click.option("--dry-run", is_flag=True, help="Report what is wrong; change nothing.")
@json_option
@click.pass_context
def reconcile_command(
    ctx: click.Context, user_id: str | None, dry_run: bool, as_json: bool
) -> None:
    """Make the Redis index equal to SQL (after Redis lost data, or any time)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    service = cli_state(ctx).service()
    started = time.monotonic()
    with Progress(
        SpinnerColumn(),
        TextColumn("reconciling: {task.completed:,.0f} users, {task.fields[rate]} users/s"),
        TimeElapsedColumn(),
        transient=True,
        # On a terminal only: a pipe or a log file gets the summary alone.
        disable=as_json or not sys.stdout.isatty(),
    ) as progress:
        task = progress.add_task("reconcile", total=None, rate="-")

        def show(users: int) -> None:
            rate = users / max(time.monotonic() - started, 1e-3)
            progress.update(task, completed=users, rate=f"{rate:,.0f}")

        report = service.reconcile(user_id=user_id, dry_run=dry_run, on_progress=show)
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    verb = "would fix" if dry_run else "fixed"
    click.echo(
        f"{report.users} users checked; {verb}: {report.added} added, {report.rescored} "
        f"re-scored, {report.removed_terminal} removed (order no longer open), "
        f"{report.removed_expired} expired dropped, {report.removed_abandoned} left by a "
        f"failed create removed; {report.kept_in_flight} in flight kept"
    )


@main.command()
@click.option("--fast", is_flag=True, help="Shorter timings (for tests).")
def demo(fast: bool) -> None:
    """Show the service at work on the embedded stores, then check the result."""
    from orders.cli.demo import run_demo  # noqa: PLC0415

    sys.exit(run_demo(fast=fast))
