"""``orders limit``: a user's own unpaid limit, set, shown and cleared, and its history."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.render import user_limit_text, user_limit_to_json, utc_text
from orders.domain import ms_to_datetime
from orders.errors import InvalidInput

if TYPE_CHECKING:  # SQLAlchemy stays unloaded until a command needs it (``orders --help``)
    from orders.sql.user_limits import UserLimit

#: "-1" is the N of ``orders limit set USER -1`` (refused as a limit), not an option.
NUMBER_ARGUMENTS = {"ignore_unknown_options": True}


def limit_number(text: str) -> int:
    """N as given on the command line: a whole number (its range is the service's rule)."""
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise InvalidInput("limit", "must be an integer") from None


def echo_limit(shown: UserLimit, as_json: bool) -> None:
    click.echo(json.dumps(user_limit_to_json(shown)) if as_json else user_limit_text(shown))


@main.group("limit")
def limit_group() -> None:
    """A user's own limit of unpaid orders, in place of the settings' one."""


@limit_group.command("set", context_settings=NUMBER_ARGUMENTS)
@click.argument("user")
@click.argument("n", metavar="N")
@json_option
@click.pass_context
def set_command(ctx: click.Context, user: str, n: str, as_json: bool) -> None:
    """Let USER hold at most N unpaid orders (0 to 1000000; 0: none at all). Orders held
    already stay; a lowered limit refuses creates until USER is under it."""
    state = cli_state(ctx)
    limit = limit_number(n)  # before the service is built: bad N is exit 2, nothing opened
    shown = state.service().set_user_limit(user, limit, actor=state.actor)
    echo_limit(shown, as_json)


@limit_group.command("show")
@click.argument("user")
@json_option
@click.pass_context
def show_command(ctx: click.Context, user: str, as_json: bool) -> None:
    """The limit that applies to USER, whether it is USER's own, and who set it when."""
    echo_limit(cli_state(ctx).service().user_limit(user), as_json)


@limit_group.command("clear")
@click.argument("user")
@json_option
@click.pass_context
def clear_command(ctx: click.Context, user: str, as_json: bool) -> None:
    """Remove USER's own limit: the settings' one applies again."""
    state = cli_state(ctx)
    echo_limit(state.service().clear_user_limit(user, actor=state.actor), as_json)


@limit_group.command("history")
@click.argument("user")
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many.")
@json_option
@click.pass_context
def history_command(ctx: click.Context, user: str, limit: int, as_json: bool) -> None:
    """Who set or cleared USER's own limit, and when: newest first."""
    changes = cli_state(ctx).service().user_limit_history(user, limit=limit)
    if as_json:
        rows = [
            {
                "user_id": c.user_id,
                "limit": c.limit,
                "changed_at": ms_to_datetime(c.changed_at_ms).isoformat(),
                "changed_at_ms": c.changed_at_ms,
                "actor_kind": None if c.actor is None else c.actor.kind.value,
                "actor": None if c.actor is None else c.actor.name,
            }
            for c in changes
        ]
        click.echo(json.dumps(rows))
        return
    if not changes:
        click.echo(f"{user}: no own limit was ever set")
    for c in changes:
        what = "cleared" if c.limit is None else f"set to {c.limit}"
        by = "" if c.actor is None else f" by {c.actor}"
        click.echo(f"{utc_text(c.changed_at_ms)} UTC  {c.user_id}: {what}{by}")
