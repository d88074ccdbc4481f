"""Payments arriving around each order's expiry, while two sweeper processes close orders.

Orders (written in bulk as create_unpaid_order writes them: row, ``created`` event, Redis
member) expire spread over two seconds; each gets one payment at its expiry plus a jitter of
up to 20 ms either way, from two payer processes of eight threads each; two more processes
loop ``sweep_expired``. Everything runs on the real clock. Whatever the interleaving, each
order must end in exactly one terminal state, the result every caller got must match SQL,
and the Redis index must end empty.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, insert, select

from orders.config import Settings
from orders.domain import Order, OrderStatus
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import now_ms, sleep_until_ms
from tests.support.processes import started
from tests.support.stores import key_count

UNPAID = OrderStatus.UNPAID.value

OC = orders_table.c
EC = events_table.c

SPREAD_MS = 2_000
JITTER_MS = 20
PAYERS, PAYER_THREADS, SWEEPERS = 2, 8, 2


def order_count(full_size: bool) -> int:
    return 1_000 if full_size else 300


def write_orders(
    service: OrderService, client: redis.Redis, targets: list[tuple[str, int]]
) -> list[Order]:
    """One unpaid order per (user, expiry), written as create_unpaid_order writes it: the row,
    its ``created`` event and the Redis member, in bulk. (Creating them one by one through
    the service would take longer than the spread on a busy machine, and aim at expiries
    that have already passed.)"""
    now = now_ms()
    orders = [
        Order(
            id=service.new_order_id(),
            user_id=user,
            status=OrderStatus.UNPAID,
            created_at_ms=now,
            expires_at_ms=expires,
            read_at_ms=now,
        )
        for user, expires in targets
    ]
    rows = [
        {
            "id": o.id,
            "user_id": o.user_id,
            "status": UNPAID,
            "created_at_ms": now,
            "expires_at_ms": o.expires_at_ms,
            "updated_at_ms": now,
        }
        for o in orders
    ]
    events = [
        {"order_id": o.id, "user_id": o.user_id, "kind": "created", "at_ms": now} for o in orders
    ]
    with service.engine.begin() as conn:
        conn.execute(insert(orders_table), rows)
        conn.execute(insert(events_table), events)
    pipe = client.pipeline(transaction=False)
    for o in orders:
        pipe.zadd(service.index.key(o.user_id), {o.id: o.expires_at_ms})
    pipe.execute()
    return orders


@pytest.mark.rotate("redis_kind")  # CI time: each engine on one topology (both: --full)
@pytest.mark.slow
@pytest.mark.cluster_too
@pytest.mark.timeout(300)
def test_payments_around_expiry_racing_two_sweeper_processes_give_one_fate_each(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    full_size: bool,
    tmp_path: Path,
) -> None:
    count = order_count(full_size)
    users = 20
    service = OrderService(
        engine, redis_client, Settings(database_url=database_url, **redis_options)
    )
    rng = random.Random(11)
    common = {"pool_size": PAYER_THREADS + 2, "max_overflow": 10, "deadline_s": 240}
    specs: list[tuple[str, dict[str, Any]]] = [
        ("pay", {**common, "name": f"payer{n}", "threads": PAYER_THREADS}) for n in range(PAYERS)
    ]
    specs += [
        ("sweep", {**common, "name": f"sweeper{n}", "every_s": [0.005, 0.015]})
        for n in range(SWEEPERS)
    ]

    with started(
        specs, database_url=database_url, redis_options=redis_options, log_dir=tmp_path
    ) as workers:
        payers, sweepers = workers[:PAYERS], workers[PAYERS:]
        for sweeper in sweepers:
            sweeper.go()
        # Expiries spread over SPREAD_MS, starting once the orders are written.
        lead_ms = 1_500
        base = now_ms() + lead_ms
        targets = [(f"pve-{n % users}", base + rng.randrange(SPREAD_MS)) for n in range(count)]
        create_began = now_ms()
        orders = write_orders(service, redis_client, targets)
        create_ms = now_ms() - create_began
        assert now_ms() < base - 50, f"writing {count} orders took {create_ms} ms: raise lead_ms"
        assert service.count_due() == 0
        assert sum(len(service.index.members(f"pve-{u}")) for u in range(users)) == count
        by_id = {o.id: o for o in orders}
        schedules: list[list[dict[str, Any]]] = [[] for _ in range(PAYERS)]
        for n, order in enumerate(orders):
            schedules[n % PAYERS].append(
                {
                    "order_id": order.id,
                    "ref": f"psp-{order.id}",
                    "at_ms": order.expires_at_ms + rng.randint(-JITTER_MS, JITTER_MS),
                }
            )
        for payer, schedule in zip(payers, schedules, strict=True):
            payer.go({"schedule": schedule})
        pay_results = [payer.result(timeout_s=200) for payer in payers]
        # Every order has expired; let the sweepers take what the payers left, then stop.
        sleep_until_ms(max(o.expires_at_ms for o in orders) + 100)
        for sweeper in sweepers:
            sweeper.stop()
        sweep_results = [sweeper.result(timeout_s=60) for sweeper in sweepers]

    last_sweep = service.sweep_expired()

    errors = [s for r in pay_results + sweep_results for s in r["error_samples"]]
    assert sum(r["errors"] for r in pay_results + sweep_results) == 0, errors
    outcomes: dict[str, dict[str, Any]] = {}
    for r in pay_results:
        outcomes.update(r["outcomes"])
    assert set(outcomes) == set(by_id), "not every order got its payment"
    assert sum(r["payments"] for r in pay_results) == count

    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(select(*orders_table.c)).all()}
        event_rows = conn.execute(select(EC.order_id, EC.kind, EC.data).order_by(EC.id)).all()
    events: dict[str, list[str]] = {}
    for e in event_rows:
        events.setdefault(e.order_id, []).append(e.kind)
    assert set(rows) == set(by_id)

    paid_before_expiry = paid_after_expiry = 0
    for oid, outcome in outcomes.items():
        row, order = rows[oid], by_id[oid]
        assert row.status in ("paid", "closed"), (oid, row.status)
        # A payment the close beat is a refund owed, recorded after the close.
        refused = ["payment_refused"] if row.status == "closed" else []
        assert events[oid] == ["created", row.status, *refused], (oid, events[oid])
        if outcome["outcome"] == "paid":
            assert row.status == "paid", (oid, outcome, row.status)
            assert row.payment_ref == outcome["ref"] == f"psp-{oid}"
            assert row.paid_at_ms is not None
            assert row.closed_at_ms is None
            assert row.close_reason is None
            if row.paid_at_ms < order.expires_at_ms:
                paid_before_expiry += 1
            else:
                paid_after_expiry += 1
        else:
            assert outcome["outcome"] == "closed", (oid, outcome)
            assert outcome["status"] == "closed"
            assert row.status == "closed"
            assert row.payment_ref is None
            assert row.paid_at_ms is None
            assert row.close_reason == "expired"
            assert row.closed_at_ms >= order.expires_at_ms
        # A call that ended before the expiry cannot have lost to the sweep.
        if outcome["end_ms"] < order.expires_at_ms:
            assert outcome["outcome"] == "paid", (oid, outcome)

    status = Counter(row.status for row in rows.values())
    assert status["paid"] + status["closed"] == count
    assert status["paid"] == sum(r["paid"] for r in pay_results)
    assert status["closed"] == sum(r["refused_closed"] for r in pay_results)
    closed_by_sweepers = [r["closed"] for r in sweep_results]
    assert sum(closed_by_sweepers) + last_sweep.closed == status["closed"]  # none closed twice
    # One refusal (a refund owed) per payment the close beat.
    refused = {"payment_refused": status["closed"]}
    assert Counter(e.kind for e in event_rows) == {"created": count, **status, **refused}
    assert service.count_due() == 0
    assert all(row.status != UNPAID for row in rows.values())
    assert key_count(redis_client) == 0, "members left in Redis after the final sweep"

    # When each payment call started, against its order's expiry (aimed at -20..+20 ms).
    lateness = sorted(o["start_ms"] - by_id[oid].expires_at_ms for oid, o in outcomes.items())
    p50, p95 = lateness[len(lateness) // 2], lateness[len(lateness) * 95 // 100]
    print(
        f"\n[pay vs expiry, {engine.dialect.name}] {count} orders over {SPREAD_MS} ms "
        f"(written in {create_ms} ms), payments at expiry +/-{JITTER_MS} ms from "
        f"{PAYERS}x{PAYER_THREADS} threads: paid {status['paid']} "
        f"({paid_before_expiry} before expiry, {paid_after_expiry} after), "
        f"closed {status['closed']} (OrderClosed to the payer); closed per sweeper process "
        f"{closed_by_sweepers} in {[r['sweeps'] for r in sweep_results]} sweeps, "
        f"max lag {[r['max_lag_ms'] for r in sweep_results]} ms, by the last sweep "
        f"{last_sweep.closed}; payment start vs expiry: min {lateness[0]}, median {p50}, "
        f"p95 {p95}, max {lateness[-1]} ms"
    )
