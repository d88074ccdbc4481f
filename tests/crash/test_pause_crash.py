"""kill -9 during ``orders resume``, beside a running ``orders scheduler``: real ``orders
resume`` processes are SIGKILLed while they move the paused orders' expiries; the next
resume finishes the work. Every order must end moved exactly once, by exactly the pause's
length, with exactly one event, and the index must agree with SQL after a reconcile. Orders
that fall due during the pause are not closed while it lasts (a resume cut short keeps it
open), and the scheduler closes each once after its moved expiry."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, select

from orders.config import Settings
from orders.domain import OrderStatus, system_clock
from orders.service import OrderService
from orders.sql.models import events_table, orders_table, pauses_table
from tests.support.processes import ChildProcess, child_env
from tests.support.stores import write_orders_as_of_old

USERS = [f"user-{n:03d}" for n in range(97)]
RESUME_ARGS = ["-m", "orders", "resume", "--batch-size", "20"]
SCHEDULER_ARGS = ["-m", "orders", "scheduler", "--interval", "0.2"]
#: Orders that fall due during the pause.
DUE = 30


def shifted_so_far(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.max(pauses_table.c.shifted))) or 0)


def unpaid_rows(prefix: str, count: int, first_expiry_ms: int) -> list[dict[str, Any]]:
    """``count`` unpaid orders created a minute ago, expiring 1 ms apart from the first."""
    created_ms = system_clock() - 60_000
    return [
        {
            "id": f"{prefix}-{n:06d}",
            "user_id": USERS[n % len(USERS)],
            "status": OrderStatus.UNPAID.value,
            "created_at_ms": created_ms,
            "expires_at_ms": first_expiry_ms + n,
            "updated_at_ms": created_ms,
        }
        for n in range(count)
    ]


def closed_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).where(orders_table.c.status == "closed")) or 0)


def resume_killed_then_finished(
    engine: Engine,
    env: dict[str, str],
    tmp_path: Path,
    rng: random.Random,
    count: int,
    kills: int,
) -> None:
    """``kills`` resumes SIGKILLed inside their batches, then one run to its end."""
    killed_at: list[int] = []
    for kill in range(kills):
        before = shifted_so_far(engine)
        child = ChildProcess(RESUME_ARGS, env, tmp_path / f"resume-{kill}.log")
        try:
            deadline = time.monotonic() + 60
            while shifted_so_far(engine) == before:  # it is moving orders now
                if child.proc.poll() is not None:
                    raise child.fail("ended before it was killed")
                if time.monotonic() > deadline:
                    raise child.fail("moved nothing within 60 s")
                time.sleep(0.002)
            time.sleep(rng.uniform(0, 0.05))  # somewhere inside a later batch
            child.sigkill()
        finally:
            child.close()
        killed_at.append(shifted_so_far(engine))
    assert killed_at[-1] < count, "the kills came too late: nothing left to resume"
    with engine.connect() as conn:  # a resume cut short keeps the sweep held
        assert conn.scalar(select(func.count()).where(pauses_table.c.ended_at_ms.is_(None))) == 1

    final = ChildProcess(RESUME_ARGS, env, tmp_path / "resume-final.log")
    try:
        final.output_at_exit(120)
        assert final.proc.returncode == 0, final.log()
    finally:
        final.close()


@pytest.mark.slow
@pytest.mark.rotate("database_url")  # CI time: one engine a run, both with --full
@pytest.mark.timeout(300)
def test_resumes_killed_mid_batch_move_every_order_exactly_once(
    engine: Engine,
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    full_size: bool,
    tmp_path: Path,
) -> None:
    rng = random.Random()
    count, kills = (6000, 20) if full_size else (1500, 5)
    service = OrderService(engine, redis_client, Settings(database_url=database_url))
    now_ms = system_clock()
    rows = unpaid_rows("paused", count, now_ms + 3_600_000)
    # Due 2 s from now, in the middle of the pause: held until the resume moves them.
    due = unpaid_rows("due", DUE, now_ms + 2_000)
    write_orders_as_of_old(service, [*rows, *due])
    rows += due
    count += DUE
    service.operations.pause("crash test")
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    env.pop("PYTHONWARNINGS", None)
    scheduler = ChildProcess(SCHEDULER_ARGS, env, tmp_path / "scheduler.log")
    try:
        resume_killed_then_finished(engine, env, tmp_path, rng, count, kills)
        # The scheduler closes the due orders once their moved expiry has passed.
        deadline = time.monotonic() + 60
        while closed_count(engine) < DUE:
            assert scheduler.proc.poll() is None, scheduler.log()
            assert time.monotonic() < deadline, "the due orders were not closed after the resume"
            time.sleep(0.05)
    finally:
        scheduler.close()

    (pause,) = service.operations.recent_pauses()
    assert (pause.is_open, pause.shifted) == (False, count)
    length = pause.length_ms(0)
    assert length > 0
    with engine.connect() as conn:
        expiries = dict(conn.execute(select(orders_table.c.id, orders_table.c.expires_at_ms)).all())
        per_order = dict(
            conn.execute(
                select(events_table.c.order_id, func.count())
                .where(events_table.c.kind == "extended")
                .group_by(events_table.c.order_id)
            ).all()
        )
    with engine.connect() as conn:
        closed = dict(
            conn.execute(
                select(orders_table.c.id, orders_table.c.closed_at_ms).where(
                    orders_table.c.status == "closed"
                )
            ).all()
        )
        closes = conn.scalar(select(func.count()).where(events_table.c.kind == "closed"))
    assert set(closed) == {str(r["id"]) for r in due}
    assert closes == DUE
    early = [o for o, at in closed.items() if at < expiries[o] or at < (pause.ended_at_ms or 0)]
    assert early == [], f"closed during the pause or before their moved expiry: {early[:3]}"
    wrong = [r["id"] for r in rows if expiries[r["id"]] != r["expires_at_ms"] + length]
    assert wrong == [], f"{len(wrong)} orders not moved exactly once, e.g. {wrong[:3]}"
    assert set(per_order.values()) == {1}
    assert len(per_order) == count

    service.reconcile()
    members: dict[str, Any] = {}
    for user in USERS:
        members.update(
            (m.decode(), int(s))
            for m, s in redis_client.zrange(f"UnpaidOrder-{user}", 0, -1, withscores=True)
        )
    assert members == {o: at for o, at in expiries.items() if o not in closed}
