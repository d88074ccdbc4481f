"""``orders resource``: counted resources (stock, coupons, time slots) and named units
(seats) set, shown and listed."""

from __future__ import annotations

import json
from typing import TextIO

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.render import resource_text, resource_to_json, units_text
from orders.errors import InvalidInput
from orders.inventory import Resource

#: "-1" is the N of ``--capacity -1`` (refused as a capacity by the service's rule).
NUMBER_ARGUMENTS = {"ignore_unknown_options": True}


def whole_number(name: str, text: str) -> int:
    """A number as given on the command line: a whole number (its range is the service's
    rule), checked before the service is built, so a bad one opens nothing."""
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise InvalidInput(name, "must be an integer") from None


def echo_resource(
    shown: Resource, as_json: bool, units: dict[str, list[str]] | None = None
) -> None:
    if as_json:
        click.echo(json.dumps(resource_to_json(shown, units)))
        return
    click.echo(resource_text(shown))
    if units is not None:
        click.echo(units_text(units))


@main.group("resource")
def resource_group() -> None:
    """Counted resources that unpaid orders hold: stock, coupons, time slots."""


@resource_group.command("set", context_settings=NUMBER_ARGUMENTS)
@click.argument("resource_id", metavar="ID")
@click.option("--capacity", "capacity", metavar="N", required=True, help="Units in all.")
@click.option("--per-user", "per_user", metavar="M", help="At most M units per user.")
@json_option
@click.pass_context
def set_command(
    ctx: click.Context, resource_id: str, capacity: str, per_user: str | None, as_json: bool
) -> None:
    """Create resource ID or change its capacity (0 or more) and per-user cap (1 to N).
    A capacity lowered below what is held and sold takes nothing back: new holds wait."""
    state = cli_state(ctx)
    units = whole_number("capacity", capacity)
    cap = None if per_user is None else whole_number("per_user", per_user)
    shown = state.service().set_capacity(resource_id, units, per_user=cap, actor=state.actor)
    echo_resource(shown, as_json)


@resource_group.command("show")
@click.argument("resource_id", metavar="ID")
@json_option
@click.pass_context
def show_command(ctx: click.Context, resource_id: str, as_json: bool) -> None:
    """Resource ID's capacity, units held, sold and free, and its per-user cap; for named
    units, which are free, held and sold."""
    service = cli_state(ctx).service()
    shown = service.resource(resource_id)
    echo_resource(shown, as_json, service.units(resource_id) if shown.named else None)


@resource_group.command("units")
@click.argument("resource_id", metavar="ID")
@click.argument("names", metavar="NAME...", nargs=-1)
@click.option(
    "--file", "from_file", type=click.File("r"), help="The names, one per line ('-': stdin)."
)
@json_option
@click.pass_context
def units_command(
    ctx: click.Context,
    resource_id: str,
    names: tuple[str, ...],
    from_file: TextIO | None,
    as_json: bool,
) -> None:
    """Give resource ID named units (seats, numbered spaces), in the order a create picks
    them; its capacity becomes their count. A unit held or sold cannot be removed."""
    given = list(names)
    if from_file is not None:
        given += [line.strip() for line in from_file if line.strip()]
    state = cli_state(ctx)
    service = state.service()
    shown = service.set_units(resource_id, given, actor=state.actor)
    echo_resource(shown, as_json, service.units(resource_id))


@resource_group.command("list")
@click.option("--after", metavar="ID", help="Start after this id (the last of a page).")
@click.option("--limit", metavar="N", default="100", show_default=True, help="At most N.")
@json_option
@click.pass_context
def list_command(ctx: click.Context, after: str | None, limit: str, as_json: bool) -> None:
    """Resources by id, a page at a time."""
    count = whole_number("limit", limit)
    found = cli_state(ctx).service().resources(after=after, limit=count)
    if as_json:
        click.echo(json.dumps([resource_to_json(r) for r in found]))
        return
    if not found:
        click.echo("no resources")
    for shown in found:
        click.echo(resource_text(shown))
