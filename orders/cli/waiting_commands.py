"""``orders waiting``: a resource's waiting list shown, an entry added or taken out."""

from __future__ import annotations

import json
from datetime import datetime

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.render import utc_text
from orders.cli.resource_commands import NUMBER_ARGUMENTS, whole_number
from orders.errors import InvalidInput
from orders.inventory import WaitingEntry


def parse_until(text: str) -> datetime:
    """``--until``: ISO 8601 (the time zone is checked with the other input)."""
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(
            "until", "must be an ISO 8601 time with a time zone, e.g. 2026-12-24T18:00+01:00"
        ) from None


def entry_text(entry: WaitingEntry) -> str:
    """``#7 anna: 2 of ev:1, waiting since 2026-11-26 14:40:00 UTC, until ...``."""
    until = "" if entry.until_ms is None else f", until {utc_text(entry.until_ms)} UTC"
    served = "" if entry.order_id is None else f", order {entry.order_id}"
    return (
        f"#{entry.id} {entry.user_id}: {entry.quantity} of {entry.resource_id}, "
        f"{entry.status.value} (since {utc_text(entry.created_at_ms)} UTC{until}){served}"
    )


def echo_entry(entry: WaitingEntry, as_json: bool) -> None:
    click.echo(json.dumps(entry.as_dict()) if as_json else entry_text(entry))


@main.group("waiting")
def waiting_group() -> None:
    """Waiting lists: users queued for a resource, served first come, first served."""


@waiting_group.command("show")
@click.argument("resource_id", metavar="RESOURCE_ID")
@json_option
@click.pass_context
def show_command(ctx: click.Context, resource_id: str, as_json: bool) -> None:
    """The entries waiting for RESOURCE_ID, first come first."""
    queue = cli_state(ctx).service().waiting(resource_id)
    if as_json:
        click.echo(json.dumps([entry.as_dict() for entry in queue]))
        return
    if not queue:
        click.echo(f"nobody waits for {resource_id}")
    for entry in queue:
        click.echo(entry_text(entry))


@waiting_group.command("add", context_settings=NUMBER_ARGUMENTS)
@click.argument("user_id", metavar="USER")
@click.argument("resource_id", metavar="RESOURCE_ID")
@click.option("--quantity", metavar="N", default="1", show_default=True, help="Units wanted.")
@click.option("--until", metavar="ISO", help="Give up at this time (ISO 8601 with a zone).")
@json_option
@click.pass_context
def add_command(
    ctx: click.Context,
    user_id: str,
    resource_id: str,
    quantity: str,
    until: str | None,
    as_json: bool,
) -> None:
    """Queue USER for RESOURCE_ID (the entry already waiting, if any); units free now
    serve the queue at once."""
    state = cli_state(ctx)
    units = whole_number("quantity", quantity)
    deadline = None if until is None else parse_until(until)
    entry = state.service().wait_for(user_id, resource_id, units, until=deadline, actor=state.actor)
    echo_entry(entry, as_json)


@waiting_group.command("leave", context_settings=NUMBER_ARGUMENTS)
@click.argument("entry_id", metavar="ENTRY_ID")
@json_option
@click.pass_context
def leave_command(ctx: click.Context, entry_id: str, as_json: bool) -> None:
    """Take entry ENTRY_ID out of its queue."""
    entry = cli_state(ctx).service().leave_waiting(whole_number("entry_id", entry_id))
    echo_entry(entry, as_json)
