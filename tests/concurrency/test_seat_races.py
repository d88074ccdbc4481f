"""Named seats and a waiting list under contention (issue 44): 64 threads fight for 20
named seats of one resource, each create asking two adjacent seats by name (S-n and
S-n+1, overlapping its neighbours' pairs) or a count of one or two; payers pay at random
(some after the order's short life ended on the injected clock, racing the sweeper and, by
a late payment, the waiting user the seat went to), cancellers cancel at random, a sweeper
thread closes what expires and 200 users wait for a seat, 40 queued before the race and the
rest one by one while it runs (one thread, so ids are committed in id order: see
``queue_users``). Served waiting users' orders are paid, cancelled or left to expire too.

A monitor thread samples SQL throughout, each sample one statement: every seat held or
sold by at most one order and agreeing with it, and the served entries a prefix of the
queue (first come, first served: every entry asks one seat and its user has room, so none
is skipped). At the end, once every order has expired and one sweep, the serving threads
and one reconcile are done: each served entry has exactly one order ``waiting-<id>`` and no
other entry has one, no seat is free while anyone still waits, the units agree with holds,
orders and counters, nothing is oversold, and Redis (counters, members, the units hash)
equals SQL.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
from sqlalchemy import Engine

from orders import HoldRefused, OrdersError, OrderService, UnpaidOrderLimitReached
from tests.support.clocks import ManualClock
from tests.support.hold_checks import (
    fifo_problems,
    index_problems,
    seat_problems,
    seat_sample,
    sql_problems,
    unit_index_problems,
    unit_problems,
    waiting_problems,
)
from tests.support.threads import errors_of_threads, sweep_until, tick_until

THREADS = 64
RID = "ev-seats"
SEATS = [f"S-{n}" for n in range(1, 21)]
ROUNDS = 12
WAITERS = 200
#: Queued before the race starts; the rest join while it runs.
EARLY_WAITERS = 40
#: Seats sold at most: sold seats never come back, and a sold-out hall races nothing.
SOLD_BUDGET = 10


def ask(rng: random.Random) -> list[str] | int:
    """Two adjacent seats by name (S-n, S-n+1: every pair overlaps its neighbours'), or a
    count of one or two."""
    if rng.random() < 0.8:
        n = rng.randrange(len(SEATS) - 1)
        return SEATS[n : n + 2]
    return rng.choice([1, 2])


@pytest.mark.slow
@pytest.mark.cluster_too
@pytest.mark.rotate("redis_kind")
@pytest.mark.timeout(180)
def test_seat_pairs_racing_payers_cancels_the_sweeper_and_a_waiting_list_hold_each_seat_once(
    make_service: Callable[..., OrderService],
    engine: Engine,
    clock: ManualClock,
) -> None:
    service = make_service(
        unpaid_limit=10, ttl_s=0.3, late_payment_window_s=0.2, sql_pool_size=THREADS + 16
    )
    service.set_units(RID, SEATS)
    stop = threading.Event()
    problems: list[str] = []
    samples = 0
    outcomes: Counter[str] = Counter()
    entries: list[int] = []
    lock = threading.Lock()
    sold = 0  # seats paid for or being paid for (SOLD_BUDGET)

    def pay(order_id: str, seats: int) -> None:
        nonlocal sold
        with lock:
            if sold + seats > SOLD_BUDGET:
                return
            sold += seats
        try:
            service.mark_paid(order_id)
        except OrdersError as refused:  # closed by the sweeper, or its seats taken since
            with lock:
                sold -= seats
                outcomes[f"pay_{type(refused).__name__}"] += 1
            return
        with lock:
            outcomes["paid"] += 1

    def cancel(order_id: str) -> None:
        try:
            service.cancel_order(order_id)
        except OrdersError as lost:  # paid or closed first
            with lock:
                outcomes[f"cancel_{type(lost).__name__}"] += 1

    def monitor() -> None:
        nonlocal samples
        while not stop.is_set():
            sample = seat_sample(engine, RID)
            found = seat_problems(sample) + fifo_problems(sample)
            samples += 1
            if found and len(problems) < 50:
                problems.extend(found)
            time.sleep(0.003)

    def sweeper() -> None:
        sweep_until(service, stop)

    def ticker() -> None:
        tick_until(clock, stop)

    def queue_users() -> None:
        # One thread, one add at a time: on PostgreSQL an entry's id is drawn at its insert
        # and seen at its commit, so two adds at once may be seen in the other order, and a
        # serve in between rightly serves the later id first (it is the one in the queue).
        for k in range(EARLY_WAITERS, WAITERS):
            if stop.wait(0.05):
                return
            entry = service.wait_for(f"waiter-{k}", RID)
            with lock:
                entries.append(entry.id)

    def served_fates() -> None:  # the waiting users pay, cancel or let their order expire
        rng = random.Random(7)
        decided: set[int] = set()
        while not stop.wait(0.01):
            with lock:
                open_ids = [e for e in entries if e not in decided]
            if not open_ids:
                continue
            entry = service.waiting_entry(rng.choice(open_ids))
            if entry.status != "served" or entry.order_id is None:
                continue
            decided.add(entry.id)
            fate = rng.random()
            if fate < 0.15:
                pay(entry.order_id, 1)
            elif fate < 0.45:
                cancel(entry.order_id)  # serves the next entry in the cancel's call

    def buyer(n: int) -> None:
        rng = random.Random(n)
        for _ in range(ROUNDS):
            time.sleep(rng.random() * 0.03)  # pacing: the run spans many order lives
            try:
                order = service.create_unpaid_order(f"buyer-{n}", holds={RID: ask(rng)})
            except HoldRefused as refused:
                with lock:
                    outcomes[f"refused_{refused.reason}"] += 1
                continue
            except UnpaidOrderLimitReached:
                with lock:
                    outcomes["limit"] += 1
                continue
            with lock:
                outcomes["created"] += 1
            fate = rng.random()
            time.sleep(rng.random() * 0.15)  # the order's life is ~0.12 s: some pay late
            seats = order.holds[RID]
            if fate < 0.1:
                pay(order.id, seats if isinstance(seats, int) else len(seats))
            elif fate < 0.4:
                cancel(order.id)

    for k in range(EARLY_WAITERS):
        entries.append(service.wait_for(f"waiter-{k}", RID).id)
    helpers = [
        threading.Thread(target=f) for f in (monitor, sweeper, ticker, queue_users, served_fates)
    ]
    started = time.monotonic()
    for thread in helpers:
        thread.start()
    try:
        errors = errors_of_threads(buyer, [(n,) for n in range(THREADS)], timeout_s=120)
        while len(entries) < WAITERS and helpers[3].is_alive():  # every user has queued
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in helpers:
            thread.join(30)
    race_s = time.monotonic() - started
    assert not errors, errors[:3]
    clock.advance(s=1)  # past every order's expiry (ttl 0.3 s) and late-payment window
    service.sweep_expired()
    assert service.serving.drain(30)
    service.reconcile()

    final = seat_sample(engine, RID)
    served = [e for e, status, _ in final.entries if status == "served"]
    still = [e for e, status, _ in final.entries if status == "waiting"]
    free = [name for name, (state, _, _) in final.units.items() if state == "free"]
    print(f"race {race_s:.1f} s, {samples} samples, {len(served)} served, {outcomes}")
    assert problems == []
    assert samples > 100
    assert len(final.entries) == WAITERS
    assert seat_problems(final) == []
    assert fifo_problems(final) == []
    assert not (free and still), f"seats {free} free while entries {still[:5]} wait"
    assert waiting_problems(engine, RID) == []
    assert unit_problems(engine, RID) == []
    assert sql_problems(engine) == []
    now_ms = clock()
    assert index_problems(service.resource_index, engine, [RID], now_ms) == []
    assert unit_index_problems(service.resource_index, engine, RID, now_ms) == []
    # The race happened: seats came back to the queue, pairs collided, some were paid for.
    assert len(served) > 20, outcomes
    assert outcomes["refused_taken"] > 0, outcomes
    assert outcomes["paid"] > 0, outcomes


def test_a_queue_takes_more_than_ten_users_one_after_another(
    make_service: Callable[..., OrderService],
) -> None:
    """Found by the race above, on PostgreSQL: the add's ``ON CONFLICT (resource_id,
    user_id) WHERE status = $n`` names the partial index's predicate by a bound parameter.
    PostgreSQL infers the arbiter index from custom plans (the value folded in), but once
    psycopg prepares the insert (its 6th run on a connection) and the plan cache builds a
    generic plan (5 runs later), the predicate no longer matches and every add on that
    connection fails: "there is no unique or exclusion constraint matching the ON CONFLICT
    specification" (StoreUnavailable). One add at a time keeps one pooled connection."""
    service = make_service()
    service.set_capacity("ev-full", 1)
    service.create_unpaid_order("holder", holds={"ev-full": 1})
    entries = [service.wait_for(f"user-{k}", "ev-full") for k in range(15)]
    assert [e.status for e in entries] == ["waiting"] * 15
    assert [e.id for e in service.waiting("ev-full")] == [e.id for e in entries]
