"""Holds under contention (issue 43): 64 threads create overlapping multi-resource carts
against capacities of 1 to 10, payers pay and cancellers cancel at random, and a sweeper
thread closes orders as their short lives end, on the real clock; another thread wipes the
Redis index now and then (FLUSHALL) and drops single resource keys, so at times only SQL
stands between the buyers and an oversell. Time is the injected clock, moved by a thread of
its own while the race runs.

A monitor thread samples SQL throughout: at no sampled moment does any resource have more
units held and sold than its capacity. At the end, after one reconcile, every hold's status
follows its order's (unpaid: held; paid: sold; cancelled or closed: released), each
resource's ``sold`` is the sum of its sold holds (nothing released twice, nothing sold
twice), nothing is oversold, and Redis agrees with SQL.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders import HoldRefused, OrdersError, OrderService, UnpaidOrderLimitReached
from orders.sql.inventory_tables import holds_table, resources_table
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.hold_checks import index_problems, sql_problems
from tests.support.threads import errors_of_threads, sweep_until, tick_until

HOLD = holds_table.c
ORDER = orders_table.c
RESOURCE = resources_table.c

THREADS = 64
CAPACITIES = {f"r{n}": 1 + n for n in range(10)}  # 1 to 10 units
ROUNDS = 20


def used(engine: Engine) -> dict[str, int]:
    """Held and sold units per resource, in one statement (one snapshot)."""
    taken = (
        select(HOLD.resource_id, func.sum(HOLD.quantity).label("n"))
        .where(HOLD.status.in_(["held", "sold"]))
        .group_by(HOLD.resource_id)
    )
    with engine.connect() as conn:
        return {row.resource_id: int(row.n) for row in conn.execute(taken)}


def cart(rng: random.Random) -> dict[str, int]:
    """Two or three overlapping resources, one or two units each."""
    names = rng.sample(sorted(CAPACITIES), rng.choice([1, 2, 3]))
    return {name: rng.choice([1, 1, 2]) for name in names}


@pytest.mark.slow
@pytest.mark.cluster_too
@pytest.mark.rotate("redis_kind")
@pytest.mark.timeout(300)
def test_overlapping_carts_racing_payers_cancels_the_sweeper_and_index_loss_never_oversell(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: Any,
    clock: ManualClock,
) -> None:
    service = make_service(unpaid_limit=3, ttl_s=0.3, sql_pool_size=THREADS + 8)
    for rid, capacity in CAPACITIES.items():
        service.set_capacity(rid, capacity)
    stop = threading.Event()
    breaches: list[tuple[str, int]] = []
    outcomes: Counter[str] = Counter()
    created: list[str] = []
    lock = threading.Lock()

    def monitor() -> None:
        while not stop.is_set():
            for rid, units in used(engine).items():
                if units > CAPACITIES[rid]:
                    breaches.append((rid, units))
            time.sleep(0.002)

    def sweeper() -> None:
        sweep_until(service, stop)

    def ticker() -> None:
        tick_until(clock, stop)

    def loser() -> None:
        rng = random.Random(99)
        while not stop.wait(0.05):
            if rng.random() < 0.3:
                redis_client.flushall()
            else:
                service.resource_index.forget(rng.choice(sorted(CAPACITIES)))

    def buyer(n: int) -> None:
        rng = random.Random(n)
        for _ in range(ROUNDS):
            time.sleep(rng.random() * 0.05)  # pacing: the run spans several order lives
            try:
                order = service.create_unpaid_order(f"u{n}", holds=cart(rng))
            except HoldRefused as refused:
                with lock:
                    outcomes[f"refused_{refused.reason}_{refused.source}"] += 1
                continue
            except UnpaidOrderLimitReached:
                with lock:
                    outcomes["limit"] += 1
                continue
            with lock:
                created.append(order.id)
                outcomes["created"] += 1
            fate = rng.random()
            try:
                if fate < 0.1:  # sold units never come back: a few, or all sell out at once
                    service.mark_paid(order.id)
                elif fate < 0.4:
                    service.cancel_order(order.id)
            except OrdersError as lost:  # the sweeper closed it first
                with lock:
                    outcomes[type(lost).__name__] += 1

    helpers = [threading.Thread(target=f) for f in (monitor, sweeper, loser, ticker)]
    for thread in helpers:
        thread.start()
    try:
        errors = errors_of_threads(buyer, [(n,) for n in range(THREADS)], timeout_s=240)
    finally:
        stop.set()
        for thread in helpers:
            thread.join(30)
    assert not errors, errors[:3]
    clock.advance(s=1)  # past the last order's expiry (ttl 0.3 s)
    service.sweep_expired()
    service.reconcile()

    assert breaches == []
    assert outcomes["created"] > THREADS, outcomes  # units came back and were taken again
    assert sum(n for k, n in outcomes.items() if k.startswith("refused_sold_out")) > 0, outcomes
    assert sql_problems(engine) == []
    assert index_problems(service.resource_index, engine, sorted(CAPACITIES), clock()) == []
