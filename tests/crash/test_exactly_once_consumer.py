"""kill -9 in the middle of a transactional consumer's batches: a child runs
``EventConsumer(..., transactional=True)`` (``tests/support/workers/exactly_once.py``)
whose handler inserts a row per event into a host table without a key, failing on some
events on purpose; the test SIGKILLs it at random moments several times, restarts it, and
finally lets it finish. Each event's effect must then be in the table exactly once (none for
an event that never stopped failing), the cursor at the last event, and the retry rows
exactly the parked events.
"""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select

from orders.events.consumer import EventConsumer, EventPosition
from tests.support.effects import (
    create_effects_table,
    effect_counts,
    effects_table,
    retry_rows,
    write_events,
)
from tests.support.processes import ChildProcess, child_env, run_python
from tests.support.workers import exactly_once as worker

CONSUMER_ARGS = ["-m", "tests.support.workers.exactly_once"]


def effects_so_far(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(effects_table)) or 0)


def next_effect(engine: Engine, child: ChildProcess) -> None:
    """Until one more effect row has committed than when called."""
    before = effects_so_far(engine)
    deadline = time.monotonic() + 60
    while effects_so_far(engine) == before:
        if child.proc.poll() is not None:
            raise child.fail("ended before it was killed")
        if time.monotonic() > deadline:
            raise child.fail("handled nothing within 60 s")
        time.sleep(0.001)


def position(engine: Engine) -> EventPosition:
    return EventConsumer(
        engine, worker.NAME, worker.handler, transactional=True, start="oldest"
    ).position()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_transactional_consumer_killed_mid_batch_leaves_each_effect_exactly_once(
    engine: Engine, database_url: str, full_size: bool, tmp_path: Path
) -> None:
    rng = random.Random()
    count, kills = (1500, 12) if full_size else (150, 3)
    create_effects_table(engine)
    ids = write_events(engine, count, transactions=10)
    env = child_env(ORDERS_DATABASE_URL=database_url)

    for kill in range(kills):
        child = ChildProcess(CONSUMER_ARGS, env, tmp_path / f"consumer-{kill}.log")
        try:
            next_effect(engine, child)  # it is handling events now
            time.sleep(rng.uniform(0, 0.05))  # somewhere in a later batch, or a retry
            if kill % 2:
                # Right as an effect shows: just past the commit that made it visible.
                next_effect(engine, child)
            assert child.sigkill() == -signal.SIGKILL
        finally:
            child.close()
    assert position(engine).event_id < ids[-1], "the kills came too late: nothing left"

    final = run_python(*CONSUMER_ARGS, env=env, timeout_s=120)  # to its end
    assert final.returncode == 0, final.stderr[-3000:]

    never = {i for i in ids if i % worker.ALWAYS == 0}
    counts = effect_counts(engine)
    assert {i: n for i, n in counts.items() if n != 1} == {}, "effects repeated"
    assert sorted(counts) == sorted(set(ids) - never)
    assert retry_rows(engine, worker.NAME) == dict.fromkeys(never, (worker.MAX_ATTEMPTS, True))
    assert position(engine).event_id == ids[-1]
