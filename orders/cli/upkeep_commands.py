"""Keeping the service through incidents and years: ``orders pause`` / ``resume`` /
``pauses`` (the incident pause), ``orders prune`` (retention) and ``orders erase-user``."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

import click

from orders.cli.app import cli_state, json_option, main
from orders.domain import ms_to_datetime
from orders.validation import check_age_ms

if TYPE_CHECKING:  # SQLAlchemy stays unloaded until a command needs it (``orders --help``)
    from orders.rules.erasure import Erasure
    from orders.sql.pauses import Pause


def pause_to_json(pause: Pause) -> dict[str, Any]:
    return {
        "id": pause.id,
        "reason": pause.reason,
        "started_at": pause.started_at.isoformat(),
        "actor": None if pause.actor is None else str(pause.actor),
        "resumed_at": _iso(pause.resumed_at_ms),
        "ended_at": _iso(pause.ended_at_ms),
        "shifted": pause.shifted,
        "open": pause.is_open,
    }


def pause_text(pause: Pause) -> str:
    since = pause.started_at.strftime("%Y-%m-%d %H:%M:%S UTC")
    by = "" if pause.actor is None else f" by {pause.actor}"
    if pause.is_open and pause.resumed_at_ms is None:
        return f"paused since {since}{by}: {pause.reason}"
    if pause.is_open:
        return f"resuming (interrupted? run orders resume again): paused {since}{by}"
    length_s = pause.length_ms(0) / 1000
    return (
        f"pause {pause.id} from {since}{by} lasted {length_s:.1f} s: "
        f"{pause.shifted} unpaid orders moved later ({pause.reason})"
    )


def _iso(ms: int | None) -> str | None:
    return None if ms is None else ms_to_datetime(ms).isoformat()


@main.command()
@click.option("--reason", required=True, help="Why: shown to every operator and on the dashboard.")
@json_option
@click.pass_context
def pause(ctx: click.Context, reason: str, as_json: bool) -> None:
    """Hold every close by expiry until orders resume (creates, payments and cancels go on)."""
    state = cli_state(ctx)
    done = state.service().operations.pause(reason, actor=state.actor)
    click.echo(json.dumps(pause_to_json(done)) if as_json else pause_text(done))


@main.command()
@click.option(
    "--batch-size", type=int, default=500, show_default=True, help="Orders moved per transaction."
)
@json_option
@click.pass_context
def resume(ctx: click.Context, batch_size: int, as_json: bool) -> None:
    """End the pause: every unpaid order gets the paused time back, then the sweep runs."""
    state = cli_state(ctx)
    done = state.service().operations.resume(actor=state.actor, batch_size=batch_size)
    click.echo(json.dumps(pause_to_json(done)) if as_json else pause_text(done))


@main.command()
@json_option
@click.pass_context
def pauses(ctx: click.Context, as_json: bool) -> None:
    """The latest pauses, newest first (the open one, if any, on top)."""
    found = cli_state(ctx).service().operations.recent_pauses()
    if as_json:
        click.echo(json.dumps([pause_to_json(p) for p in found]))
    elif not found:
        click.echo("never paused")
    else:
        for p in found:
            click.echo(pause_text(p))


@main.command()
@click.option(
    "--older-than",
    "older_than",
    required=True,
    help="Age of the last transition, e.g. 90d, 12h (units s, m, h, d).",
)
@click.option("--dry-run", is_flag=True, help="Count what would go; delete nothing.")
@click.option(
    "--batch-size", type=int, default=500, show_default=True, help="Orders per transaction."
)
@json_option
@click.pass_context
def prune(
    ctx: click.Context, older_than: str, dry_run: bool, batch_size: int, as_json: bool
) -> None:
    """Delete paid, cancelled and closed orders older than --older-than, with their events;
    never one with a refund owed or an event a consumer has not read, retries or parked."""
    age_s = check_age_ms("older_than", older_than) / 1000
    done = cli_state(ctx).service().operations.prune(age_s, dry_run=dry_run, batch_size=batch_size)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "orders": done.orders,
                    "events": done.events,
                    "batches": done.batches,
                    "cutoff": ms_to_datetime(done.cutoff_ms).isoformat(),
                    "dry_run": done.dry_run,
                    "held_by": list(done.held_by),
                    "passed_by": list(done.passed_by),
                }
            )
        )
        return
    verb = "would delete" if done.dry_run else "deleted"
    cutoff = ms_to_datetime(done.cutoff_ms).strftime("%Y-%m-%d %H:%M:%S UTC")
    click.echo(f"{verb} {done.orders} orders and {done.events} events last changed before {cutoff}")
    if done.held_by:
        click.echo(f"kept for consumers behind, still reading: {', '.join(done.held_by)}")
    if done.passed_by:
        click.echo(f"passed consumers stopped for that long: {', '.join(done.passed_by)}")


def erasure_text(done: Erasure) -> str:
    if done.already:
        return f"already erased as {done.pseudonym}; {done.redis_keys} Redis keys deleted now"
    limit = ", own limit deleted" if done.limit_removed else ""
    return (
        f"erased as {done.pseudonym}: {done.orders} orders ({done.cancelled} cancelled), "
        f"{done.events} events, {done.refusals} refused payments{limit}; "
        f"{done.redis_keys} Redis keys deleted"
    )


@main.command("erase-user")
@click.argument("user")
@json_option
@click.pass_context
def erase_user(ctx: click.Context, user: str, as_json: bool) -> None:
    """Erase USER: unpaid orders cancelled, the id replaced by a keyed pseudonym
    (ORDERS_ERASURE_KEY), metadata and payment references cleared. Refused while a refund
    of the user's is owed; safe to run again."""
    state = cli_state(ctx)
    done = state.service().erase_user(user, actor=state.actor)
    click.echo(json.dumps(dataclasses.asdict(done)) if as_json else erasure_text(done))
