"""Commands on orders and users: create, pay, cancel, extend (one order, or by filter:
:mod:`orders.cli.bulk_commands`), show, user."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import click

from orders.cli.app import cli_state, json_option, main
from orders.cli.bulk_commands import DEFAULT_BATCH_SIZE, filter_given, filter_options, run_bulk
from orders.cli.render import order_to_json, print_order, print_orders_table
from orders.errors import CreateRateLimited, HoldRefused, InvalidInput, UnpaidOrderLimitReached
from orders.validation import ON_LIMIT_CHOICES


@main.command()
@click.argument("user")
@click.option("--ttl", "ttl_s", type=float, help="Seconds to pay. [env var: ORDERS_TTL_S]")
@click.option("--order-id", help="Your own id; retrying with it returns the same order.")
@click.option("--amount", help="Exact decimal amount, e.g. 19.90.")
@click.option("--currency", help="ISO 4217 code, e.g. EUR.")
@click.option(
    "--limit", type=int, help="Open unpaid orders allowed. [env var: ORDERS_UNPAID_LIMIT]"
)
@click.option(
    "--on-limit",
    type=click.Choice(ON_LIMIT_CHOICES),
    help="At the limit: refuse, or cancel the oldest unpaid order. [env var: ORDERS_ON_LIMIT]",
)
@click.option("--policy", help="A named expiry policy of ORDERS_POLICIES.")
@click.option(
    "--expires-at",
    "expires_at",
    help="An absolute deadline instead of --ttl, ISO 8601 with a time zone "
    "(2026-12-24T18:00:00+01:00).",
)
@click.option(
    "--hold",
    "holds",
    multiple=True,
    metavar="RESOURCE=UNITS",
    help="Units of a counted resource the order holds (repeat for a cart), e.g. sku:42=2.",
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
    on_limit: str | None,
    policy: str | None,
    expires_at: str | None,
    holds: tuple[str, ...],
    as_json: bool,
) -> None:
    """Create an unpaid order for USER (refused at the user's limit: exit 4; at the create
    rate, ORDERS_CREATE_RATE: exit 11; a hold refused: exit 13)."""
    state = cli_state(ctx)
    try:
        order = state.service().create_unpaid_order(
            user,
            order_id=order_id,
            ttl_s=ttl_s,
            limit=limit,
            amount=amount,
            currency=currency,
            actor=state.actor,
            on_limit=on_limit,
            policy=policy,
            expires_at=None if expires_at is None else parse_deadline(expires_at),
            holds=parse_holds(holds),
        )
    except (UnpaidOrderLimitReached, CreateRateLimited, HoldRefused) as refused:
        if as_json:
            click.echo(json.dumps(refusal_json(refused)))
        raise
    print_order(order, as_json)


def parse_deadline(text: str) -> datetime:
    """``--expires-at``: ISO 8601 (the time zone is checked with the other input)."""
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(
            "expires_at", "must be an ISO 8601 time with a time zone, e.g. 2026-12-24T18:00+01:00"
        ) from None


def parse_holds(given: tuple[str, ...]) -> dict[str, int | list[str]] | None:
    """``--hold RESOURCE=UNITS`` (repeated) as ``holds=``: UNITS a number, or the names of
    named units separated by commas (checked by the service; a resource named twice is
    refused)."""
    if not given:
        return None
    holds: dict[str, int | list[str]] = {}
    for text in given:
        resource_id, sep, units = text.partition("=")
        if not sep or not units.strip():
            raise InvalidInput(
                "holds", "each --hold must be RESOURCE=UNITS or RESOURCE=NAME,NAME, e.g. sku:42=2"
            )
        if resource_id in holds:
            raise InvalidInput("holds", "names a resource twice")
        holds[resource_id] = int(units) if units.strip().isdigit() else units.split(",")
    return holds


def refusal_json(
    refused: UnpaidOrderLimitReached | CreateRateLimited | HoldRefused,
) -> dict[str, object]:
    """A refused create as ``--json`` prints it: the limit's, the create rate's or a
    hold's."""
    if isinstance(refused, HoldRefused):
        return {
            "error": "hold_refused",
            "resource_id": refused.resource_id,
            "reason": refused.reason,
            "requested": refused.requested,
            "free": refused.free,
            "units": list(refused.units),
        }
    if isinstance(refused, CreateRateLimited):
        detail: dict[str, object] = {"error": "rate_limited", "window_s": refused.window_s}
    else:
        detail = {"error": "limit_reached", "open_count": refused.open_count}
    return {**detail, "limit": refused.limit, "retry_after_s": refused.retry_after_s}


@main.command()
@click.argument("order_id", metavar="ORDER")
@click.option("--ref", "payment_ref", help="The payment provider's reference.")
@click.option("--amount", help="The amount paid, exact decimal; checked against the order's.")
@click.option("--currency", help="ISO 4217 code of the amount paid, e.g. EUR.")
@json_option
@click.pass_context
def pay(
    ctx: click.Context,
    order_id: str,
    payment_ref: str | None,
    amount: str | None,
    currency: str | None,
    as_json: bool,
) -> None:
    """Mark ORDER paid. Refused, with the refund recorded (orders payments refused): closed
    or cancelled exit 5, paid under another --ref exit 6, --amount or --currency not the
    order's exit 10 (the order stays unpaid)."""
    state = cli_state(ctx)
    paid = state.service().mark_paid(
        order_id, payment_ref=payment_ref, amount=amount, currency=currency, actor=state.actor
    )
    print_order(paid, as_json)


@main.command()
@click.argument("order_id", metavar="[ORDER]", required=False)
@click.option("--reason", help="Why, kept with the order.")
@filter_options
@json_option
@click.pass_context
def cancel(ctx: click.Context, /, order_id: str | None, **options: Any) -> None:
    """Cancel unpaid ORDER; or, without ORDER, every unpaid order the filter matches
    (--user, --created-before, --expiring-before, --metadata: all must hold; at least one
    is required). A payment that commits first wins: that order is skipped, and counted."""
    state = cli_state(ctx)
    if single_order(order_id, options):
        assert order_id is not None
        cancelled = state.service().cancel_order(
            order_id, reason=options["reason"], actor=state.actor
        )
        print_order(cancelled, options["as_json"])
        return
    run_bulk(ctx, "cancel", options, None)


@main.command()
@click.argument("args", metavar="[ORDER] SECONDS", nargs=-1, required=True)
@filter_options
@json_option
@click.pass_context
def extend(ctx: click.Context, /, args: tuple[str, ...], **options: Any) -> None:
    """Give unpaid ORDER SECONDS more to be paid (a payment is in progress, say); or,
    without ORDER, every open order the filter matches (as for cancel), each within its
    policy's maximum lifetime (one it would take past it is refused, and counted)."""
    if len(args) > 2:
        raise InvalidInput("arguments", "must be [ORDER] SECONDS")
    order_id = args[0] if len(args) == 2 else None
    extra_s = parse_seconds(args[-1])
    state = cli_state(ctx)
    if single_order(order_id, options):
        assert order_id is not None
        extended = state.service().extend_order(order_id, extra_s, actor=state.actor)
        print_order(extended, options["as_json"])
        return
    run_bulk(ctx, "extend", options, extra_s)


def single_order(order_id: str | None, options: dict[str, Any]) -> bool:
    """ORDER alone: the single-order command; a filter alone: the bulk one; both or
    neither: InvalidInput (a bulk action never means every order)."""
    if order_id is not None and filter_given(options):
        raise InvalidInput("arguments", "give ORDER or a filter option, not both")
    if order_id is None and not filter_given(options):
        raise InvalidInput(
            "filter",
            "is empty: give ORDER, or --user, --created-before, --expiring-before or --metadata",
        )
    if order_id is not None and (options["dry_run"] or options["batch_size"] != DEFAULT_BATCH_SIZE):
        raise InvalidInput("arguments", "--dry-run and --batch-size go with a filter, not ORDER")
    return order_id is not None


def parse_seconds(text: str) -> float:
    """SECONDS as click's float type reads it."""
    try:
        return float(text)
    except ValueError:
        raise InvalidInput("seconds", "must be a number of seconds") from None


@main.command()
@click.argument("order_id", metavar="ORDER")
@json_option
@click.pass_context
def show(ctx: click.Context, order_id: str, as_json: bool) -> None:
    """Show ORDER."""
    print_order(cli_state(ctx).service().get_order(order_id), as_json)


@main.command()
@click.argument("user")
@json_option
@click.pass_context
def user(ctx: click.Context, user: str, as_json: bool) -> None:
    """List USER's open unpaid orders with the time each has left."""
    found = cli_state(ctx).service().list_unpaid(user)
    if as_json:
        click.echo(json.dumps([order_to_json(o) for o in found]))
        return
    print_orders_table(user, found)
