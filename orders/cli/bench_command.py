"""``orders bench``: the click command, the refusal of a busy database, and the printout."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, cast

import click
import redis
from sqlalchemy.exc import SQLAlchemyError

from orders.bench import run_bench
from orders.cli.app import cli_state
from orders.errors import StoreUnavailable


@click.command("bench")
@click.option("--quick", is_flag=True, help="Small sizes: a smoke test of a few seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--yes",
    is_flag=True,
    help="Run even on a database holding orders (the bench touches only its own).",
)
@click.pass_context
def bench(ctx: click.Context, quick: bool, as_json: bool, yes: bool) -> None:
    """Measure the service on the configured stores against raw floors and the naive way.

    The bench adds users bench-<random>-..., their orders and Redis keys, and removes them
    all at the end; its close-lag figure runs an `orders scheduler` process of its own. It
    refuses a database that already holds orders unless --yes.
    """
    state = cli_state(ctx)
    if state.settings.redis_cluster:  # its floors are one server's (one raw EVALSHA)
        raise click.UsageError(
            "orders bench measures one Redis server: run it with a single node's URL and "
            "without ORDERS_REDIS_CLUSTER"
        )
    service = state.service()
    # Not a cluster (refused above): one server's client.
    engine, client = service.engine, cast("redis.Redis", service.index.client)
    try:
        with engine.connect() as conn:
            busy = conn.exec_driver_sql("SELECT 1 FROM oes_orders LIMIT 1").first()
        if busy and not yes:
            raise click.UsageError(
                "the database already holds orders; the bench adds and removes only its "
                "own, pass --yes to run it there anyway"
            )
        say = (lambda _text: None) if as_json else (lambda text: click.echo(text, err=True))
        report = run_bench(engine, client, service.settings, quick=quick, status=say)
    except SQLAlchemyError as exc:
        raise StoreUnavailable("sql", type(exc).__name__) from exc
    except redis.RedisError as exc:
        raise StoreUnavailable("redis", type(exc).__name__) from exc
    click.echo(json.dumps(report, indent=2) if as_json else "\n".join(lines(report)))


def _spread(s: Mapping[str, float], form: str) -> str:
    return f"{s['median']:{form}} ({s['min']:{form}} - {s['max']:{form}})"


def lines(report: Mapping[str, Any]) -> list[str]:
    """The report as text: each variant's ops/s and latency, each ratio, sweep and lag."""
    out = [f"orders bench on {report['engine']}, {report['elapsed_s']:g} s"]
    for name, fig in report["figures"].items():
        for variant, v in fig.get("variants", {}).items():
            out.append(f"{name:<10} {variant:<18} {_spread(v['ops_s'], ',.0f')} ops/s, "
                       f"p50 {v['p50_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms")  # fmt: skip
        for ratio, s in fig.get("ratios", {}).items():
            out.append(f"{name:<10} {ratio.replace('_vs_', ' / '):<18} {_spread(s, '.2f')} x")
        if "sql_statements" in fig:
            out.append(f"{name:<10} {fig['sql_statements']} SQL statements in {fig['refusals']:,}")
        if "closes_s" in fig:
            out.append(f"{name:<10} {_spread(fig['closes_s'], ',.0f')} closes/s, "
                       f"{fig['due']:,} due, batch {fig['batch_size']}")  # fmt: skip
        if "p99_ms" in fig:
            out.append(f"{name:<10} p50 {fig['p50_ms']:.0f} ms, p99 {fig['p99_ms']:.0f} ms, max "
                       f"{fig['max_ms']:.0f} ms: {fig['closed']:,} of {fig['orders']:,} orders "
                       f"closed, {fig['rate_s']:g} expiries/s")  # fmt: skip
    out += [f"note: {note}" for note in report["notes"]]
    if any(report["left_behind"].values()):
        out.append(f"left behind: {report['left_behind']}")
    return out
