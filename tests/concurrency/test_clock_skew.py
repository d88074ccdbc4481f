"""Checkout hosts and a scheduler whose clocks disagree by up to 2 s either way; and the
backlog warning with hosts whose clocks are further off than its threshold.

Two checkout processes (clocks 2 s behind and 2 s ahead of the true one, the system clock
here) create orders for a few shared users at a small limit and pay a share of them near
their expiry; one scheduler process (true clock) sweeps. A monitor in the test samples each
user's unpaid orders in SQL all along.

What must hold whatever the clocks: the limit in SQL at every sample (and structurally, the
slot index: no two unpaid orders of a user in one slot); exactly one of pay and close wins
for each order; every acknowledged create and payment is in SQL; the index equals SQL after
reconcile. What the clocks do change, and the test measures: how early or late an order
closes against its expiry in true time, by closer (the scheduler's sweep, or a checkout
closing an expired holder to reuse its slot). Each close is exact in its closer's clock
(``closed_at_ms >= expires_at_ms`` in SQL, asserted); in true time it is shifted by the
closer's clock minus the creator's.

The backlog warning (``orders.scheduler.log.BacklogWatch``) is then driven in one process,
on clocks the test moves: a sweeper, and creating services whose clocks run 9 s behind and
ahead of its own, past the 5 s threshold. Orders from the host behind look overdue the
moment they appear; nothing is late, so nothing must be warned, over many sweeps. A real
backlog under the same skew (each sweep closing fewer orders than fall due; or, on
PostgreSQL, an order whose row another transaction holds while the sweeps close the rest)
is still warned, as soon as it is older than the threshold, and its end is logged.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.domain import SweepResult
from orders.scheduler.sweeper import LOGGER_NAME, Sweeper
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock, Monotonic
from tests.support.monitor import LimitMonitor
from tests.support.processes import started
from tests.support.reports import figures
from tests.support.stores import sql_rows
from tests.support.workers.hosts import MODULE as HOSTS

OC, EC = orders_table.c, events_table.c
USERS = [f"shopper-{n}" for n in range(8)]
LIMIT = 2
#: The hosts' clocks against the true one, ms.
CHECKOUT_OFFSETS = {"behind": -2000, "ahead": 2000}
SCHEDULER_OFFSET = 0
SWEEP_INTERVAL_S = 0.5


def checkout_spec(name: str, run_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "offset_ms": CHECKOUT_OFFSETS[name],
        "users": USERS,
        "limit": LIMIT,
        "ttl_ms": [2500, 4000],
        "threads": 3,
        "pause_s": [0.03, 0.1],
        "run_s": run_s,
        "pay_share": 0.4,
        "pay_around_ms": [-600, 600],
        "seed": "skew",
    }


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_limit_and_one_winner_hold_across_hosts_with_skewed_clocks(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    full_size: bool,
    tmp_path: Path,
) -> None:
    run_s = 30.0 if full_size else 8.0
    specs = [("checkout", checkout_spec(name, run_s)) for name in CHECKOUT_OFFSETS]
    ticks = tmp_path / "scheduler.ticks"
    specs.append(
        (
            "scheduler",
            {
                "name": "scheduler",
                "offset_ms": SCHEDULER_OFFSET,
                "interval_s": SWEEP_INTERVAL_S,
                "lease_ttl_s": 5,
                "ticks_path": str(ticks),
            },
        )
    )
    with (
        started(
            specs,
            database_url=database_url,
            redis_options=redis_options,
            log_dir=tmp_path,
            module=HOSTS,
        ) as workers,
        LimitMonitor(engine, limit=LIMIT) as monitor,
    ):
        for worker in workers:
            worker.go()
        checkouts = [worker.result(timeout_s=run_s + 60) for worker in workers[:2]]
        workers[2].stop()
        workers[2].result(timeout_s=30)

    for r in checkouts:
        assert r["errors"] == 0, r["error_samples"]
    offset_of = {r["name"]: CHECKOUT_OFFSETS[r["name"]] for r in checkouts}
    created = {oid: (r["name"], *v) for r in checkouts for oid, v in r["created"].items()}
    paid = {oid: ref for r in checkouts for oid, ref in r["paid"].items()}
    refused = {oid: st for r in checkouts for oid, st in r["pay_refused"].items()}
    reuse_closer = {oid: r["name"] for r in checkouts for oid in r.get("slot_reuse_closed", [])}
    assert sum(len(r.get("slot_reuse_closed", [])) for r in checkouts) == len(reuse_closer)

    # --- the limit, at every sample and in the slot index ---
    assert monitor.samples > 50
    assert monitor.max_unpaid <= LIMIT
    assert monitor.violations == [], monitor.violations[:5]
    rows = sql_rows(engine)
    unpaid = [row for row in rows.values() if row.status == "unpaid"]
    unpaid_slots = Counter((row.user_id, row.slot) for row in unpaid)
    assert all(n == 1 and 1 <= slot <= LIMIT for (_, slot), n in unpaid_slots.items())

    # --- every acknowledged create and payment is there; one winner per order ---
    assert set(rows) == set(created)
    for oid, (_, user, expires) in created.items():
        assert (rows[oid].user_id, rows[oid].expires_at_ms) == (user, expires)
    assert {oid: rows[oid].payment_ref for oid in paid} == paid
    assert all(rows[oid].status == status == "closed" for oid, status in refused.items())
    kinds = events_by_order(engine)
    for oid, row in rows.items():
        expected = ["created"] if row.status == "unpaid" else ["created", row.status]
        # A payment the close beat is a refund owed, recorded after the close.
        expected += ["payment_refused"] if oid in refused else []
        assert kinds[oid] == expected, (oid, kinds[oid])
    closed = {oid: row for oid, row in rows.items() if row.status == "closed"}
    # Exact in each closer's clock: no close before the expiry the closer read.
    assert all(row.closed_at_ms >= row.expires_at_ms for row in closed.values())
    reuse = slot_reuse_closes(engine)
    assert set(reuse_closer) == reuse  # each one closed by the process that reported it

    # --- the index equals SQL after reconcile, then nothing is left once all is due ---
    frozen = ManualClock(max(row.updated_at_ms for row in rows.values()))
    settings = Settings(database_url=database_url, unpaid_limit=LIMIT, **redis_options)
    checker = OrderService(engine, redis_client, settings, clock=frozen)
    checker.reconcile()
    for user in USERS:
        members = checker.index.members(user)
        assert redis_client.zcard(checker.index.key(user)) <= LIMIT
        open_in_sql = {
            oid: row.expires_at_ms
            for oid, row in rows.items()
            if row.user_id == user and row.status == "unpaid" and row.expires_at_ms > frozen()
        }
        assert members == open_in_sql, user
    frozen.set(max(row.expires_at_ms for row in rows.values()))
    checker.sweep_expired()
    assert checker.count_due() == 0
    assert all(redis_client.zcard(checker.index.key(user)) == 0 for user in USERS)

    # --- figures: each close against its creator's expiry, in true time ---
    lags: dict[str, list[int]] = defaultdict(list)
    for oid, row in closed.items():
        creator = created[oid][0]
        closer = reuse_closer.get(oid, "scheduler")
        closer_offset = offset_of.get(closer, SCHEDULER_OFFSET)
        true_lag = (row.closed_at_ms - closer_offset) - (row.expires_at_ms - offset_of[creator])
        lags[f"{closer} closing {creator}'s"].append(true_lag)
        lags["all"].append(true_lag)
    late_pays = [
        (row.paid_at_ms - offset_of[ref.split("-pay-")[0]])
        - (row.expires_at_ms - offset_of[created[oid][0]])
        for oid, ref in paid.items()
        if (row := rows[oid]) is not None
    ]
    by_status = Counter(row.status for row in rows.values())
    print(
        f"\n[clock skew, checkouts {CHECKOUT_OFFSETS} ms, scheduler {SCHEDULER_OFFSET} ms] "
        f"{len(rows)} orders ({dict(by_status)}), refused at the limit "
        f"{sum(r['refused'] for r in checkouts)}, payments refused (closed first) "
        f"{len(refused)}, monitor samples {monitor.samples}, max unpaid {monitor.max_unpaid}"
    )
    for name, values in sorted(lags.items()):
        print(f"  close - expiry, true ms, {name} ({len(values)}): {figures(values)}")
    print(f"  payment - expiry, true ms, of paid orders ({len(late_pays)}): {figures(late_pays)}")


def events_by_order(engine: Engine) -> dict[str, list[str]]:
    """Each order's event kinds in the order they were written."""
    query = select(EC.order_id, EC.kind).order_by(EC.id)
    found: dict[str, list[str]] = defaultdict(list)
    with engine.connect() as conn:
        for order_id, kind in conn.execute(query):
            found[order_id].append(kind)
    return found


def slot_reuse_closes(engine: Engine) -> set[str]:
    """The orders a create closed to take their slot (their closed event says so)."""
    query = select(EC.order_id, EC.data).where(EC.kind == "closed")
    with engine.connect() as conn:
        return {
            oid for oid, data in conn.execute(query) if (data or {}).get("trigger") == "slot_reuse"
        }


# --- the backlog warning, with hosts' clocks further off than its threshold ------------------

#: The creating hosts' clocks against the sweeper's, ms: beyond the 5 s backlog threshold.
FAR_OFFSETS = {"behind": -9000, "ahead": 9000}
BACKLOG_LAG_S = 5.0
STEP_S = 0.5


@dataclass
class SkewedDeployment:
    """A sweeper on the test's clock and creating services on clocks ``FAR_OFFSETS`` off;
    :meth:`step` sweeps once and moves the sweeper's clock and monotonic clock on."""

    clock: ManualClock
    mono: Monotonic
    sweeping: OrderService
    creators: dict[str, OrderService]
    sweeper: Sweeper
    rng: random.Random
    created: int = 0

    def create(self, host: str, count: int) -> None:
        for _ in range(count):
            self.created += 1
            self.creators[host].create_unpaid_order(
                f"user-{self.created % 40}",
                order_id=f"{host}-{self.created}",
                ttl_s=self.rng.uniform(2.5, 4.0),
                limit=1000,
            )

    def step(self) -> None:
        self.sweeper.tick()
        self.clock.advance(s=STEP_S)
        self.mono.advance(STEP_S)


@pytest.fixture
def skewed(
    engine: Engine, redis_client: redis.Redis, database_url: str, redis_options: dict[str, Any]
) -> Iterator[SkewedDeployment]:
    clock, mono = ManualClock(), Monotonic()
    settings = Settings(database_url=database_url, **redis_options)
    sweeping = OrderService(engine, redis_client, settings, clock=clock)

    def offset(ms: int) -> Callable[[], int]:
        return lambda: clock() + ms

    creators = {
        host: OrderService(engine, redis_client, settings, clock=offset(ms))
        for host, ms in FAR_OFFSETS.items()
    }
    sweeper = Sweeper(sweeping, backlog_lag_s=BACKLOG_LAG_S, summary_period_s=3600, monotonic=mono)
    yield SkewedDeployment(clock, mono, sweeping, creators, sweeper, random.Random(24))
    sweeper.close()


def backlog_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    return [line for line in lines if line["event"].startswith("backlog")]


def test_hosts_clocks_far_off_the_sweepers_raise_no_backlog_warning_while_nothing_is_late(
    skewed: SkewedDeployment,
    engine: Engine,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    # An order of the host behind also lands after each sweep's last batch, before it
    # reads the earliest expiry: the sweep leaves it due, the next closes it.
    earliest = skewed.sweeping.earliest_unpaid_expiry_ms

    def with_a_landing() -> int | None:
        skewed.create("behind", 1)
        return earliest()

    monkeypatch.setattr(skewed.sweeping, "earliest_unpaid_expiry_ms", with_a_landing)
    for _ in range(120):  # a minute of the sweeper's time, a sweep every 0.5 s
        skewed.create("behind", 2)
        skewed.create("ahead", 2)
        skewed.step()

    assert backlog_lines(caplog) == []
    # By the clocks alone many of those closes were more than 5 s late.
    rows = sql_rows(engine).values()
    lags = [row.closed_at_ms - row.expires_at_ms for row in rows if row.status == "closed"]
    assert len(lags) > 300
    assert sum(lag > BACKLOG_LAG_S * 1000 for lag in lags) > 100


def test_a_real_backlog_is_still_warned_within_the_threshold_under_the_same_skew(
    skewed: SkewedDeployment,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    for _ in range(10):
        skewed.create("behind", 2)
        skewed.step()
    assert backlog_lines(caplog) == []

    # Each sweep now closes 2 orders, and 4 fall due every 0.5 s.
    sweep_expired = skewed.sweeping.sweep_expired

    def too_small(**kwargs: Any) -> SweepResult:
        return sweep_expired(**{**kwargs, "batch_size": 2}, max_batches=1)

    monkeypatch.setattr(skewed.sweeping, "sweep_expired", too_small)
    behind_from = skewed.mono()
    warned_at = None
    for _ in range(30):
        skewed.create("behind", 4)
        if warned_at is None and backlog_lines(caplog):
            warned_at = skewed.mono() - STEP_S  # the sweep of the step before
        skewed.step()
    monkeypatch.undo()
    for _ in range(10):
        skewed.step()

    assert [line["event"] for line in backlog_lines(caplog)] == ["backlog", "backlog_cleared"]
    assert warned_at is not None
    # The first sweep left orders due; the warning comes once they are older than the
    # threshold in the sweeper's sight (from the sweep before it), within a sweep more.
    assert BACKLOG_LAG_S - STEP_S <= warned_at - behind_from <= BACKLOG_LAG_S + STEP_S
    assert skewed.sweeping.count_due() == 0


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_an_order_a_blocked_sweep_cannot_close_is_warned_amid_skewed_orders_it_closes(
    skewed: SkewedDeployment, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    for _ in range(4):
        skewed.create("behind", 2)
        skewed.step()
    stuck = skewed.creators["behind"].create_unpaid_order("stuck", ttl_s=3)
    # Another transaction holds its row (PostgreSQL: the sweep skips it, SKIP LOCKED),
    # while each sweep closes more orders than it leaves due. (Without the idle timeout
    # the service's sessions carry: this holder is not frozen, only slow to commit.)
    holder = build_engine(Settings(database_url=database_url, sql_idle_in_transaction_timeout_s=0))
    warned_at = None
    try:
        with holder.begin() as conn:
            conn.execute(
                select(orders_table.c.id).where(orders_table.c.id == stuck.id).with_for_update()
            )
            blocked_from = skewed.mono()
            for _ in range(20):
                skewed.create("behind", 2)
                skewed.step()
                if warned_at is None and backlog_lines(caplog):
                    warned_at = skewed.mono() - STEP_S
        for _ in range(4):
            skewed.step()
    finally:
        holder.dispose()

    assert [line["event"] for line in backlog_lines(caplog)] == ["backlog", "backlog_cleared"]
    assert warned_at is not None
    assert BACKLOG_LAG_S - STEP_S <= warned_at - blocked_from <= BACKLOG_LAG_S + STEP_S
    assert skewed.sweeping.count_due() == 0
