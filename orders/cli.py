"""The ``orders`` command: operate the service from a shell.

Every option that has an ``ORDERS_*`` environment variable names it in ``--help``. An
``OrdersError`` becomes one line on stderr and an exit code (see ``EXIT_CODES``).
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any, TypeVar

import click
from rich.console import Console
from rich.table import Table

from orders.bench import bench
from orders.config import Settings
from orders.domain import Order
from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderNotFound,
    OrdersError,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from orders.service import OrderService

#: Exit status by error, most specific first. 1 is left for unexpected failures.
EXIT_CODES: list[tuple[type[OrdersError], int]] = [
    (OrderConflict, 7),
    (InvalidInput, 2),
    (OrderNotFound, 3),
    (UnpaidOrderLimitReached, 4),
    (OrderClosed, 5),
    (OrderAlreadyPaid, 6),
    (StoreUnavailable, 8),
]

F = TypeVar("F", bound=Callable[..., Any])


def exit_code(error: OrdersError) -> int:
    return next((code for kind, code in EXIT_CODES if isinstance(error, kind)), 1)


class _Group(click.Group):
    """Turns an OrdersError anywhere below into one line and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OrdersError as error:
            click.echo(f"error: {error}", err=True)
            ctx.exit(exit_code(error))
        except click.BadParameter as error:
            # Click's own message echoes the raw value: say which parameter, not what.
            param = error.param
            name = param.opts[0] if param is not None and getattr(param, "opts", None) else "value"
            if param is not None and not getattr(param, "opts", None):
                name = param.human_readable_name
            kind = getattr(getattr(param, "type", None), "name", "value")
            click.echo(f"error: invalid {name}: not a valid {kind}", err=True)
            ctx.exit(2)
        except click.UsageError as error:
            first = error.format_message().splitlines()[0][:200]
            click.echo(f"error: {first}", err=True)
            ctx.exit(2)


class _State:
    def __init__(self, overrides: dict[str, Any]) -> None:
        self.overrides = overrides
        self._service: OrderService | None = None

    @property
    def settings(self) -> Settings:
        return Settings.from_env(**self.overrides)

    def service(self) -> OrderService:
        if self._service is None:
            from orders.bootstrap import build_service  # noqa: PLC0415

            self._service = build_service(self.settings)
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.engine.dispose()
            self._service.index.client.close()


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--home",
    envvar="ORDERS_HOME",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder of the embedded stores (SQLite file, local redis-server). [default: ./.orders]",
)
@click.option(
    "--database-url",
    envvar="ORDERS_DATABASE_URL",
    show_envvar=True,
    help="SQLAlchemy URL of the database. [default: SQLite file in the home folder]",
)
@click.option(
    "--redis-url",
    envvar="ORDERS_REDIS_URL",
    show_envvar=True,
    help="Redis URL. [default: an embedded redis-server for the home folder]",
)
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="ORDERS_LOG_FORMAT",
    show_envvar=True,
    help="json: one JSON object per line, for log collectors.",
)
@click.pass_context
def main(
    ctx: click.Context,
    home: Path | None,
    database_url: str | None,
    redis_url: str | None,
    verbose: int,
    log_format: str,
) -> None:
    """Unpaid-order limits and expiry on Redis and SQL."""
    # The service's own INFO lines (one per sweep that closed something) always show;
    # -v adds everyone else's INFO, -vv debug.
    level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
    handler = logging.StreamHandler()
    if log_format == "json":
        from orders.logs import JsonFormatter  # noqa: PLC0415

        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    logging.getLogger("orders").setLevel(min(level, logging.INFO))
    logging.getLogger("apscheduler").setLevel(max(level, logging.WARNING))
    overrides: dict[str, Any] = {}
    if home is not None:
        overrides["home"] = home
    if database_url:
        overrides["database_url"] = database_url
    if redis_url:
        overrides["redis_url"] = redis_url
    state = _State(overrides)
    ctx.obj = state
    ctx.call_on_close(state.close)


def _state(ctx: click.Context) -> _State:
    state: _State = ctx.find_object(_State)  # type: ignore[assignment]
    return state


# --- orders --------------------------------------------------------------------------


@main.command()
@click.argument("user")
@click.option("--ttl", "ttl_s", type=float, help="Seconds to pay. [env var: ORDERS_TTL_S]")
@click.option("--order-id", help="Your own id; retrying with it returns the same order.")
@click.option("--amount", help="Exact decimal amount, e.g. 19.90.")
@click.option("--currency", help="ISO 4217 code, e.g. EUR.")
@click.option(
    "--limit", type=int, help="Open unpaid orders allowed. [env var: ORDERS_UNPAID_LIMIT]"
)
@json_option
@click.pass_context
def create(
    ctx: click.Context,
    user: str,
    ttl_s: float | None,
    order_id: str | None,
    amount: str | None,
    currency: str | None,
    limit: int | None,
    as_json: bool,
) -> None:
    """Create an unpaid order for USER (refused at the user's limit: exit 4)."""
    service = _state(ctx).service()
    try:
        order = service.create_unpaid_order(
            user, order_id=order_id, ttl_s=ttl_s, limit=limit, amount=amount, currency=currency
        )
    except UnpaidOrderLimitReached as refused:
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "error": "limit_reached",
                        "limit": refused.limit,
                        "open_count": refused.open_count,
                        "retry_after_s": refused.retry_after_s,
                    }
                )
            )
        raise
    _print_order(order, as_json)


@main.command()
@click.argument("order_id", metavar="ORDER")
@click.option("--ref", "payment_ref", help="The payment provider's reference.")
@json_option
@click.pass_context
def pay(ctx: click.Context, order_id: str, payment_ref: str | None, as_json: bool) -> None:
    """Mark ORDER paid (closed or cancelled: exit 5, refund the payment)."""
    _print_order(_state(ctx).service().mark_paid(order_id, payment_ref=payment_ref), as_json)


@main.command()
@click.argument("order_id", metavar="ORDER")
@click.option("--reason", help="Why, kept with the order.")
@json_option
@click.pass_context
def cancel(ctx: click.Context, order_id: str, reason: str | None, as_json: bool) -> None:
    """Cancel unpaid ORDER."""
    _print_order(_state(ctx).service().cancel_order(order_id, reason=reason), as_json)


@main.command()
@click.argument("order_id", metavar="ORDER")
@json_option
@click.pass_context
def show(ctx: click.Context, order_id: str, as_json: bool) -> None:
    """Show ORDER."""
    _print_order(_state(ctx).service().get_order(order_id), as_json)


@main.command()
@click.argument("user")
@json_option
@click.pass_context
def user(ctx: click.Context, user: str, as_json: bool) -> None:
    """List USER's open unpaid orders with the time each has left."""
    found = _state(ctx).service().list_unpaid(user)
    if as_json:
        click.echo(json.dumps([order_to_json(o) for o in found]))
        return
    table = Table("order", "expires at (UTC)", "time left", "amount", title=f"open orders: {user}")
    for order in found:
        table.add_row(
            order.id,
            order.expires_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            f"{order.time_left_s:.1f} s",
            _amount(order),
        )
    Console().print(table)


# --- sweeping ------------------------------------------------------------------------


@main.command()
@click.option("--once", is_flag=True, default=True, help="One sweep, then exit (the default).")
@click.option("--dry-run", is_flag=True, help="Only count the orders a sweep would close.")
@click.option(
    "--batch-size",
    type=int,
    envvar="ORDERS_SWEEP_BATCH_SIZE",
    show_envvar=True,
    help="Orders closed per transaction.",
)
@json_option
@click.pass_context
def sweep(
    ctx: click.Context, once: bool, dry_run: bool, batch_size: int | None, as_json: bool
) -> None:
    """Close every unpaid order whose time is up, once."""
    service = _state(ctx).service()
    if dry_run:
        due = service.count_due()
        click.echo(json.dumps({"due": due}) if as_json else f"{due} orders due")
        return
    result = service.sweep_expired(batch_size=batch_size)
    if as_json:
        click.echo(json.dumps(_dataclass_json(result)))
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
    "--metrics-port",
    type=int,
    envvar="ORDERS_METRICS_PORT",
    show_envvar=True,
    help="Serve Prometheus metrics on this port (/metrics). [default: off]",
)
@click.option(
    "--metrics-addr",
    default="127.0.0.1",
    show_default=True,
    envvar="ORDERS_METRICS_ADDR",
    show_envvar=True,
    help="Address the metrics server listens on (0.0.0.0 for every interface).",
)
@click.pass_context
def scheduler(
    ctx: click.Context,
    interval_s: float | None,
    lease_ttl_s: float | None,
    batch_size: int | None,
    metrics_port: int | None,
    metrics_addr: str,
) -> None:
    """Run the sweeper until SIGTERM/SIGINT (several may run; one is active)."""
    from orders.sweeper import run_scheduler  # noqa: PLC0415

    if metrics_port is not None:
        from orders.metrics import serve  # noqa: PLC0415

        port = serve(metrics_port, metrics_addr)
        logging.getLogger("orders.metrics").info(
            "metrics on http://%s:%d/metrics", metrics_addr, port
        )

    run_scheduler(
        _state(ctx).service(),
        interval_s=interval_s,
        lease_ttl_s=lease_ttl_s,
        batch_size=batch_size,
    )


@main.command()
@click.argument("order_id", metavar="ORDER")
@click.argument("extra_s", metavar="SECONDS", type=float)
@json_option
@click.pass_context
def extend(ctx: click.Context, order_id: str, extra_s: float, as_json: bool) -> None:
    """Give unpaid ORDER SECONDS more to be paid (a payment is in progress, say)."""
    _print_order(_state(ctx).service().extend_order(order_id, extra_s), as_json)


@main.command()
@click.option(
    "--window",
    "window_s",
    type=int,
    default=3600,
    show_default=True,
    help="Close-lag percentiles over the orders closed in the last SECONDS.",
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
    """Counts by status, open orders, backlog, close lag and the expiries ahead."""
    from orders.stats import collect_stats  # noqa: PLC0415

    found = collect_stats(_state(ctx).service(), window_s=window_s, horizon_s=horizon_s)
    if as_json:
        click.echo(json.dumps(found.as_dict()))
        return
    table = Table("", "", title="orders")
    for status, count in found.by_status.items():
        table.add_row(status, str(count))
    table.add_row("open (unpaid, time left)", str(found.open_unpaid))
    table.add_row("backlog (due, not closed)", str(found.backlog))
    lag = (
        "none closed"
        if found.lag_p50_ms is None
        else f"p50 {found.lag_p50_ms} ms, p99 {found.lag_p99_ms} ms, max {found.lag_max_ms} ms"
    )
    table.add_row(f"close lag, last {window_s} s ({found.closed_in_window})", lag)
    console = Console()
    console.print(table)
    peak = max((count for _, count in found.upcoming), default=0) or 1
    console.print(f"expiries due in the next {horizon_s} s:")
    for start_s, count in found.upcoming:
        bar = "█" * round(30 * count / peak)
        console.print(f"  +{start_s:>5} s {bar} {count}")


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

    from orders.reconciler import reconcile  # noqa: PLC0415

    service = _state(ctx).service()
    with Progress(
        SpinnerColumn(),
        TextColumn("reconciling: {task.completed} users"),
        TimeElapsedColumn(),
        transient=True,
        disable=as_json,
    ) as progress:
        task = progress.add_task("reconcile", total=None)
        report = reconcile(
            service,
            user_id=user_id,
            dry_run=dry_run,
            on_progress=lambda users: progress.update(task, completed=users),
        )
    if as_json:
        click.echo(json.dumps(report.as_dict()))
        return
    verb = "would fix" if dry_run else "fixed"
    click.echo(
        f"{report.users} users checked; {verb}: {report.added} added, {report.rescored} "
        f"re-scored, {report.removed_terminal} removed (order no longer open), "
        f"{report.removed_expired} expired dropped; {report.kept_in_flight} in flight kept"
    )


# --- stores --------------------------------------------------------------------------


@main.group()
def db() -> None:
    """The database schema."""


@db.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Create or upgrade the schema to this version (Alembic upgrade head)."""
    from orders import migrate  # noqa: PLC0415
    from orders.bootstrap import build_engine  # noqa: PLC0415

    engine = build_engine(_state(ctx).settings)
    try:
        migrate.upgrade(engine)
        click.echo(f"schema at revision {migrate.current_revision(engine)}")
    finally:
        engine.dispose()


@db.command("current")
@click.pass_context
def db_current(ctx: click.Context) -> None:
    """Show the schema revision of the database and the newest one."""
    from orders import migrate  # noqa: PLC0415
    from orders.bootstrap import build_engine  # noqa: PLC0415

    engine = build_engine(_state(ctx).settings)
    try:
        click.echo(f"database: {migrate.current_revision(engine)}, code: {migrate.head_revision()}")
    finally:
        engine.dispose()


@main.group()
def server() -> None:
    """The embedded redis-server of the home folder."""


@server.command("status")
@click.pass_context
def server_status(ctx: click.Context) -> None:
    """Show whether the embedded redis-server runs (exit 1 if not)."""
    from orders.embedded import redis_status  # noqa: PLC0415

    home = _state(ctx).settings.home
    running = redis_status(home)
    if running is None:
        click.echo(f"no embedded redis-server runs for {home}")
        ctx.exit(1)
    click.echo(f"redis-server pid {running.pid} at {running.url}")


@server.command("stop")
@click.pass_context
def server_stop(ctx: click.Context) -> None:
    """Stop the embedded redis-server (its data stays in the home folder)."""
    from orders.embedded import stop_redis  # noqa: PLC0415

    home = _state(ctx).settings.home
    click.echo("stopped" if stop_redis(home) else f"no embedded redis-server ran for {home}")


@main.command()
@click.option("--fast", is_flag=True, help="Shorter timings (for tests).")
def demo(fast: bool) -> None:
    """Show the service at work on the embedded stores, then check the result."""
    from orders.demo import run_demo  # noqa: PLC0415

    sys.exit(run_demo(fast=fast))


main.add_command(bench)


# --- output --------------------------------------------------------------------------


def _amount(order: Order) -> str:
    if order.amount is None:
        return ""
    return f"{order.amount} {order.currency or ''}".strip()


def order_to_json(order: Order) -> dict[str, Any]:
    return {
        "id": order.id,
        "user_id": order.user_id,
        "status": order.status.value,
        "amount": None if order.amount is None else str(order.amount),
        "currency": order.currency,
        "created_at": order.created_at.isoformat(),
        "expires_at": order.expires_at.isoformat(),
        "paid_at": None if order.paid_at is None else order.paid_at.isoformat(),
        "closed_at": None if order.closed_at is None else order.closed_at.isoformat(),
        "close_reason": order.close_reason,
        "payment_ref": order.payment_ref,
        "expires_at_ms": order.expires_at_ms,
        "time_left_s": order.time_left_s,
        "metadata": dict(order.metadata),
    }


def _dataclass_json(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__dataclass_fields__}


def _print_order(order: Order, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(order_to_json(order), default=_json_default))
        return
    left = f", {order.time_left_s:.1f} s left" if order.is_open else ""
    amount = f", {_amount(order)}" if order.amount is not None else ""
    click.echo(f"{order.id}  user {order.user_id}  {order.status.value}{amount}{left}")


def _json_default(value: object) -> str:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(type(value).__name__)
