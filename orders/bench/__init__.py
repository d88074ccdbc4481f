"""``orders bench``: what the service costs on your own stores, beside the naive way and a
raw floor, on public names only (``orders.OrderService``, ``orders.Settings``, redis-py,
SQLAlchemy and the DBAPI driver under the engine), so each figure can be checked by hand.

- ``create``: ``create_unpaid_order`` of a new user, beside the naive create (ZCARD, then
  ZADD from the client, then INSERT + COMMIT on the raw driver) and the raw floor (one
  EVALSHA of a one-key check-and-add script, then INSERT of the order and its event +
  COMMIT on the raw driver);
- ``refusal``: a create refused at the limit beside one ZCARD and one EVALSHA that refuses,
  with the SQL statements the refusals sent (none);
- ``mark_paid``: beside the raw ``UPDATE ... WHERE status = 'unpaid'``, the event's INSERT
  and COMMIT;
- ``sweep``: closes per second of ``sweep_expired`` on due orders;
- ``close_lag``: ``closed_at - expires_at`` of orders expiring at a steady rate, closed by a
  real ``orders scheduler`` process started on the same stores.

The variants of a figure take turns (A B C A B C ...) for several repetitions, so a machine
that slows down affects each alike; each ratio is taken per repetition before its median.
Everything the bench writes is its own (:mod:`orders.bench.stores`) and is deleted at the
end, also when it fails. The sweep runs at a "now" of 2001 and the scheduler on real time,
so either is skipped (with a note) when another user's unpaid order would fall due. The
benchmark lab, with many more figures, is the repository's ``benchmarks/`` folder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import redis
from sqlalchemy import Engine

from orders import Settings
from orders.bench.figures import FIGURES
from orders.bench.stores import QUICK, Bench, Sizes


def run_bench(
    engine: Engine,
    client: redis.Redis,
    settings: Settings,
    *,
    quick: bool = False,
    status: Callable[[str], None] = lambda _text: None,
) -> dict[str, Any]:
    """Every figure on these stores, then cleanup; the report (JSON-able)."""
    started = time.monotonic()
    bench = Bench(engine, client, settings, QUICK if quick else Sizes())
    report: dict[str, Any] = {"engine": engine.dialect.name, "sizes": asdict(bench.sizes)}
    figures = report["figures"] = {}
    try:
        for name, figure in FIGURES.items():
            status(f"{name} ...")
            result = figure(bench)
            if result is not None:
                figures[name] = result
            bench.cleanup()
    finally:
        bench.cleanup()
    report["notes"] = bench.notes
    report["left_behind"] = bench.left_behind()
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


__all__ = ["run_bench"]
