"""reconcile(): the Redis index rebuilt and repaired from SQL."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import pytest
import redis

from orders.scheduling import build_scheduler
from orders.service import OrderService
from orders.sweeper import Sweeper
from tests.conftest import ManualClock


def index_state(service: OrderService, users: list[str]) -> dict[str, dict[str, int]]:
    return {u: m for u, m in service.index.members_of(users).items() if m}


def sql_open(service: OrderService, users: list[str]) -> dict[str, dict[str, int]]:
    state = {u: {o.id: o.expires_at_ms for o in service.list_unpaid(u)} for u in users}
    return {u: m for u, m in state.items() if m}


def test_after_a_flush_reconcile_restores_every_open_order_with_its_exact_score(
    service: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    users = [f"u{i}" for i in range(7)]
    for i, user in enumerate(users):
        for ttl in range(1, i % 3 + 2):
            service.create_unpaid_order(user, ttl_s=ttl * 10 + i)
    paid = service.create_unpaid_order("u0", ttl_s=50)
    service.mark_paid(paid.id)
    expired = service.create_unpaid_order("u6", ttl_s=1)
    clock.advance(s=2)
    expected = sql_open(service, users)
    assert expired.id not in expected["u6"]
    redis_client.flushdb()

    report = service.reconcile(chunk_size=3)

    assert index_state(service, users) == expected
    assert report.added == sum(len(m) for m in expected.values())
    assert report.removed_terminal == report.removed_expired == report.rescored == 0
    assert service.index.get_epoch() == str(clock())


def test_reconcile_removes_members_of_paid_cancelled_closed_and_expired_orders(
    service: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    kept = service.create_unpaid_order("u1", ttl_s=60)
    paid = service.create_unpaid_order("u1", ttl_s=60)
    cancelled = service.create_unpaid_order("u2", ttl_s=60)
    closed = service.create_unpaid_order("u2", ttl_s=5)
    for order, score in [(paid, paid.expires_at_ms), (cancelled, cancelled.expires_at_ms)]:
        service.mark_paid(order.id) if order is paid else service.cancel_order(order.id)
        # As if Redis had been unreachable when the transition tried to remove the member:
        redis_client.zadd(service.index.key(order.user_id), {order.id: score})
    clock.advance(s=5)
    service.sweep_expired()
    redis_client.zadd(service.index.key("u2"), {closed.id: closed.expires_at_ms})
    before = service.index.members_of(["u1", "u2"])
    assert len(before["u1"]) == 2
    assert len(before["u2"]) == 2

    report = service.reconcile()

    assert index_state(service, ["u1", "u2"]) == {"u1": {kept.id: kept.expires_at_ms}}
    assert report.removed_terminal == 2
    assert report.removed_expired == 1  # the closed one: its score is not ahead of now
    assert redis_client.exists(service.index.key("u2")) == 0


def test_a_member_without_a_sql_row_is_kept_until_its_own_expiry(
    service: OrderService, clock: ManualClock
) -> None:
    # A create between its two steps: admitted in Redis, not yet inserted in SQL.
    service.index.admit("u1", "in-flight", expires_at_ms=clock() + 10_000, now_ms=clock(), limit=3)

    first = service.reconcile()
    assert service.index.members("u1") == {"in-flight": clock() + 10_000}
    assert first.kept_in_flight == 1

    clock.advance(s=10)
    second = service.reconcile()
    assert service.index.members("u1") == {}
    assert second.removed_expired == 1


def test_a_wrong_score_is_corrected_and_a_member_in_the_wrong_users_set_removed(
    service: OrderService, redis_client: redis.Redis
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=60)
    other = service.create_unpaid_order("u2", ttl_s=60)
    redis_client.zadd(service.index.key("u1"), {order.id: order.expires_at_ms + 999})
    redis_client.zadd(service.index.key("u1"), {other.id: other.expires_at_ms})

    report = service.reconcile()

    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    assert service.index.members("u2") == {other.id: other.expires_at_ms}
    assert report.rescored == 1
    assert report.removed_terminal == 1


def test_dry_run_reports_without_changing_anything(
    service: OrderService, redis_client: redis.Redis
) -> None:
    service.create_unpaid_order("u1", ttl_s=60)
    service.create_unpaid_order("u2", ttl_s=60)
    redis_client.flushdb()

    report = service.reconcile(dry_run=True)

    assert report.added == 2
    assert report.dry_run
    assert redis_client.dbsize() == 0
    assert service.index.get_epoch() is None


def test_one_user_only(service: OrderService, redis_client: redis.Redis) -> None:
    service.create_unpaid_order("u1", ttl_s=60)
    service.create_unpaid_order("u2", ttl_s=60)
    redis_client.flushdb()

    report = service.reconcile(user_id="u1")

    assert report.users == 1
    assert len(service.index.members("u1")) == 1
    assert service.index.members("u2") == {}
    assert service.index.get_epoch() is None  # not a complete rebuild


def test_an_add_that_races_a_payment_does_not_leave_a_stale_member(
    service: OrderService, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=60)
    redis_client.flushdb()
    read_open = service.records.reads.open_by_user

    def read_then_pay(*args: Any) -> dict[str, dict[str, int]]:
        stale = read_open(*args)
        service.mark_paid(order.id)  # commits and removes its (absent) member now
        return stale

    monkeypatch.setattr(service.records.reads, "open_by_user", read_then_pay)

    service.reconcile(user_id="u1")

    assert service.get_order(order.id).status == "paid"
    assert service.index.members("u1") == {}


def test_reconcile_covers_keys_of_users_sql_no_longer_has_open_orders_for(
    service: OrderService, redis_client: redis.Redis
) -> None:
    orders = [service.create_unpaid_order(f"gone{i}", ttl_s=60) for i in range(12)]
    for order in orders:
        service.cancel_order(order.id)
        redis_client.zadd(service.index.key(order.user_id), {order.id: order.expires_at_ms})

    report = service.reconcile(chunk_size=5)

    assert report.removed_terminal == 12
    assert [k for k in redis_client.scan_iter() if b"gone" in k] == []


def test_the_active_scheduler_rebuilds_the_index_at_start_and_when_redis_lost_it(
    service: OrderService, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    orders = [service.create_unpaid_order(f"u{i}", ttl_s=60) for i in range(3)]
    sweeper = Sweeper(service)
    sweeper.reconcile_if_due()
    assert service.index.get_epoch() is None  # only the lease holder rebuilds
    sweeper.tick()  # takes the lease
    sweeper.reconcile_if_due()
    assert service.index.get_epoch() is not None  # the startup rebuild wrote the marker

    redis_client.flushdb()  # a restart without persistence, say
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    sweeper.tick()
    sweeper.reconcile_if_due()

    assert all(service.index.members(o.user_id) == {o.id: o.expires_at_ms} for o in orders)
    assert service.index.get_epoch() is not None
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "orders.sweeper"]
    rebuilt = [e for e in events if e["event"] == "reconcile"]
    assert len(rebuilt) == 1
    assert (rebuilt[0]["reason"], rebuilt[0]["added"]) == ("index_lost", 3)
    sweeper.close()


def test_each_user_is_counted_once_even_when_sql_and_scan_both_find_them(
    service: OrderService, redis_client: redis.Redis
) -> None:
    for i in range(5):
        service.create_unpaid_order(f"u{i}", ttl_s=60)
    stale = service.create_unpaid_order("gone", ttl_s=60)
    service.cancel_order(stale.id)
    redis_client.zadd(service.index.key("gone"), {stale.id: stale.expires_at_ms})

    report = service.reconcile(chunk_size=2)

    assert report.users == 6
    assert report.removed_terminal == 1


def test_a_running_scheduler_rebuilds_a_lost_index_by_itself(
    engine: Any, redis_client: redis.Redis, make_service: Any
) -> None:
    real = OrderService(engine, redis_client, make_service().settings)  # the real clock
    orders = [real.create_unpaid_order(f"u{i}", ttl_s=600) for i in range(3)]
    sweeper = Sweeper(real, interval_s=0.2)
    scheduler = build_scheduler(sweeper, blocking=False)
    scheduler.start()
    try:
        deadline = time.monotonic() + 20
        while real.index.get_epoch() is None:  # the startup rebuild
            assert time.monotonic() < deadline
            time.sleep(0.02)
        redis_client.flushdb()  # Redis loses everything, the marker included
        while not all(real.index.members(o.user_id) for o in orders):
            assert time.monotonic() < deadline, "the index was not rebuilt"
            time.sleep(0.02)
    finally:
        scheduler.shutdown(wait=True)
        sweeper.close()
    assert all(real.index.members(o.user_id) == {o.id: o.expires_at_ms} for o in orders)


def test_foreign_data_under_the_prefix_is_skipped_counted_and_logged_once(
    service: OrderService,
    redis_client: redis.Redis,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Keys and members the service never wrote (not UTF-8, no valid user id, another type)
    must not stop a rebuild: before, the first non-UTF-8 key raised UnicodeDecodeError and
    the scheduler's rebuild job failed every second for as long as it existed."""
    prefix = service.settings.key_prefix.encode()
    future = clock() + 60_000
    order = service.create_unpaid_order("real", ttl_s=60)
    redis_client.zadd(prefix + b"\xff\xfe", {b"x": future})  # key name not UTF-8
    redis_client.zadd(prefix + b"a{b}", {b"y": future})  # names no valid user id
    redis_client.set(prefix + b"stray", b"not a sorted set")  # another type
    redis_client.zadd(prefix + b"real", {b"\xc3\x28": future})  # member not UTF-8
    redis_client.delete(prefix + b"[index-epoch]")
    caplog.set_level(logging.WARNING, logger="orders.index")

    first = service.reconcile(chunk_size=2)
    second = service.reconcile(chunk_size=2)

    assert first.foreign_skipped == second.foreign_skipped == 4
    assert service.index.get_epoch() is not None  # the rebuild finished
    assert service.index.members("real")[order.id] == order.expires_at_ms
    warnings = [r for r in caplog.records if r.name == "orders.index"]
    assert len(warnings) == 4  # once per key, not again on the second run
    assert redis_client.get(prefix + b"stray") == b"not a sorted set"  # left alone


def test_a_client_that_decodes_responses_is_refused_up_front(engine: Any, redis_url: str) -> None:
    from orders.errors import InvalidInput  # noqa: PLC0415

    decoding = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(InvalidInput, match="redis_client"):
            OrderService(engine, decoding)
    finally:
        decoding.close()
