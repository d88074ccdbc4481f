"""A transactional event consumer run to the end, for the test to SIGKILL on the way.

Started by ``tests/crash/test_exactly_once_consumer.py`` as ``python -m
tests.support.workers.exactly_once`` with the test's database in ``ORDERS_DATABASE_URL``.
It runs ``EventConsumer(..., transactional=True)`` named :data:`NAME` in batches of
:data:`BATCH` until no event is left after its cursor and nothing is retrying, then prints
its counts as one JSON line and exits 0. The handler inserts one row per event into the
host's effects table (``tests.support.effects``), then:

* fails every time on an event whose id is a multiple of :data:`ALWAYS` (parked after
  :data:`MAX_ATTEMPTS` tries);
* fails on the first try of an event whose id is a multiple of :data:`ONCE` (it has no
  retry row yet), and succeeds on the next.

Retries are due at once (no backoff), on the system clock.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict

from sqlalchemy import Connection

from orders.config import Settings
from orders.events.consumer import ConsumeResult, EventConsumer, OrderEvent, read_events
from orders.sql.engine import build_engine
from tests.support.effects import record_effect, tried_before

NAME = "stock"
BATCH = 10
ALWAYS = 7
ONCE = 5
MAX_ATTEMPTS = 3


def handler(event: OrderEvent, conn: Connection) -> None:
    record_effect(event, conn)
    if event.id % ALWAYS == 0:
        raise RuntimeError("always fails")
    if event.id % ONCE == 0 and not tried_before(conn, NAME, event):
        raise RuntimeError("fails on the first try")


def main() -> int:
    url = os.environ["ORDERS_DATABASE_URL"]
    engine = build_engine(Settings.from_env(), url)
    consumer = EventConsumer(
        engine,
        NAME,
        handler,
        transactional=True,
        backoff_s=0,
        max_attempts=MAX_ATTEMPTS,
        start="oldest",
    )
    total = ConsumeResult()
    while read_events(engine, consumer.position(), 1) or consumer.pending_retries():
        result = consumer.run_once(BATCH)
        for name in ("handled", "failed", "retried_ok", "parked"):
            setattr(total, name, getattr(total, name) + getattr(result, name))
    print(json.dumps(asdict(total)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
