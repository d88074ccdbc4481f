"""How the CLI prints orders and reports: one line for people, JSON for scripts."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import click

from orders.domain import Order, ms_to_datetime
from orders.inventory import Resource
from orders.policies import NEVER_EXPIRES_MS

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from orders.sql.refusals import PaymentRefusal
    from orders.sql.stats import Stats
    from orders.sql.user_limits import UserLimit
else:
    # rich is imported by the first table printed, not with this module: the commands that
    # print one line (``orders show``...) never load it. Each name builds rich's class.

    def _deferred(module: str, name: str) -> Callable[..., Any]:
        def build(*args: Any, **kwargs: Any) -> Any:
            return getattr(importlib.import_module(module), name)(*args, **kwargs)

        return build

    Console = _deferred("rich.console", "Console")
    Table = _deferred("rich.table", "Table")


def user_limit_text(shown: UserLimit) -> str:
    """``u1: limit 2 (own, set 2026-11-26 14:40:00 UTC by operator:anna@host)``."""
    if not shown.own or shown.updated_at_ms is None:
        return f"{shown.user_id}: limit {shown.limit} (the settings' limit)"
    by = "" if shown.actor is None else f" by {shown.actor}"
    return (
        f"{shown.user_id}: limit {shown.limit} (own, set {utc_text(shown.updated_at_ms)} UTC{by})"
    )


def user_limit_to_json(shown: UserLimit) -> dict[str, Any]:
    return {
        "user_id": shown.user_id,
        "limit": shown.limit,
        "own": shown.own,
        "updated_at": None if shown.updated_at is None else shown.updated_at.isoformat(),
        "actor_kind": None if shown.actor is None else shown.actor.kind.value,
        "actor": None if shown.actor is None else shown.actor.name,
    }


def resource_text(shown: Resource) -> str:
    """``sku:42: capacity 10, held 2, sold 1, free 7, per user 2 (set 2026-11-26 14:40:00 UTC)``."""
    cap = "" if shown.per_user is None else f", per user {shown.per_user}"
    when = "" if shown.updated_at_ms is None else f" (set {utc_text(shown.updated_at_ms)} UTC)"
    return (
        f"{shown.id}: capacity {shown.capacity}, held {shown.held}, sold {shown.sold}, "
        f"free {shown.free}{cap}{when}"
    )


def resource_to_json(shown: Resource, units: dict[str, list[str]] | None = None) -> dict[str, Any]:
    at_ms = shown.updated_at_ms
    updated_at = None if at_ms is None else ms_to_datetime(at_ms).isoformat()
    named = {} if units is None else {"units": units}
    return {**shown.as_dict(), "updated_at": updated_at, **named}


def units_text(units: dict[str, list[str]]) -> str:
    """A named resource's units, one line per state: ``free (3): A-1 A-2 A-5``."""
    return "\n".join(
        f"  {state} ({len(names)}): {' '.join(names)}" for state, names in units.items()
    )


def amount_text(order: Order | PaymentRefusal) -> str:
    if order.amount is None:
        return ""
    return f"{order.amount} {order.currency or ''}".strip()


def utc_text(at_ms: int) -> str:
    return datetime.fromtimestamp(at_ms / 1000, UTC).strftime("%Y-%m-%d %H:%M:%S")


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
        "policy": order.policy,
        "holds": dict(order.holds),
    }


def refusal_to_json(refusal: PaymentRefusal) -> dict[str, Any]:
    handled_by = refusal.handled_by
    position = refusal.position
    return {
        "order_id": refusal.order_id,
        "user_id": refusal.user_id,
        "payment_ref": refusal.payment_ref,
        "reason": refusal.reason.value,
        "amount": None if refusal.amount is None else str(refusal.amount),
        "currency": refusal.currency,
        "refused_at": ms_to_datetime(refusal.refused_at_ms).isoformat(),
        "refused_at_ms": refusal.refused_at_ms,
        # None: no event (``unknown_order``: no order to carry one).
        "event": None if position is None else {"txid": position[0], "event_id": position[1]},
        "handled": refusal.handled,
        "handled_at": (
            None
            if refusal.handled_at_ms is None
            else ms_to_datetime(refusal.handled_at_ms).isoformat()
        ),
        "handled_at_ms": refusal.handled_at_ms,
        "handled_by": (
            None if handled_by is None else {"kind": handled_by.kind.value, "name": handled_by.name}
        ),
    }


def handled_text(refusal: PaymentRefusal) -> str:
    """Who marked the refund handled and when, or "owed"."""
    if refusal.handled_at_ms is None:
        return "owed"
    return f"{refusal.handled_by or 'unknown'}, {utc_text(refusal.handled_at_ms)}"


def print_refusals_table(found: list[PaymentRefusal], title: str) -> None:
    table = Table(
        "order",
        "user",
        "payment ref",
        "reason",
        "amount",
        "refused at (UTC)",
        "handled",
        title=title,
    )
    for refusal in found:
        table.add_row(
            refusal.order_id,
            refusal.user_id or "-",
            refusal.payment_ref or "-",
            refusal.reason.value,
            amount_text(refusal),
            utc_text(refusal.refused_at_ms),
            handled_text(refusal),
        )
    Console().print(table)


def dataclass_json(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__dataclass_fields__}


def json_default(value: object) -> str:
    if isinstance(value, Decimal):
        return str(value)
    raise TypeError(type(value).__name__)


def print_order(order: Order, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(order_to_json(order), default=json_default))
        return
    left = f", {order.time_left_s:.1f} s left" if order.is_open else ""
    if order.is_open and order.expires_at_ms == NEVER_EXPIRES_MS:
        left = ", does not expire"
    amount = f", {amount_text(order)}" if order.amount is not None else ""
    policy = f", policy {order.policy}" if order.policy is not None else ""
    holds = "".join(
        f", {units if isinstance(units, int) else ' '.join(units)} x {rid}"
        for rid, units in order.holds.items()
    )
    click.echo(
        f"{order.id}  user {order.user_id}  {order.status.value}{amount}{policy}{holds}{left}"
    )


def print_orders_table(user: str, found: list[Order]) -> None:
    table = Table("order", "expires at (UTC)", "time left", "amount", title=f"open orders: {user}")
    for order in found:
        table.add_row(
            order.id,
            order.expires_at.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3],
            "never" if order.expires_at_ms == NEVER_EXPIRES_MS else f"{order.time_left_s:.1f} s",
            amount_text(order),
        )
    Console().print(table)


def print_stats(found: Stats, window_s: int, horizon_s: int) -> None:
    """Unpaid orders as they stand now; paid, cancelled and closed ones within the window."""
    table = Table("", "", title="orders")
    table.add_row("unpaid", str(found.by_status.get("unpaid", 0)))
    table.add_row("  open (unpaid, time left)", str(found.open_unpaid))
    table.add_row("  backlog (due, not closed)", str(found.backlog))
    for status in ("paid", "cancelled", "closed"):
        table.add_row(f"{status}, last {window_s} s", str(found.by_status.get(status, 0)))
    table.add_row(f"  replaced (cancelled), last {window_s} s", str(found.replaced_in_window))
    table.add_row(f"reminded, last {window_s} s", str(found.reminded_in_window))
    table.add_row("users with their own limit", str(found.users_with_own_limit))
    lag = (
        "none closed"
        if found.lag_p50_ms is None
        else f"p50 {found.lag_p50_ms} ms, p99 {found.lag_p99_ms} ms (at most 10 % high), "
        f"max {found.lag_max_ms} ms"
    )
    table.add_row(f"close lag, last {window_s} s", lag)
    console = Console()
    console.print(table)
    peak = max((count for _, count in found.upcoming), default=0) or 1
    console.print(f"expiries due in the next {horizon_s} s:")
    for start_s, count in found.upcoming:
        bar = "█" * round(30 * count / peak)
        console.print(f"  +{start_s:>5} s {bar} {count}")
