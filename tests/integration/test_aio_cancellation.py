"""A task cancelled at any await point of a create or a payment leaves the stores agreeing.

Each case starts the call as a task, lets it run ``k`` steps of :data:`STEP_S` (none for
``k`` = 0: the cancel lands before the call has started), then cancels it; ``k`` goes up
until the call finishes before the cancel arrives, so the cancels land all along the call
as it runs in the service's thread. After each cancel, both stores are read (from a
thread: the loop must not block):

* no half-written order: a row exists exactly when its ``created`` event does, and a
  paid row exactly when its ``paid`` event does;
* no phantom member: the user's Redis members are exactly the user's open rows, each at
  the row's expiry.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.aio import AsyncOrderService
from orders.config import Settings
from orders.index.nodes import RedisClient
from orders.sql.models import events_table, orders_table
from tests.support.aio import new_async_service, run_checked
from tests.support.clocks import ManualClock

pytestmark = pytest.mark.cluster_too

#: How far apart the cancels land along a call (a create takes about a millisecond or more).
STEP_S = 0.0001
#: Steps after which the cancel stops finding the call still running: far more than a
#: create or a payment takes (40 ms), so reaching it means a case never completed.
MAX_STEPS = 400


def both_stores(engine: Engine, redis_client: RedisClient, user: str, now_ms: int) -> str:
    """Checks the invariants for ``user``; returns what SQL holds ("none", "unpaid", ...)."""
    with engine.connect() as conn:
        rows = conn.execute(select(orders_table).where(orders_table.c.user_id == user)).all()
        events = conn.execute(
            select(events_table.c.order_id, events_table.c.kind).where(
                events_table.c.user_id == user
            )
        ).all()
    kinds = Counter((order_id, kind) for order_id, kind in events)
    for row in rows:
        assert kinds[(row.id, "created")] == 1, f"order {row.id} without its created event"
        assert kinds[(row.id, "paid")] == (row.status == "paid"), f"{row.id}: paid event"
    assert {order_id for order_id, _kind in events} <= {row.id for row in rows}
    open_rows = {
        row.id: row.expires_at_ms
        for row in rows
        if row.status == "unpaid" and row.expires_at_ms > now_ms
    }
    members = {
        member.decode(): int(score)
        for member, score in redis_client.zrange(f"UnpaidOrder-{user}", 0, -1, withscores=True)
    }
    assert members == open_rows, "Redis and SQL disagree after a cancelled call"
    return "none" if not rows else "/".join(sorted(row.status for row in rows))


async def cancelled_after(call: Coroutine[Any, Any, None], steps: int) -> bool:
    """Runs ``call`` as a task, cancels it after ``steps`` steps; False when it had finished
    by then (then it must have succeeded)."""
    task = asyncio.ensure_future(call)
    if steps:  # none: the task is cancelled before its first step
        await asyncio.sleep(steps * STEP_S)
    if task.done():
        task.result()
        return False
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    raise AssertionError("a cancelled call returned instead of raising CancelledError")


def sweep_cancels(
    service_for: Any, check: Any, prepare: Any, call_for: Any
) -> tuple[int, Counter[str]]:
    """For k = 0, 1, ...: prepare, cancel the call after k steps, check. Returns how many
    cancels landed and what SQL held after them. (Where a cut inside the core lands, before
    or after the commit, depends on timing: every landing is checked, none is required.)"""

    async def main() -> tuple[int, Counter[str]]:
        service: AsyncOrderService = await service_for()
        seen: Counter[str] = Counter()
        try:
            for steps in range(MAX_STEPS):
                user = f"u{steps}"
                subject = await prepare(service, user)
                if not await cancelled_after(call_for(service, user, subject), steps):
                    return steps, seen
                seen[await asyncio.to_thread(check, user)] += 1
            raise AssertionError(f"the call never finished within {MAX_STEPS} loop steps")
        finally:
            await service.aclose()

    return run_checked(main())


@pytest.fixture
def settings(database_url: str, redis_options: dict[str, Any]) -> Settings:
    return Settings(database_url=database_url, unpaid_limit=2, **redis_options)


async def nothing(_service: AsyncOrderService, _user: str) -> None:
    return None


async def an_order(service: AsyncOrderService, user: str) -> str:
    return (await service.create_unpaid_order(user)).id


async def create(service: AsyncOrderService, user: str, _subject: None) -> None:
    await service.create_unpaid_order(user, order_id=f"{user}-o")


async def pay(service: AsyncOrderService, _user: str, order_id: str) -> None:
    await service.mark_paid(order_id, payment_ref="psp-1")


#: Each call: what it is given, the call, and what SQL must be seen holding after some
#: cancel (before the call started, and once it had: it then finishes).
CALLS: dict[str, tuple[Any, Any, tuple[str, str]]] = {
    "create": (nothing, create, ("none", "unpaid")),
    "payment": (an_order, pay, ("unpaid", "paid")),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_call_cancelled_at_any_await_leaves_no_phantom_and_no_half_write(
    settings: Settings,
    engine: Engine,
    redis_client: RedisClient,
    clock: ManualClock,
    call: str,
) -> None:
    prepare, call_for, states = CALLS[call]
    landed, seen = sweep_cancels(
        lambda: new_async_service(settings, clock=clock),
        lambda user: both_stores(engine, redis_client, user, clock()),
        prepare,
        call_for,
    )
    assert landed >= 4, f"only {landed} cancels landed during the call"
    assert all(seen[state] >= 1 for state in states), seen
