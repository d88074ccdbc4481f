"""The ``orders`` command group: global options, the shared state, and error mapping.

Every option that has an ``ORDERS_*`` environment variable names it in ``--help``. An
``OrdersError`` raised anywhere below becomes one line on stderr and an exit code (see
``EXIT_CODES``); the commands themselves live in sibling modules.
"""

from __future__ import annotations

import getpass
import importlib
import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from orders import errors
from orders.config import Settings
from orders.domain import ACTOR_MAX_LENGTH, Actor, ActorKind

if TYPE_CHECKING:
    from orders.service import OrderService

#: Exit status by error class. An error takes the code of the nearest class in its MRO,
#: so a subclass (OrderConflict is an InvalidInput) keeps its own code whatever the order
#: here. 1 is left for unexpected failures.
EXIT_CODES: dict[type[errors.OrdersError], int] = {
    errors.InvalidInput: 2,
    errors.OrderNotFound: 3,
    errors.UnpaidOrderLimitReached: 4,
    errors.OrderClosed: 5,
    errors.OrderAlreadyPaid: 6,
    errors.OrderConflict: 7,
    errors.StoreUnavailable: 8,
    errors.SchemaConflict: 9,
    errors.PaymentMismatch: 10,
    errors.CreateRateLimited: 11,
    errors.RefundOwed: 12,
    errors.UnknownUser: 3,  # not found, as an order
    errors.UnknownResource: 3,  # likewise
    errors.WaitingEntryNotFound: 3,  # likewise
    errors.HoldRefused: 13,
}

#: Commands whose module is imported only when the command runs: name -> ("module:attr",
#: the one line ``orders --help`` shows). The benchmark is a package no other command needs.
LAZY_COMMANDS = {
    "bench": (
        "orders.cli.bench_command:bench",
        "Measure the service on the configured stores against raw floors and the naive way.",
    ),
    "dashboard": (
        "orders.cli.dashboard_command:dashboard",
        "Serve the read-only live dashboard (loopback unless a token is set).",
    ),
}

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")


def exit_code(error: errors.OrdersError) -> int:
    return next((EXIT_CODES[kind] for kind in type(error).__mro__ if kind in EXIT_CODES), 1)


def error_line(error: errors.OrdersError) -> str:
    """The one line an error prints. A refused payment says that its refund was recorded
    (and where), so whoever ran ``orders pay`` knows the money is not lost track of."""
    line = f"error: {error}"
    if (
        isinstance(error, errors.OrderClosed | errors.OrderAlreadyPaid | errors.PaymentMismatch)
        and error.refusal
    ):
        line += f"; refund owed: event {error.refusal[1]}, see orders payments refused"
    return line


def default_actor_name() -> str:
    """``user@host`` of whoever runs the command (``unknown@host`` when the user has no
    name), cut to the longest name an event holds."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError, ImportError):  # no LOGNAME/USER and no passwd entry
        user = "unknown"
    return f"{user}@{socket.gethostname()}".strip()[:ACTOR_MAX_LENGTH].rstrip()


def parameter_error_line(error: click.BadParameter) -> str:
    """Click's own message echoes the raw value: say which parameter, not what."""
    param = error.param
    opts = getattr(param, "opts", None)
    if param is None:
        name = "value"
    elif opts:
        name = opts[0]
    else:
        name = param.human_readable_name
    kind = getattr(getattr(param, "type", None), "name", "value")
    return f"error: invalid {name}: not a valid {kind}"


class OrdersGroup(click.Group):
    """Maps errors to one line and an exit code, and loads the lazy commands on demand."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        lazy = LAZY_COMMANDS.get(cmd_name)
        if lazy is None:
            return super().get_command(ctx, cmd_name)
        target, summary = lazy
        if ctx.meta.get("orders.listing"):  # --help lists it: the summary is enough
            return click.Command(cmd_name, short_help=summary)
        module_name, attr = target.split(":")
        command: click.Command = getattr(importlib.import_module(module_name), attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        ctx.meta["orders.listing"] = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            ctx.meta.pop("orders.listing", None)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        # The group's own options (ORDERS_LOG_FORMAT, say) are parsed here, before invoke:
        # without this, click prints its multi-line usage text with the raw value.
        try:
            return super().parse_args(ctx, args)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as error:
            click.echo(usage_error_line(error), err=True)
            ctx.exit(2)

    def invoke(self, ctx: click.Context) -> Any:
        return in_one_line(ctx, super().invoke)


def in_one_line(ctx: click.Context, invoke: Callable[[click.Context], R]) -> R:
    """``invoke(ctx)``, an ``OrdersError`` or a usage error below it ending as one line on
    stderr and its exit code (the benchmark lab's command ends its errors so too)."""
    try:
        return invoke(ctx)
    except errors.OrdersError as error:
        click.echo(error_line(error), err=True)
        ctx.exit(exit_code(error))
    except click.UsageError as error:
        click.echo(usage_error_line(error), err=True)
        ctx.exit(2)


def usage_error_line(error: click.UsageError) -> str:
    if isinstance(error, click.BadParameter):
        return parameter_error_line(error)
    first = error.format_message().splitlines()[0][:200]
    return f"error: {first}"


class CliState:
    """What every command of one invocation shares: the settings, one service, and the
    operator that the events it writes name."""

    def __init__(self, overrides: dict[str, Any], actor: Actor) -> None:
        self.overrides = overrides
        self.actor = actor
        self._service: OrderService | None = None

    @property
    def settings(self) -> Settings:
        return Settings.from_env(**self.overrides)

    def service(self, *, long_running: bool = False) -> OrderService:
        """The service; only a long-running one warns about the Redis server's settings
        (every one-shot command would repeat it, and its stderr is for one error line)."""
        if self._service is None:
            from orders.bootstrap import build_service  # noqa: PLC0415

            self._service = build_service(self.settings, startup_warnings=long_running)
        return self._service

    def close(self) -> None:
        if self._service is not None:
            self._service.close()


def cli_state(ctx: click.Context) -> CliState:
    state = ctx.find_object(CliState)
    if state is None:  # pragma: no cover - every command runs below main
        raise click.UsageError("orders: no command state")
    return state


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def secure_cookie_option(func: F) -> F:
    """The dashboard's login cookie ``Secure`` flag, for every command that serves it."""
    return click.option(
        "--secure-cookie/--no-secure-cookie",
        default=False,
        show_default=True,
        envvar="ORDERS_DASHBOARD_SECURE_COOKIE",
        show_envvar=True,
        help="Mark the dashboard's login cookie Secure: set it when browsers reach the page "
        "over HTTPS.",
    )(func)


def configure_logging(verbose: int, log_format: str) -> None:
    # The service's own INFO lines (the scheduler's summary every 10 s at most, lease
    # changes, outages) always show; -v adds everyone else's INFO, -vv debug (the
    # per-sweep lines among them).
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


@click.group(cls=OrdersGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="orders", prog_name="orders", message="%(prog)s %(version)s")
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
@click.option(
    "--actor",
    metavar="NAME",
    help="Who the events this command writes name, as an operator (at most "
    f"{ACTOR_MAX_LENGTH} characters). [default: user@host of this shell]",
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
    actor: str | None,
    verbose: int,
    log_format: str,
) -> None:
    """Unpaid-order limits and expiry on Redis and SQL."""
    configure_logging(verbose, log_format)
    # Checked here, before any command opens a store: a bad name is exit 2, nothing written.
    operator = Actor.of(default_actor_name() if actor is None else actor, ActorKind.OPERATOR)
    overrides: dict[str, Any] = {}
    if home is not None:
        overrides["home"] = home
    if database_url:
        overrides["database_url"] = database_url
    if redis_url:
        overrides["redis_url"] = redis_url
    state = CliState(overrides, operator)
    ctx.obj = state
    ctx.call_on_close(state.close)
