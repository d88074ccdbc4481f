"""``orders payments``: the refunds owed for refused payments, and marking one handled."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.render import handled_text, print_refusals_table, refusal_to_json, utc_text
from orders.domain import Clock
from orders.errors import InvalidInput
from orders.validation import duration_ms


def since_ms(text: str, clock: Clock) -> int:
    """``--since``: ``30m``, ``2h``, ``7d`` (or ``90s``) before now, or an ISO-8601 time (UTC
    unless it names its offset); in ms since the epoch, never before 1970. The clock is
    read only for a duration, after the text is found well formed."""
    back_ms = duration_ms(text)
    if back_ms is not None:
        return max(0, clock() - back_ms)
    try:
        at = datetime.fromisoformat(text.strip())
        if at.tzinfo is None:
            at = at.replace(tzinfo=UTC)
        return max(0, int(at.timestamp() * 1000))
    except (ValueError, OverflowError) as exc:
        problem = "must be a duration (30m, 2h, 7d) or an ISO-8601 time"
        raise InvalidInput("since", problem) from exc


@main.group("payments")
def payments_group() -> None:
    """Refused payments: the refunds owed, and which were handled."""


@payments_group.command("refused")
@click.option(
    "--since",
    metavar="WHEN",
    help="Only those refused since then: 30m, 2h, 7d ago, or an ISO-8601 time (UTC unless "
    "it names an offset).",
)
@click.option("--pending", is_flag=True, help="Only the refunds nobody marked handled.")
@click.option("--limit", type=int, default=100, show_default=True, help="At most this many.")
@json_option
@click.pass_context
def refused_command(
    ctx: click.Context, since: str | None, pending: bool, limit: int, as_json: bool
) -> None:
    """Refused payments, oldest first: the refund each is owed, or who handled it when."""
    state = cli_state(ctx)
    # Parsed before the service is built: a malformed --since is exit 2 with nothing opened.
    from_ms = None if since is None else since_ms(since, lambda: state.service().now_ms())
    found = state.service().refused_payments(since_ms=from_ms, pending_only=pending, limit=limit)
    if as_json:
        click.echo(json.dumps([refusal_to_json(r) for r in found]))
        return
    scope = "refunds owed" if pending else "refused payments"
    title = scope if from_ms is None else f"{scope} since {utc_text(from_ms)} UTC"
    print_refusals_table(found, title)
    if len(found) == limit:  # there may be more, and the newest are the ones left out
        click.echo(f"the oldest {limit} shown: --since or --limit for the others")


@payments_group.command("handled")
@click.argument("order_id", metavar="ORDER")
@click.option("--ref", "payment_ref", help="The refused payment's reference (none: no --ref).")
@json_option
@click.pass_context
def handled_command(
    ctx: click.Context, order_id: str, payment_ref: str | None, as_json: bool
) -> None:
    """Mark the refund of ORDER's refused payment handled (no such refusal: exit 2). A
    refund already marked keeps its first handler."""
    state = cli_state(ctx)
    refusal = state.service().mark_refund_handled(order_id, payment_ref, actor=state.actor)
    if as_json:
        click.echo(json.dumps(refusal_to_json(refusal)))
        return
    ref = f" (ref {refusal.payment_ref})" if refusal.payment_ref else ""
    click.echo(f"refund of {refusal.order_id}{ref} marked handled: {handled_text(refusal)}")
