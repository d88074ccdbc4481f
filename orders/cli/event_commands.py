"""``orders events``: consumers and their lag, parked events, requeue and discard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.render import dataclass_json, utc_text

if TYPE_CHECKING:
    from sqlalchemy import Engine

#: The last error as shown in the parked table (the stored text is one line already).
ERROR_WIDTH = 60


@contextmanager
def opened_engine(ctx: click.Context) -> Iterator[Engine]:
    from orders.bootstrap import build_engine  # noqa: PLC0415

    engine = build_engine(cli_state(ctx).settings)
    try:
        yield engine
    finally:
        engine.dispose()


@main.group("events")
def events_group() -> None:
    """Event consumers: lag, retrying and parked events; requeue or discard parked ones."""


@events_group.command("consumers")
@json_option
@click.pass_context
def consumers_command(ctx: click.Context, as_json: bool) -> None:
    """Every consumer: position, lag (events and oldest wait), retrying and parked."""
    from orders.events.admin import list_consumers  # noqa: PLC0415

    with opened_engine(ctx) as engine:
        found = list_consumers(engine)
    if as_json:
        rows = [dataclass_json(c) | {"position": dataclass_json(c.position)} for c in found]
        click.echo(json.dumps(rows))
        return
    click.echo(f"{'consumer':<40} {'position':>10} {'lag':>8} {'oldest':>10} retrying parked")
    for c in found:
        oldest = "" if c.oldest_unread_age_ms is None else f"{c.oldest_unread_age_ms / 1000:.1f} s"
        click.echo(
            f"{c.name:<40} {c.position.event_id:>10} {c.lag_events:>8} {oldest:>10} "
            f"{c.retrying:>8} {c.parked:>6}"
        )


@events_group.command("parked")
@click.option("--consumer", help="Only this consumer's parked events.")
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many.")
@json_option
@click.pass_context
def parked_command(ctx: click.Context, consumer: str | None, limit: int, as_json: bool) -> None:
    """Events a consumer gave up on (oldest first): requeue or discard them."""
    from orders.events.admin import list_parked  # noqa: PLC0415

    with opened_engine(ctx) as engine:
        found = list_parked(engine, consumer=consumer, limit=limit)
    if as_json:
        click.echo(json.dumps([dataclass_json(p) for p in found]))
        return
    click.echo("consumer  event  order  kind  attempts  parked at (UTC)  last error")
    for p in found:
        error = p.last_error or ""
        if len(error) > ERROR_WIDTH:
            error = error[: ERROR_WIDTH - 1] + "…"
        click.echo(
            f"{p.consumer}  {p.event_id}  {p.order_id or '-'}  {p.kind or '-'}  {p.attempts}  "
            f"{utc_text(p.parked_at_ms)}  {error}"
        )


def parked_action(name: str, help_text: str, done: str) -> click.Command:
    """``orders events NAME CONSUMER EVENT_ID``: ``orders.events.admin.act_on_parked``."""

    @events_group.command(name, help=help_text)
    @click.argument("consumer")
    @click.argument("event_id", type=int)
    @click.pass_context
    def command(ctx: click.Context, consumer: str, event_id: int) -> None:
        from orders.events import admin as event_admin  # noqa: PLC0415

        action = event_admin.ParkedAction(name)
        with opened_engine(ctx) as engine:
            event_admin.act_on_parked(
                engine, action, consumer, event_id, actor=cli_state(ctx).actor
            )
        click.echo(f"{done} event {event_id} of {consumer}")

    return command


requeue_command = parked_action(
    "requeue", "Retry a parked event again: attempts reset, due now.", "requeued"
)
discard_command = parked_action(
    "discard", "Forget a parked event (the event itself stays in order_events).", "discarded"
)
