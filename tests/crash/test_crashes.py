"""Crashes of real processes and servers: what survives a kill -9 or a restart, and what heals.

1. ``orders scheduler`` processes SIGKILLed at random moments while they sweep due orders,
   with payments racing the sweep: nothing is closed twice, nothing due is left behind, no
   payment is overridden. The same with reminders due instead (``ORDERS_REMIND_BEFORE_S``):
   each unpaid order gets its ``expiring`` event once, and a paid one none after its payment.
2. A checkout process SIGKILLed between a create's Redis admission and its SQL insert: the
   orphan slot holds the user until its own expiry and not a moment longer; reconcile keeps
   it; a retry with the same order id completes the order in that slot.
3. Redis restarted without persistence in the middle of a create/pay/sweep load: the SQL
   guard holds the limit throughout, and one reconcile makes the index equal SQL again.
4. The SQL connection dropped in the middle of a create's transaction: StoreUnavailable, no
   phantom member, and the next create works.

Every process and server a test starts, it stops by PID in a ``finally``. Servers listen on
unix sockets only. The random choices come from ``random.Random(seed)``; the seed is printed
and named in failures, and ``ORDERS_TEST_CRASH_SEED`` replays one. The lines starting with
``CRASH-REPORT`` (shown with ``pytest -s``) give the counts each run reached.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import queue
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Connection, Engine, event, func, select, text

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import OrderStatus, system_clock
from orders.errors import OrderClosed, StoreUnavailable, UnpaidOrderLimitReached
from orders.index.lease import SweeperLease
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.direct import Compiled
from orders.sql.models import events_table, orders_table
from orders.sql.predicates import reminder_due_at
from tests.support.clocks import ManualClock
from tests.support.monitor import LimitMonitor
from tests.support.processes import ChildProcess, child_env
from tests.support.redis_server import RedisServer
from tests.support.stores import write_orders_as_of_old

UNPAID = OrderStatus.UNPAID.value
OC = orders_table.c
EC = events_table.c
TERMINAL_EVENTS = {"paid", "cancelled", "closed"}


def crash_seed() -> int:
    """The seed of this test's random choices: ORDERS_TEST_CRASH_SEED, or a fresh one."""
    given = os.environ.get("ORDERS_TEST_CRASH_SEED")
    seed = int(given) if given else random.SystemRandom().randrange(2**32)
    print(f"crash test seed: {seed} (replay with ORDERS_TEST_CRASH_SEED={seed})")
    return seed


def stores_env(database_url: str, redis_url: str) -> dict[str, str]:
    """A child's environment (no ORDERS_* of ours, no PYTHONWARNINGS), plus the two stores."""
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    env.pop("PYTHONWARNINGS", None)
    return env


def sleep_until(monotonic_at: float) -> None:
    delay = monotonic_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def database_activity(engine: Engine) -> str:
    """PostgreSQL: the other sessions and the row locks they hold (to explain a stall)."""
    if engine.dialect.name != "postgresql":
        return ""
    with engine.connect() as conn:
        sessions = conn.execute(
            text(
                "SELECT pid, state, xact_start, wait_event_type, wait_event, left(query, 120) "
                "FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid()"
            )
        ).all()
        locks = conn.execute(
            text(
                "SELECT pid, locktype, mode, granted, count(*) FROM pg_locks "
                "WHERE database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "GROUP BY pid, locktype, mode, granted"
            )
        ).all()
    return "sessions:\n" + "\n".join(map(str, sessions)) + "\nlocks:\n" + "\n".join(map(str, locks))


def events_by_order(engine: Engine) -> dict[str, Counter[str]]:
    """For each order id, how many events of each kind it has."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(EC.order_id, EC.kind, func.count()).group_by(EC.order_id, EC.kind)
        ).all()
    found: dict[str, Counter[str]] = defaultdict(Counter)
    for order_id, kind, count in rows:
        found[order_id][kind] += count
    return found


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(OC.id, OC.status)).all())


def count_closed(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.scalar(select(func.count()).select_from(orders_table).where(OC.status == "closed"))
            or 0
        )


def event_problems(engine: Engine) -> list[str]:
    """Orders whose events are not one ``created`` plus one terminal event matching the
    status (none while unpaid)."""
    problems: list[str] = []
    events = events_by_order(engine)
    for order_id, status in statuses(engine).items():
        kinds = events.get(order_id, Counter())
        terminal = {k: n for k, n in kinds.items() if k in TERMINAL_EVENTS}
        expected = {} if status == UNPAID else {status: 1}
        if kinds["created"] != 1 or terminal != expected:
            problems.append(f"{order_id} ({status}): {dict(kinds)}")
    return problems


# ============================================================================================
# 1. kill -9 the scheduler while it sweeps
# ============================================================================================

SCHEDULER_ARGS = [
    "-m", "orders", "scheduler", "--interval", "0.05", "--lease-ttl", "0.5", "--batch-size", "50",
]  # fmt: skip
LEASE_ACQUIRED = '"event": "lease_acquired"'
CRASH_USERS = [f"cu{i}" for i in range(5)]


def insert_due_orders(service: OrderService, first: int, count: int) -> list[str]:
    """``count`` unpaid orders, each with its ``created`` event, all due a minute ago.

    Written directly in SQL (plus their now expired Redis members), as if created long ago.
    Expiries are distinct and later than those of every earlier call.
    """
    now_ms = system_clock()
    orders: list[dict[str, Any]] = []
    for j in range(count):
        expires_at_ms = now_ms - 60_000 + j
        orders.append(
            {
                "id": f"due-{first + j:07d}",
                "user_id": CRASH_USERS[(first + j) % len(CRASH_USERS)],
                "status": UNPAID,
                "created_at_ms": expires_at_ms - 1_800_000,
                "expires_at_ms": expires_at_ms,
                "updated_at_ms": expires_at_ms - 1_800_000,
            }
        )
    write_orders_as_of_old(service, orders)
    return [o["id"] for o in orders]


def crash_sizes(full_size: bool, dialect: str) -> dict[str, int]:
    """``queue``: the due orders waiting when each scheduler starts. The test tops the queue
    up before every start, so each process finds a sweep to be killed in. On a 2-core
    machine a scheduler closes about 20,000 due orders a second on SQLite and 3,000 on
    PostgreSQL (batches of 50), and the kills come 50-400 ms after it takes the lease."""
    if full_size:
        queue = {"sqlite": 30_000, "postgresql": 10_000}[dialect]
        return {"queue": queue, "kills": 40, "pays_per_kill": 15}
    queue = {"sqlite": 10_000, "postgresql": 3_000}[dialect]
    return {"queue": queue, "kills": 8, "pays_per_kill": 15}  # 8: CI time (40 with --full)


def kill_while_paying(
    child: ChildProcess,
    rng: random.Random,
    picks: list[str],
    pay: Callable[[str], None],
    delays_ms: list[int],
    seed: int,
) -> None:
    """Once ``child`` holds the lease, pay ``picks`` at random moments, and SIGKILL it
    50-400 ms after it took the lease (the delay goes to ``delays_ms``)."""
    try:
        # The lease of the process killed last lapses 0.5 s after its last renewal; this
        # one starts sweeping as soon as it holds the lease.
        active_at = child.wait_for(LEASE_ACQUIRED, 60)
        delay_s = rng.uniform(0.05, 0.4)
        delays_ms.append(round(delay_s * 1000))
        kill_at = active_at + delay_s
        for pay_at, order_id in zip(
            sorted(rng.uniform(active_at, kill_at) for _ in picks), picks, strict=True
        ):
            sleep_until(pay_at)
            pay(order_id)
        sleep_until(kill_at)
        returncode = child.sigkill()
    finally:
        child.close(signum=signal.SIGKILL)
    if returncode != -signal.SIGKILL:
        raise child.fail(f"seed {seed}: exited by itself ({returncode}) before the kill")


def finish_with_a_clean_scheduler(
    final: ChildProcess, left: Callable[[], int], what: str, engine: Engine, seed: int
) -> None:
    """``final`` takes over once the last lease lapses; when ``left()`` (the work still
    due) reaches 0, SIGTERM stops it after the batch in hand, and it must exit 0."""
    try:
        final.wait_for(LEASE_ACQUIRED, 60)
        deadline = time.monotonic() + 120
        while (due := left()) > 0:
            if final.proc.poll() is not None or time.monotonic() > deadline:
                raise final.fail(
                    f"seed {seed}: the clean scheduler left {due} {what}\n"
                    + database_activity(engine)
                )
            time.sleep(0.01)
        final.proc.send_signal(signal.SIGTERM)
        returncode = final.proc.wait(30)
    finally:
        final.close(signum=signal.SIGKILL)
    assert returncode == 0, final.log()[-3000:]


@pytest.mark.rotate("database_url")  # CI time: one engine a run, both with --full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_schedulers_killed_mid_sweep_close_every_due_order_exactly_once_and_never_a_paid_one(
    engine: Engine,
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    full_size: bool,
    tmp_path: Path,
) -> None:
    seed = crash_seed()
    rng = random.Random(seed)
    sizes = crash_sizes(full_size, engine.dialect.name)
    # The scheduler processes run on the system clock, and so does this service.
    service = OrderService(engine, redis_client, Settings(database_url=database_url))
    env = stores_env(database_url, redis_url)

    inserted: list[str] = []
    paid_ok: set[str] = set()
    pay_refused: set[str] = set()
    mid_sweep = finished = before_first_batch = 0
    delays_ms: list[int] = []

    def pay(order_id: str) -> None:
        try:
            service.mark_paid(order_id)
            paid_ok.add(order_id)
        except OrderClosed:
            pay_refused.add(order_id)

    for kill in range(sizes["kills"]):
        due = service.count_due()
        if due < sizes["queue"]:
            tranche = insert_due_orders(service, len(inserted), sizes["queue"] - due)
            inserted += tranche
        else:
            tranche = []
        closed_before = count_closed(engine)
        child = ChildProcess(SCHEDULER_ARGS, env, tmp_path / f"scheduler-{kill}.log")
        # Payments race the sweep: half on orders of the new tranche (mostly still
        # unpaid), half on any order (often closed already).
        picks = rng.sample(tranche, min(len(tranche), sizes["pays_per_kill"] // 2))
        tried = paid_ok | pay_refused
        while len(picks) < sizes["pays_per_kill"]:
            order_id = rng.choice(inserted)
            if order_id not in picks and order_id not in tried:
                picks.append(order_id)
        kill_while_paying(child, rng, picks, pay, delays_ms, seed)
        closed_now, due_now = count_closed(engine), service.count_due()
        if due_now == 0:
            finished += 1
        elif closed_now > closed_before:
            mid_sweep += 1
        else:
            before_first_batch += 1

    closed_before_final = count_closed(engine)
    # A clean scheduler takes over once the last lease lapses and finishes the job; SIGTERM
    # then stops it after the batch in hand.
    final = ChildProcess(SCHEDULER_ARGS, env, tmp_path / "scheduler-final.log")
    finish_with_a_clean_scheduler(final, service.count_due, "orders due", engine, seed)
    assert service.sweep_expired().closed == 0
    closed_by_final = count_closed(engine) - closed_before_final

    state = statuses(engine)
    counts = Counter(state.values())
    events = events_by_order(engine)
    closed_twice = [o for o, kinds in events.items() if kinds["closed"] > 1]
    paid_and_closed = [o for o, s in state.items() if s == "paid" and events[o]["closed"]]
    print(
        f"CRASH-REPORT schedulers-killed [{engine.dialect.name}] seed={seed} "
        f"kills={sizes['kills']} orders={len(inserted)} queue={sizes['queue']} "
        f"kills_mid_sweep={mid_sweep} kills_after_sweep_done={finished} "
        f"kills_before_first_commit={before_first_batch} "
        f"closed_before_final={closed_before_final} closed_by_final={closed_by_final} "
        f"paid={len(paid_ok)} pay_refused_closed={len(pay_refused)} "
        f"delays_ms={min(delays_ms)}..{max(delays_ms)} statuses={dict(counts)}"
    )
    assert len(state) == len(inserted)
    assert service.count_due() == 0, f"seed {seed}"
    assert counts[UNPAID] == 0, f"seed {seed}: due orders left unpaid"
    assert closed_twice == [], f"seed {seed}: closed twice: {closed_twice[:10]}"
    assert paid_and_closed == [], f"seed {seed}: paid, then closed: {paid_and_closed[:10]}"
    assert sorted(o for o in paid_ok if state[o] != "paid") == [], f"seed {seed}"
    assert sorted(o for o in pay_refused if state[o] != "closed") == [], f"seed {seed}"
    assert counts["paid"] == len(paid_ok), f"seed {seed}: paid orders nobody paid"
    assert counts["closed"] == len(inserted) - len(paid_ok)
    problems = event_problems(engine)
    assert problems == [], f"seed {seed}: {len(problems)} orders, e.g. {problems[:10]}"
    # No order is open, so the index must come out of a reconcile empty.
    service.reconcile()
    assert {u: m for u, m in service.index.members_of(CRASH_USERS).items() if m} == {}
    lease = SweeperLease(service.index.client, key_prefix=service.index.key_prefix)
    assert lease.owner() is None  # released by the clean scheduler


REMIND_BEFORE_S = "600"  # only switches reminders on: each order's remind_at_ms is written


def insert_orders_owing_a_reminder(service: OrderService, first: int, count: int) -> list[str]:
    """``count`` unpaid orders, each with its ``created`` event, whose reminder came due a
    minute ago and whose expiry is an hour ahead (nothing to close). Written in SQL as
    :func:`insert_due_orders` writes its orders; reminders due in the order of insertion."""
    now_ms = system_clock()
    orders: list[dict[str, Any]] = []
    for j in range(count):
        created_at_ms = now_ms - 600_000
        orders.append(
            {
                "id": f"rem-{first + j:07d}",
                "user_id": CRASH_USERS[(first + j) % len(CRASH_USERS)],
                "status": UNPAID,
                "created_at_ms": created_at_ms,
                "expires_at_ms": now_ms + 3_600_000,
                "updated_at_ms": created_at_ms,
                "remind_at_ms": now_ms - 60_000 + j,
            }
        )
    write_orders_as_of_old(service, orders)
    return [o["id"] for o in orders]


def count_reminders_due(engine: Engine) -> int:
    with engine.connect() as conn:
        query = (
            select(func.count()).select_from(orders_table).where(reminder_due_at(system_clock()))
        )
        return int(conn.scalar(query) or 0)


def count_reminded(engine: Engine) -> int:
    with engine.connect() as conn:
        query = select(func.count()).select_from(orders_table).where(OC.reminded_at_ms.is_not(None))
        return int(conn.scalar(query) or 0)


@pytest.mark.rotate("database_url")  # CI time: one engine a run, both with --full
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_schedulers_killed_mid_remind_write_every_reminder_once_and_none_after_a_payment(
    engine: Engine,
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    full_size: bool,
    tmp_path: Path,
) -> None:
    seed = crash_seed()
    rng = random.Random(seed)
    sizes = crash_sizes(full_size, engine.dialect.name)
    if not full_size:
        sizes["kills"] = 6  # CI time: 8 took 17-20 s a run on a 2-core machine (40: --full)
    service = OrderService(engine, redis_client, Settings(database_url=database_url))
    # Reminders switched on by the settings' own offset on SQLite, by an expiry policy's
    # on PostgreSQL: either way the scheduler must write them.
    switch = (
        {"ORDERS_POLICIES": json.dumps({"slow": {"ttl_s": 7200, "remind_before_s": 600}})}
        if engine.dialect.name == "postgresql"
        else {"ORDERS_REMIND_BEFORE_S": REMIND_BEFORE_S}
    )
    env = {**stores_env(database_url, redis_url), **switch}

    inserted: list[str] = []
    paid_ok: set[str] = set()
    mid_batches = finished = before_first_batch = 0
    delays_ms: list[int] = []

    def pay(order_id: str) -> None:
        service.mark_paid(order_id)  # nothing closes: every payment is taken
        paid_ok.add(order_id)

    for kill in range(sizes["kills"]):
        due = count_reminders_due(engine)
        tranche = (
            insert_orders_owing_a_reminder(service, len(inserted), sizes["queue"] - due)
            if due < sizes["queue"]
            else []
        )
        inserted += tranche
        reminded_before = count_reminded(engine)
        child = ChildProcess(SCHEDULER_ARGS, env, tmp_path / f"scheduler-{kill}.log")
        # Payments race the reminders: half on the new tranche (mostly not reminded yet),
        # half on any unpaid order (often reminded already).
        picks = rng.sample(tranche, min(len(tranche), sizes["pays_per_kill"] // 2))
        while len(picks) < sizes["pays_per_kill"]:
            order_id = rng.choice(inserted)
            if order_id not in picks and order_id not in paid_ok:
                picks.append(order_id)
        kill_while_paying(child, rng, picks, pay, delays_ms, seed)
        if count_reminders_due(engine) == 0:
            finished += 1
        elif count_reminded(engine) > reminded_before:
            mid_batches += 1
        else:
            before_first_batch += 1

    reminded_before_final = count_reminded(engine)
    final = ChildProcess(SCHEDULER_ARGS, env, tmp_path / "scheduler-final.log")
    left = functools.partial(count_reminders_due, engine)
    finish_with_a_clean_scheduler(final, left, "reminders due", engine, seed)
    reminded_by_final = count_reminded(engine) - reminded_before_final

    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(*orders_table.c)).all()}
        expiring: dict[str, list[Any]] = defaultdict(list)
        paid_event_id: dict[str, int] = {}
        for ev in conn.execute(
            select(EC.id, EC.order_id, EC.kind, EC.at_ms).where(EC.kind.in_(["expiring", "paid"]))
        ).all():
            if ev.kind == "expiring":
                expiring[ev.order_id].append(ev)
            else:
                paid_event_id[ev.order_id] = ev.id
    counts = Counter(row.status for row in rows.values())
    twice = [o for o, evs in expiring.items() if len(evs) > 1]
    # Unpaid at the end: its reminder was due all along, so it must have been written.
    lost = [
        o
        for o, row in rows.items()
        if row.status == UNPAID
        and (len(expiring[o]) != 1 or row.reminded_at_ms is None or row.remind_at_ms is not None)
    ]
    # Paid: reminded before the payment (its compare-and-set saw the order unpaid, so its
    # event precedes the payment's in the log), or never (the payment came first; then
    # remind_at_ms stays as it was, and nothing reads it while the order is paid).
    paid = [o for o, row in rows.items() if row.status == "paid"]
    paid_reminded = [o for o in paid if expiring[o]]
    after_paid = [o for o in paid_reminded if expiring[o][0].id > paid_event_id[o]]
    unmarked = [o for o in paid if not expiring[o] and rows[o].reminded_at_ms is not None]
    # The row agrees with its event.
    mismatched = [
        o
        for o, evs in expiring.items()
        if len(evs) == 1
        and (rows[o].reminded_at_ms != evs[0].at_ms or rows[o].remind_at_ms is not None)
    ]
    # The clocks of a payment and a batch are read before their transactions, so a payment
    # committed after the reminder may carry an earlier paid_at_ms: counted, not a failure.
    clock_skews = [
        expiring[o][0].at_ms - rows[o].paid_at_ms
        for o in paid_reminded
        if expiring[o][0].at_ms > rows[o].paid_at_ms
    ]
    print(
        f"CRASH-REPORT schedulers-killed-reminding [{engine.dialect.name}] seed={seed} "
        f"kills={sizes['kills']} orders={len(inserted)} queue={sizes['queue']} "
        f"kills_mid_reminding={mid_batches} kills_after_reminding_done={finished} "
        f"kills_before_first_commit={before_first_batch} "
        f"reminded_before_final={reminded_before_final} reminded_by_final={reminded_by_final} "
        f"paid={len(paid_ok)} paid_after_reminder={len(paid_reminded)} "
        f"paid_before_reminder={len(paid) - len(paid_reminded)} "
        f"paid_at_before_reminder_clock={len(clock_skews)} "
        f"max_skew_ms={max(clock_skews, default=0)} "
        f"delays_ms={min(delays_ms)}..{max(delays_ms)} statuses={dict(counts)}"
    )
    assert len(rows) == len(inserted)
    assert counts["closed"] == 0, f"seed {seed}: orders closed before their expiry"
    assert sorted(paid) == sorted(paid_ok), f"seed {seed}"
    assert counts[UNPAID] == len(inserted) - len(paid_ok)
    assert twice == [], f"seed {seed}: reminded twice: {twice[:10]}"
    assert lost == [], f"seed {seed}: {len(lost)} unpaid orders not reminded, e.g. {lost[:10]}"
    assert after_paid == [], f"seed {seed}: reminded after the payment: {after_paid[:10]}"
    assert unmarked == [], f"seed {seed}: paid, never reminded, marked reminded: {unmarked[:5]}"
    assert mismatched == [], f"seed {seed}: row and expiring event disagree: {mismatched[:5]}"
    problems = event_problems(engine)
    assert problems == [], f"seed {seed}: {len(problems)} orders, e.g. {problems[:10]}"
    lease = SweeperLease(service.index.client, key_prefix=service.index.key_prefix)
    assert lease.owner() is None


# ============================================================================================
# 2. kill -9 between the Redis admission and the SQL insert
# ============================================================================================


class RecordingClock:
    """The system clock, remembering what it answered (to know the ``now`` of a create)."""

    def __init__(self) -> None:
        self.readings: list[int] = []

    def __call__(self) -> int:
        now = system_clock()
        self.readings.append(now)
        return now


@pytest.mark.timeout(120)
def test_a_create_killed_between_redis_and_sql_holds_its_slot_until_its_expiry_and_no_longer(
    engine: Engine,
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    # Two creates crash in one checkout process: "orphan" is never retried; "resumed" is.
    orphan_ttl_s, resumed_ttl_s = 2.0, 60.0
    creates = [
        {"user": "ua", "order_id": "orphan-1", "ttl_s": orphan_ttl_s, "limit": 1},
        {"user": "ub", "order_id": "resumed-1", "ttl_s": resumed_ttl_s, "limit": 1},
    ]
    markers = tmp_path / "markers"
    markers.mkdir()
    worker = ChildProcess(
        ["-m", "tests.support.workers.crash", str(markers), json.dumps(creates)],
        stores_env(database_url, redis_url),
        tmp_path / "worker.log",
    )
    try:
        for spec in creates:
            order_id = str(spec["order_id"])
            deadline = time.monotonic() + 60
            while not (markers / f"{order_id}.admitted").exists():
                if (markers / f"{order_id}.error").exists():
                    raise worker.fail((markers / f"{order_id}.error").read_text())
                if worker.proc.poll() is not None:
                    raise worker.fail("exited before both creates were admitted")
                assert time.monotonic() < deadline, "the creates were not admitted in time"
                time.sleep(0.005)
        returncode = worker.sigkill()
    finally:
        worker.close(signum=signal.SIGKILL)
    assert returncode == -signal.SIGKILL

    clock = RecordingClock()
    settings = Settings(database_url=database_url)
    service = OrderService(engine, redis_client, settings, clock=clock)
    orphan_score = service.index.members("ua")["orphan-1"]
    resumed_score = service.index.members("ub")["resumed-1"]
    assert statuses(engine) == {}  # both died before their SQL insert

    def before_orphan_expiry() -> None:
        assert system_clock() < orphan_score, "too slow: the orphan expired before the checks"

    # The orphan holds the user's only slot: refused by Redis (SQL holds no order to count).
    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("ua", limit=1)
    assert info.value.open_count == 1
    assert 0 < info.value.retry_after_s <= orphan_ttl_s
    before_orphan_expiry()

    # Reconcile cannot tell a crashed create from one in flight, so both members stay.
    report = service.reconcile()
    assert report.kept_in_flight == 2
    assert report.removed_terminal == report.added == 0
    assert service.index.members("ua") == {"orphan-1": orphan_score}
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("ua", limit=1)
    before_orphan_expiry()

    # The retry of the crashed create finishes it in the slot it already has, with its expiry.
    resumed = service.create_unpaid_order("ub", order_id="resumed-1", ttl_s=5, limit=1)
    assert resumed.expires_at_ms == resumed_score
    assert service.index.members("ub") == {"resumed-1": resumed_score}
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("ub", limit=1)  # one slot, not two
    assert statuses(engine) == {"resumed-1": UNPAID}
    assert event_problems(engine) == []
    before_orphan_expiry()

    # No sweep runs. Poll the orphan's user: refused while now < expiry, admitted by the
    # first attempt whose now reaches it.
    attempts: list[tuple[int, bool]] = []
    deadline = time.monotonic() + orphan_ttl_s + 10
    while True:
        clock.readings.clear()
        try:
            admitted = service.create_unpaid_order(
                "ua", order_id=f"after-{len(attempts)}", ttl_s=30, limit=1
            )
        except UnpaidOrderLimitReached:
            attempts.append((clock.readings[0], False))
            assert time.monotonic() < deadline, "the orphan's slot never freed"
            time.sleep(0.005)
            continue
        attempts.append((clock.readings[0], True))
        break
    first_now, _ = attempts[-1]
    refused_late = [now - orphan_score for now, ok in attempts if not ok and now >= orphan_score]
    print(
        f"CRASH-REPORT create-killed [{engine.dialect.name}] attempts={len(attempts)} "
        f"admitted_at_expiry_plus_ms={first_now - orphan_score}"
    )
    assert refused_late == [], "refused after the orphan's expiry"
    assert first_now >= orphan_score
    assert first_now - orphan_score < 1000  # the polling interval plus a busy machine
    assert service.index.members("ua") == {admitted.id: admitted.expires_at_ms}
    assert statuses(engine) == {"resumed-1": UNPAID, admitted.id: UNPAID}

    # Retrying the completed create once more returns the same order, though its user is at
    # the limit (the limit counts the order being retried).
    again = service.create_unpaid_order("ub", order_id="resumed-1", limit=1)
    assert dataclasses.replace(again, read_at_ms=resumed.read_at_ms) == resumed
    assert service.index.members("ub") == {"resumed-1": resumed_score}


# ============================================================================================
# 3. Redis restarted without persistence in the middle of a load
# ============================================================================================

LOAD_USERS = [f"lu{i:02d}" for i in range(20)]
LOAD_LIMIT = 2


@pytest.fixture
def own_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    """A redis-server this test may stop and start again (without persistence)."""
    folder = Path(tempfile.mkdtemp(prefix="ocr", dir="/tmp"))
    server = RedisServer(folder, binary=redis_binary)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_redis_restarted_without_persistence_under_load_never_breaks_the_limit_and_reconcile_heals(
    engine: Engine, database_url: str, own_redis: RedisServer, full_size: bool
) -> None:
    seed = crash_seed()
    load_s = 20.0 if full_size else 6.0
    settings = Settings(database_url=database_url, redis_url=own_redis.url, unpaid_limit=LOAD_LIMIT)
    client = build_redis(settings)
    service = OrderService(engine, client, settings)  # the system clock
    stop = threading.Event()
    errors: list[str] = []
    counts: Counter[str] = Counter()
    counts_lock = threading.Lock()
    to_pay: queue.Queue[tuple[float, str]] = queue.Queue()

    def count(what: str) -> None:
        with counts_lock:
            counts[what] += 1

    def guarded(body: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                body(*args)
            except BaseException as exc:
                errors.append(f"{type(exc).__name__}: {exc}")

        return run

    def creator(rng: random.Random) -> None:
        while not stop.is_set():
            ttl_s = rng.uniform(0.2, 1.0)
            try:
                order = service.create_unpaid_order(rng.choice(LOAD_USERS), ttl_s=ttl_s)
            except UnpaidOrderLimitReached:
                count("create_refused")
            except StoreUnavailable as exc:
                count(f"create_unavailable_{exc.store}")
            else:
                count("created")
                if rng.random() < 0.4:
                    to_pay.put((time.monotonic() + rng.uniform(0, ttl_s * 1.2), order.id))
            time.sleep(rng.uniform(0, 0.004))

    def payer() -> None:
        while not stop.is_set():
            try:
                pay_at, order_id = to_pay.get(timeout=0.05)
            except queue.Empty:
                continue
            sleep_until(pay_at)
            try:
                service.mark_paid(order_id)
                count("paid")
            except OrderClosed:
                count("pay_too_late")
            except StoreUnavailable as exc:
                count(f"pay_unavailable_{exc.store}")

    def sweeper() -> None:
        sweeping = Sweeper(service, interval_s=0.05, lease_ttl_s=1.0, batch_size=100)
        try:
            while not stop.is_set():
                stop.wait(min(sweeping.tick(), 0.05))
        finally:
            sweeping.close()

    monitor = LimitMonitor(engine, users=LOAD_USERS, limit=LOAD_LIMIT)
    threads = [threading.Thread(target=guarded(creator, random.Random(seed + i))) for i in range(4)]
    threads += [threading.Thread(target=guarded(payer)), threading.Thread(target=guarded(sweeper))]
    try:
        monitor.start()
        for thread in threads:
            thread.start()
        time.sleep(load_s / 2)
        created_before_restart = counts["created"]
        own_redis.stop()  # SIGTERM without save points or AOF: the data is gone
        time.sleep(0.3)
        own_redis.start()
        time.sleep(load_s / 2)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
        monitor.stop()
    assert not any(thread.is_alive() for thread in threads)
    epoch_rebuilt = service.index.epoch.get() is not None  # the sweeper's own rebuild

    # One reconcile at a frozen instant, then compare with SQL at that same instant.
    at_ms = system_clock()
    frozen = OrderService(engine, client, settings, clock=ManualClock(at_ms))
    before = frozen.reconcile(dry_run=True)  # what was still wrong after the load
    report = frozen.reconcile()
    with engine.connect() as conn:
        rows = conn.execute(
            select(OC.user_id, OC.id, OC.expires_at_ms).where(
                OC.status == UNPAID, OC.expires_at_ms > at_ms
            )
        ).all()
    sql_open: dict[str, dict[str, int]] = defaultdict(dict)
    for user, order_id, expires_at_ms in rows:
        sql_open[user][order_id] = expires_at_ms
    redis_open = {u: m for u, m in frozen.index.members_of(LOAD_USERS).items() if m}
    unavailable = {k: v for k, v in counts.items() if "unavailable" in k}
    print(
        f"CRASH-REPORT redis-restart [{engine.dialect.name}] seed={seed} load_s={load_s} "
        f"samples={monitor.samples} violations={len(monitor.violations)} "
        f"max_open_seen={monitor.max_sql} counts={dict(counts)} "
        f"created_before_restart={created_before_restart} epoch_rebuilt={epoch_rebuilt} "
        f"wrong_before_final_reconcile={before.fixes} final_reconcile={report.as_dict()} "
        f"open_at_end={sum(len(m) for m in sql_open.values())}"
    )
    client.close()
    assert errors == [], f"seed {seed}"
    assert monitor.violations == [], f"seed {seed}: {monitor.violations[:10]}"
    assert monitor.samples >= 100
    assert counts["created"] > created_before_restart > 0  # load ran on both sides of it
    assert sum(v for k, v in unavailable.items() if k.startswith("create_")) > 0  # felt it
    assert [k for k in unavailable if k.startswith("pay_")] == []  # never refuses a payment
    assert redis_open == dict(sql_open), f"seed {seed}"
    assert report.kept_in_flight == 0
    assert event_problems(engine) == []


# ============================================================================================
# 4. the SQL connection dropped in the middle of the create's transaction
# ============================================================================================


def drop_connection(conn: Connection, how: str) -> None:
    """Break ``conn`` the way ``how`` says, from inside a statement about to run on it."""
    if how == "invalidate":
        conn.invalidate()  # SQLAlchemy closes the DBAPI connection and knows it
        return
    # "server": the far end goes away and nobody on our side is told.
    dbapi_connection: Any = conn.connection.dbapi_connection
    if conn.dialect.name == "postgresql":
        backend_pid = dbapi_connection.info.backend_pid
        with conn.engine.connect() as other:
            # With a timeout, pg_terminate_backend waits until the backend is gone.
            assert other.scalar(text(f"SELECT pg_terminate_backend({int(backend_pid)}, 5000)"))
    else:
        dbapi_connection.close()  # SQLite has no server: close it behind the pool's back


def before_each_statement(
    monkeypatch: pytest.MonkeyPatch, engine: Engine, hook: Callable[[Connection, str], None]
) -> Callable[[], None]:
    """Call ``hook(conn, sql)`` before each statement run on ``engine``: SQLAlchemy's (its
    cursor event) and those sent straight to the driver (``orders.sql.direct``), which the
    event does not see. Returns what stops it (the monkeypatch ends with the test)."""

    def on_cursor(conn: Connection, _cursor: Any, sql: str, *_: Any) -> None:
        hook(conn, sql)

    def hooked(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Compiled, conn: Connection, params: Any) -> Any:
            if conn.engine.pool is engine.pool:  # its autocommit twin too
                if not conn.in_transaction():  # where the cursor event fires: begun
                    conn.begin()
                hook(conn, self.sql)
            return method(self, conn, params)

        return run

    monkeypatch.setattr(Compiled, "run", hooked(Compiled.run))
    monkeypatch.setattr(Compiled, "execute", hooked(Compiled.execute))
    event.listen(engine, "before_cursor_execute", on_cursor)
    return lambda: (event.remove(engine, "before_cursor_execute", on_cursor), monkeypatch.undo())


@pytest.mark.parametrize("how", ["invalidate", "server"])
@pytest.mark.parametrize(
    "statement", [f"INSERT INTO {orders_table.name} ", f"INSERT INTO {events_table.name} "]
)
def test_a_connection_dropped_during_the_create_transaction_leaves_no_phantom_slot(
    engine: Engine,
    database_url: str,
    redis_client: redis.Redis,
    clock: ManualClock,
    statement: str,
    how: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = Settings(database_url=database_url, unpaid_limit=2)
    service = OrderService(engine, redis_client, settings, clock=clock)
    kept = service.create_unpaid_order("u1", order_id="kept")
    armed = [True]

    def break_it(conn: Connection, sql: str) -> None:
        # On PostgreSQL both inserts are one statement (WITH created AS (INSERT ...)).
        if armed[0] and statement in sql:
            armed[0] = False
            drop_connection(conn, how)

    stop = before_each_statement(monkeypatch, engine, break_it)
    try:
        with pytest.raises(StoreUnavailable) as info:
            service.create_unpaid_order("u1", order_id="doomed")
    finally:
        stop()
    assert not armed[0]
    assert info.value.store == "sql"
    assert service.index.members("u1") == {"kept": kept.expires_at_ms}  # no phantom
    assert statuses(engine) == {"kept": UNPAID}
    assert event_problems(engine) == []

    # The retry takes the second slot (there is no phantom in it), on a working pool.
    clock.advance(ms=1)
    retried = service.create_unpaid_order("u1", order_id="doomed")
    assert service.index.members("u1") == {
        "kept": kept.expires_at_ms,
        "doomed": retried.expires_at_ms,
    }
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1")
    assert statuses(engine) == {"kept": UNPAID, "doomed": UNPAID}
    assert event_problems(engine) == []
