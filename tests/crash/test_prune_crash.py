"""kill -9 during ``orders prune``, beside a running ``orders scheduler``: real prune
processes are SIGKILLed between and inside their batches while the scheduler closes the
orders that come due and new orders are created; the next prune finishes the work.

At the end every old paid, cancelled or closed order is gone with all its events, and
nothing else is: not an unpaid order however old, not one with a refund still owed, not a
recent one; no event is left without its order; every order the scheduler closed meanwhile
was closed exactly once; and the index holds exactly the open orders."""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine, func, select, update

from orders.config import Settings
from orders.domain import OrderStatus, system_clock
from orders.errors import OrderClosed, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.processes import ChildProcess, child_env
from tests.support.stores import write_orders_as_of_old

DAY_MS = 86_400_000
PRUNE_ARGS = ["-m", "orders", "prune", "--older-than", "30d", "--batch-size", "25"]
TERMINAL = (OrderStatus.PAID, OrderStatus.CANCELLED, OrderStatus.CLOSED)


def old_rows(count: int, now_ms: int) -> list[dict[str, object]]:
    """``count`` orders finished 60 days ago (paid, cancelled, closed in turn), and one in
    ten of the same age still unpaid, holding its slot until next year."""
    rows: list[dict[str, object]] = []
    for n in range(count):
        at = now_ms - 60 * DAY_MS + n
        status = OrderStatus.UNPAID if n % 10 == 9 else TERMINAL[n % 3]
        row: dict[str, object] = {
            "id": f"old-{n:06d}",
            "user_id": f"old-user-{n % 50:02d}",
            "status": status.value,
            "created_at_ms": at - 1000,
            "expires_at_ms": now_ms + 365 * DAY_MS if status is OrderStatus.UNPAID else at,
            "updated_at_ms": at,
            "paid_at_ms": at if status is OrderStatus.PAID else None,
            "closed_at_ms": None,
            "close_reason": None,
        }
        if status in (OrderStatus.CANCELLED, OrderStatus.CLOSED):
            row["closed_at_ms"] = at
            row["close_reason"] = "expired" if status is OrderStatus.CLOSED else "cancelled"
        rows.append(row)
    return rows


def count_of(engine: Engine, prefix: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(select(func.count()).where(orders_table.c.id.startswith(prefix))) or 0
        )


@pytest.mark.slow
@pytest.mark.rotate("database_url")  # CI time: one engine a run, both with --full
@pytest.mark.timeout(300)
def test_prunes_killed_mid_batch_beside_a_scheduler_delete_exactly_the_old_finished_orders(
    engine: Engine,
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    full_size: bool,
    tmp_path: Path,
) -> None:
    rng = random.Random()
    # Enough orders that three kills come before the end: a prune deletes about 10^4 a second.
    count, kills = (6000, 12) if full_size else (3000, 3)
    service = OrderService(engine, redis_client, Settings(database_url=database_url))
    now_ms = system_clock()
    rows = old_rows(count, now_ms)
    write_orders_as_of_old(service, rows)
    old_unpaid = {str(r["id"]) for r in rows if r["status"] == "unpaid"}
    old_finished = {str(r["id"]) for r in rows} - old_unpaid

    # An old order whose payment came after it closed: a refund owed keeps it.
    owed = service.create_unpaid_order("owed-user", ttl_s=1)
    recent_paid = service.create_unpaid_order("recent-user", ttl_s=600)
    service.mark_paid(recent_paid.id)

    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    env.pop("PYTHONWARNINGS", None)
    scheduler = ChildProcess(
        ["-m", "orders", "scheduler", "--interval", "0.2"], env, tmp_path / "scheduler.log"
    )
    live: list[str] = []
    try:
        deadline = time.monotonic() + 30
        while service.get_order(owed.id).status is not OrderStatus.CLOSED:
            assert scheduler.proc.poll() is None, scheduler.log()
            assert time.monotonic() < deadline, "the scheduler closed nothing within 30 s"
            time.sleep(0.05)
        with pytest.raises(OrderClosed):
            service.mark_paid(owed.id, payment_ref="late-psp")
        with engine.begin() as conn:  # as if all that happened 60 days ago
            conn.execute(
                update(orders_table)
                .where(orders_table.c.id == owed.id)
                .values(closed_at_ms=now_ms - 60 * DAY_MS, updated_at_ms=now_ms - 60 * DAY_MS)
            )

        killed_at: list[int] = []
        for kill in range(kills):
            before = count_of(engine, "old-")
            prune = ChildProcess(PRUNE_ARGS, env, tmp_path / f"prune-{kill}.log")
            try:
                deadline = time.monotonic() + 60
                while count_of(engine, "old-") == before:  # it is deleting now
                    with contextlib.suppress(UnpaidOrderLimitReached):
                        user = f"live-{rng.randrange(40)}"
                        live.append(service.create_unpaid_order(user, ttl_s=1).id)
                    time.sleep(0.01)
                    if prune.proc.poll() is not None:
                        raise prune.fail("ended before it was killed")
                    if time.monotonic() > deadline:
                        raise prune.fail("deleted nothing within 60 s")
                time.sleep(rng.uniform(0, 0.02))  # somewhere inside a later batch
                prune.sigkill()
            finally:
                prune.close()
            killed_at.append(count_of(engine, "old-"))
        assert killed_at[-1] > len(old_unpaid), "the kills came too late: nothing left to prune"

        final = ChildProcess(PRUNE_ARGS, env, tmp_path / "prune-final.log")
        try:
            final.output_at_exit(120)
            assert final.proc.returncode == 0, final.log()
        finally:
            final.close()

        deadline = time.monotonic() + 30  # the scheduler closes the last live orders
        while any(service.get_order(o).status is OrderStatus.UNPAID for o in live):
            assert time.monotonic() < deadline, "live orders left unclosed"
            time.sleep(0.05)
    finally:
        scheduler.close()  # SIGTERM, then its exit awaited

    with engine.connect() as conn:
        left = set(conn.execute(select(orders_table.c.id)).scalars())
        orphans = conn.scalar(
            select(func.count())
            .select_from(events_table)
            .where(~events_table.c.order_id.in_(select(orders_table.c.id)))
        )
        closes = dict(
            conn.execute(
                select(events_table.c.order_id, func.count())
                .where(events_table.c.kind == "closed", events_table.c.order_id.in_(live))
                .group_by(events_table.c.order_id)
            ).all()
        )
    assert left & old_finished == set(), f"{len(left & old_finished)} old finished orders left"
    assert old_unpaid <= left
    assert {owed.id, recent_paid.id} <= left
    assert set(live) <= left
    assert orphans == 0
    assert closes == dict.fromkeys(live, 1)

    # Live members only: an expired one counts for nothing, and goes at the user's next
    # admission (the rows written as of old put one in for every order).
    now_ms = system_clock()
    members: dict[str, int] = {}
    for key in redis_client.scan_iter("UnpaidOrder-*", _type="zset"):
        members.update(
            (m.decode(), int(s))
            for m, s in redis_client.zrangebyscore(key, now_ms + 1, "+inf", withscores=True)
        )
    with engine.connect() as conn:
        open_orders = dict(
            conn.execute(
                select(orders_table.c.id, orders_table.c.expires_at_ms).where(
                    orders_table.c.status == "unpaid", orders_table.c.expires_at_ms > now_ms
                )
            ).all()
        )
    assert members == open_orders
