"""The filter form of ``orders cancel`` and ``orders extend`` (bulk actions).

``orders cancel ORDER`` and ``orders extend ORDER SECONDS`` act on one order as before.
Without ORDER, a filter option is required and the command acts on every unpaid order
the filter matches; ORDER with a filter option is an error (exit 2), as is no ORDER and
no filter. The service does the work (:mod:`orders.rules.bulk`); this module parses the options
and shows the progress and the summary. Its heavy imports wait for the command to run, so
``orders --help`` stays light.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click

from orders.cli.render import utc_text
from orders.errors import InvalidInput

if TYPE_CHECKING:
    from orders.domain import Order
    from orders.rules.bulk import BulkReport, OnBatch

F = TypeVar("F", bound=Callable[..., Any])

#: The default ``--batch-size`` (orders.rules.bulk.DEFAULT_BATCH_SIZE; a literal here keeps
#: ``--help`` free of the service's imports, and a test pins that they agree).
DEFAULT_BATCH_SIZE = 500


def filter_options(command: F) -> F:
    """The filter, dry-run and batch options both commands share."""
    for option in reversed(
        [
            click.option("--user", "user_id", help="Only this user's orders."),
            click.option(
                "--created-before",
                help="Created before this time, ISO 8601 with a time zone.",
            ),
            click.option(
                "--expiring-before",
                help="Expiring before this time, ISO 8601 with a time zone.",
            ),
            click.option(
                "--metadata",
                "metadata_pairs",
                multiple=True,
                help="key=value: the order's metadata has this string value (repeatable).",
            ),
            click.option(
                "--dry-run", is_flag=True, help="Print what would change; change nothing."
            ),
            click.option(
                "--batch-size",
                type=int,
                default=DEFAULT_BATCH_SIZE,
                show_default=True,
                help="Orders read and changed per batch (1 to 10,000).",
            ),
        ]
    ):
        command = option(command)
    return command


def parse_time(name: str, text: str | None) -> datetime | None:
    """An ISO 8601 option (its time zone is checked with the rest of the filter)."""
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidInput(
            name, "must be an ISO 8601 time with a time zone, e.g. 2026-12-24T18:00+01:00"
        ) from None


def filter_given(options: dict[str, Any]) -> bool:
    return any(
        options[name] for name in ("user_id", "created_before", "expiring_before", "metadata_pairs")
    )


def service_filter(options: dict[str, Any]) -> dict[str, Any]:
    """The options as the service's filter and batch keywords."""
    from orders.rules.bulk import parse_metadata_pairs  # noqa: PLC0415

    return {
        "user_id": options["user_id"],
        "created_before": parse_time("created_before", options["created_before"]),
        "expiring_before": parse_time("expiring_before", options["expiring_before"]),
        "metadata": parse_metadata_pairs(options["metadata_pairs"]),
        "dry_run": options["dry_run"],
        "batch_size": options["batch_size"],
    }


@contextmanager
def shown_batches(
    dry_run: bool, as_json: bool, extra_ms: int | None
) -> Iterator[tuple[OnBatch, list[dict[str, Any]]]]:
    """The ``on_batch`` for the service: a rich progress on a terminal, a plain line per
    batch otherwise; in a dry run, each order that would change (collected for ``--json``)."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    found: list[dict[str, Any]] = []
    terminal = sys.stdout.isatty() and not as_json
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.fields[totals]}"),
        TimeElapsedColumn(),
        transient=True,
        disable=not terminal,
    ) as progress:
        task = progress.add_task("bulk", total=None, totals="starting")

        def on_batch(page: Sequence[Order], report: BulkReport) -> None:
            if dry_run:
                for order in page:
                    found.append(would_change(order, extra_ms))
                    if not as_json:
                        progress.console.print(would_change_line(found[-1]), highlight=False)
            if terminal:
                progress.update(task, totals=totals_text(report))
            elif not as_json:
                click.echo(f"batch {report.batches}: {totals_text(report)}")

        yield on_batch, found


def would_change(order: Order, extra_ms: int | None) -> dict[str, Any]:
    shown = {"id": order.id, "user_id": order.user_id, "expires_at": utc_text(order.expires_at_ms)}
    if extra_ms is not None:
        shown["new_expires_at"] = utc_text(order.expires_at_ms + extra_ms)
    return shown


def would_change_line(shown: dict[str, Any]) -> str:
    line = f"{shown['id']}  user {shown['user_id']}  expires {shown['expires_at']}"
    if "new_expires_at" in shown:
        line += f" -> {shown['new_expires_at']}"
    return line


def totals_text(report: BulkReport) -> str:
    if report.dry_run:
        return f"{report.matched} matched"
    return (
        f"{report.matched} matched, {report.changed} changed, {report.skipped} skipped "
        f"(paid, closed or cancelled first), {report.refused} refused"
    )


def print_summary(report: BulkReport, found: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        summary: dict[str, Any] = {
            "action": report.action,
            "dry_run": report.dry_run,
            "matched": report.matched,
            "changed": report.changed,
            "skipped": report.skipped,
            "refused": report.refused,
            "batches": report.batches,
        }
        if report.dry_run:
            summary["orders"] = found
        click.echo(json.dumps(summary))
        return
    prefix = "dry run, nothing changed: " if report.dry_run else ""
    click.echo(f"{report.action}: {prefix}{totals_text(report)}")


def run_bulk(
    ctx: click.Context, action: str, options: dict[str, Any], extra_s: float | None
) -> None:
    """Run ``action`` ("cancel" or "extend") on the orders the options' filter matches."""
    from orders.cli.app import cli_state  # noqa: PLC0415

    state = cli_state(ctx)
    # The options parse before a store is opened; the service checks the rest first.
    asked = service_filter(options)
    service = state.service()
    extra_ms = None if extra_s is None else round(extra_s * 1000)
    with shown_batches(asked["dry_run"], options["as_json"], extra_ms) as (on_batch, found):
        if action == "cancel":
            report = service.operations.cancel_matching(
                **asked, reason=options["reason"], actor=state.actor, on_batch=on_batch
            )
        else:
            assert extra_s is not None
            report = service.operations.extend_matching(
                extra_s, **asked, actor=state.actor, on_batch=on_batch
            )
    print_summary(report, found, options["as_json"])
