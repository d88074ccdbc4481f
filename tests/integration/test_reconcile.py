"""reconcile(): the Redis index rebuilt and repaired from SQL."""

from __future__ import annotations

import json
import logging
import os
import pty
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, insert

from orders import Settings, UnpaidOrderLimitReached
from orders.index.admissions import AdmitRequest
from orders.rules import reconcile as reconciler
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql import reconcile_reads as record_reads
from orders.sql.models import orders_table
from orders.sql.records import LimitReachedInSql
from tests.support.clocks import ManualClock
from tests.support.plans import explain, explain_sql
from tests.support.processes import child_env, run_orders, stop_process
from tests.support.stores import flush_db, sql_rows

HOUR_MS = 3_600_000
#: The contract holds on one Redis server and on a Redis Cluster alike.
pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]


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
    assert service.index.epoch.get() == str(clock())


def test_at_an_orders_expiry_instant_sql_no_longer_counts_it_nor_restores_its_member(
    service: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    # open_at's strict bound, read by SQL alone: the user's open orders and the rebuild
    # after a flush. An order stops being open at its expiry instant, 1 ms before it is not.
    due_now = service.create_unpaid_order("u1", ttl_s=10)
    clock.advance(ms=1)
    one_ms_left = service.create_unpaid_order("u1", ttl_s=10)
    clock.set(due_now.expires_at_ms)
    redis_client.flushdb()

    open_ids = [order.id for order in service.list_unpaid("u1")]
    report = service.reconcile()

    assert open_ids == [one_ms_left.id]
    assert index_state(service, ["u1"]) == {"u1": {one_ms_left.id: due_now.expires_at_ms + 1}}
    assert report.added == 1


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
    service.index.admit(
        AdmitRequest("u1", "in-flight", expires_at_ms=clock() + 10_000, now_ms=clock(), limit=3)
    )

    first = service.reconcile()
    assert service.index.members("u1") == {"in-flight": clock() + 10_000}
    assert first.kept_in_flight == 1

    clock.advance(s=10)
    second = service.reconcile()
    assert service.index.members("u1") == {}
    assert second.removed_expired == 1


def test_a_create_whose_transaction_is_open_is_kept_for_the_window_of_the_services_own_timeouts(
    make_service: Callable[..., OrderService], clock: ManualClock, engine: Engine
) -> None:
    # Slower SQL: a create may stay longer between its Redis and its SQL step. This one has
    # inserted in its host's transaction, still open: SQL shows no row, but cannot say it
    # died (PostgreSQL: its lock is held; SQLite: the write lock is), so it stays.
    service = make_service(sql_statement_timeout_s=300)
    window_ms = service.settings.admission_window_ms
    assert window_ms > Settings().admission_window_ms
    with engine.connect() as host:
        service.create_unpaid_order("u1", order_id="in-flight", ttl_s=3600, connection=host)

        clock.advance(ms=window_ms - 1)
        assert service.reconcile().kept_in_flight == 1
        clock.advance(ms=1)
        assert service.reconcile().removed_abandoned == 1
        host.rollback()


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
    assert service.index.epoch.get() is None


def test_one_user_only(service: OrderService, redis_client: redis.Redis) -> None:
    service.create_unpaid_order("u1", ttl_s=60)
    service.create_unpaid_order("u2", ttl_s=60)
    redis_client.flushdb()

    report = service.reconcile(user_id="u1")

    assert report.users == 1
    assert len(service.index.members("u1")) == 1
    assert service.index.members("u2") == {}
    assert service.index.epoch.get() is None  # not a complete rebuild


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
    # The users' keys are gone (their admissions hashes expire by themselves, in the window).
    assert list(redis_client.scan_iter(match=service.index.key("gone") + "*")) == []


def test_the_active_scheduler_rebuilds_the_index_at_start_and_when_redis_lost_it(
    service: OrderService, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    orders = [service.create_unpaid_order(f"u{i}", ttl_s=60) for i in range(3)]
    sweeper = Sweeper(service)
    sweeper.reconcile_if_due()
    assert service.index.epoch.get() is None  # only the lease holder rebuilds
    sweeper.tick()  # takes the lease
    sweeper.reconcile_if_due()
    assert service.index.epoch.get() is not None  # the startup rebuild wrote the marker

    redis_client.flushdb()  # a restart without persistence, say
    caplog.set_level(logging.INFO, logger="orders.sweeper")
    sweeper.tick()
    sweeper.reconcile_if_due()

    assert all(service.index.members(o.user_id) == {o.id: o.expires_at_ms} for o in orders)
    assert service.index.epoch.get() is not None
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
        while real.index.epoch.get() is None:  # the startup rebuild
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
    assert service.index.epoch.get() is not None  # the rebuild finished
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


# --- cost, dry run, races and progress of the page-at-a-time rebuild ----------------------


def insert_open_orders(engine: Any, clock: ManualClock, users: int, per_user: int) -> int:
    """``users`` users with ``per_user`` open orders each, straight into SQL (no Redis)."""
    now = clock()
    rows = [
        {
            "id": f"o{u:05d}-{k}",
            "user_id": f"bulk{u:05d}",
            "status": "unpaid",
            "created_at_ms": now - 1_000,
            "expires_at_ms": now + 60_000 + u * 10 + k,
            "updated_at_ms": now - 1_000,
            "extensions": 0,
        }
        for u in range(users)
        for k in range(per_user)
    ]
    with engine.begin() as conn:
        conn.execute(insert(orders_table), rows)
    return len(rows)


def redis_picture(client: redis.Redis) -> dict[bytes, Any]:
    """Every key with its type and content (sorted sets with scores) and its TTL."""
    picture: dict[bytes, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        content = (
            client.zrange(key, 0, -1, withscores=True) if kind == b"zset" else client.dump(key)
        )
        picture[key] = (kind, content, client.pttl(key))
    return picture


def test_a_rebuild_costs_round_trips_and_statements_per_page_not_per_user(
    service: OrderService,
    engine: Any,
    clock: ManualClock,
    redis_client: redis.Redis,
    redis_round_trips: Any,
    sql_statements: Any,
    redis_nodes: int,
) -> None:
    users, page = 2_000, 500
    rows = insert_open_orders(engine, clock, users, per_user=2)
    redis_client.flushall()
    redis_round_trips.count = 0
    sql_statements.statements.clear()

    report = service.reconcile(chunk_size=page)

    assert (report.users, report.added) == (users, rows)
    pages = rows // page + 1
    # The SCAN pass runs first and finds an empty keyspace: one SCAN, no SQL. Per page: the
    # scripts' pipeline (+ a SCRIPT LOAD and a re-run once after a flush of the script
    # cache); then the SCAN of the limit keys, which walks the users' keys written by now
    # (no user has a limit: no write), the SCAN of the resources' keys (none: no write), and
    # the epoch marker. On a cluster, each per node.
    limit_scans = users // page + 2
    resource_scans = limit_scans
    assert redis_round_trips.count <= redis_nodes * (
        1 + pages + 2 + limit_scans + resource_scans + 1
    ), redis_round_trips.count
    # Per page: the page and the stale-add check; nothing for the SCAN pass; one page of
    # the users' own limits; one page of resources (none); the waiting lists' recovery pass.
    assert sql_statements.count <= 2 * pages + 3, sql_statements.count
    assert service.index.members("bulk01999") == {
        "o01999-0": clock() + 60_000 + 19_990,
        "o01999-1": clock() + 60_000 + 19_991,
    }


def test_a_rebuild_of_a_right_index_writes_nothing_and_costs_a_round_trip_per_page(
    service: OrderService,
    engine: Any,
    clock: ManualClock,
    redis_client: redis.Redis,
    redis_round_trips: Any,
    sql_statements: Any,
    redis_nodes: int,
) -> None:
    users, page = 1_000, 500
    rows = insert_open_orders(engine, clock, users, per_user=3)
    service.reconcile(chunk_size=page)
    before = redis_picture(redis_client)
    redis_round_trips.count = 0
    sql_statements.statements.clear()

    report = service.reconcile(chunk_size=page)

    assert report.users == users
    assert report.fixes == report.removed_expired == report.kept_in_flight == 0
    pages, scans = rows // page + 1, users // page + 5
    # The limit keys' SCAN walks the keyspace again; one page of the users' own limits.
    assert redis_round_trips.count <= redis_nodes * (pages + 2 * scans + 1), redis_round_trips.count
    assert sql_statements.count <= pages + scans + 1, sql_statements.count  # no stale-add check
    after = redis_picture(redis_client)
    assert after.keys() == before.keys()
    for key, (kind, content, ttl) in before.items():
        assert after[key][:2] == (kind, content)
        assert after[key][2] <= ttl  # no PEXPIREAT: the TTL only ran down


def test_a_dry_run_changes_nothing_in_redis_whatever_it_finds(
    service: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    kept = service.create_unpaid_order("u1", ttl_s=60)
    rescore = service.create_unpaid_order("u1", ttl_s=60)
    missing = service.create_unpaid_order("u2", ttl_s=60)
    paid = service.create_unpaid_order("u3", ttl_s=60)
    other = service.create_unpaid_order("u4", ttl_s=60)
    service.mark_paid(paid.id)
    prefix = service.settings.key_prefix
    redis_client.zadd(prefix + "u3", {paid.id: paid.expires_at_ms})  # terminal
    redis_client.zadd(prefix + "u1", {rescore.id: rescore.expires_at_ms + 5})  # wrong score
    redis_client.zadd(prefix + "u1", {"gone": clock() - 1})  # expired
    redis_client.zadd(prefix + "u1", {"in-flight": clock() + 9_000})  # no SQL row yet:
    redis_client.hset(service.index.admits_key("u1"), "in-flight", clock())  # its create runs
    redis_client.zadd(prefix + "u1", {other.id: other.expires_at_ms})  # another user's
    redis_client.zrem(prefix + "u2", missing.id)
    redis_client.set(prefix + "stray", b"x")  # foreign
    for key in redis_client.scan_iter(match=prefix + "u*"):
        redis_client.pexpire(key, 10**9)  # far below what PEXPIREAT would set
    redis_client.delete(service.index.epoch.key())
    before = redis_picture(redis_client)

    report = service.reconcile(dry_run=True, chunk_size=2)

    assert redis_picture(redis_client).keys() == before.keys()
    for key, (kind, content, ttl) in before.items():
        after = redis_picture(redis_client)[key]
        assert after[:2] == (kind, content), key
        assert after[2] <= ttl, key
    assert report.as_dict() == {
        "users": 4,
        "added": 1,
        "rescored": 1,
        "removed_terminal": 2,
        "removed_expired": 1,
        "removed_abandoned": 0,
        "kept_in_flight": 1,
        "foreign_skipped": 1,
        "limits_written": 0,
        "limits_removed": 0,
        "resources": 0,
        "resources_missing": 0,
        "resources_stale": 0,
        "resources_removed": 0,
        "dry_run": True,
    }
    assert kept.id in service.index.members("u1")
    # The same run for real fixes exactly what the dry run reported.
    real = service.reconcile(chunk_size=2)
    assert {k: v for k, v in real.as_dict().items() if k != "dry_run"} == {
        k: v for k, v in report.as_dict().items() if k != "dry_run"
    }
    assert service.index.members("u1") == {
        kept.id: kept.expires_at_ms,
        rescore.id: rescore.expires_at_ms,
        "in-flight": clock() + 9_000,
    }
    assert service.index.members("u3") == {}


def test_a_full_rebuild_racing_a_payment_leaves_no_stale_member(
    service: OrderService, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    orders = [service.create_unpaid_order(f"u{i}", ttl_s=60) for i in range(3)]
    # u1 keeps an open order, so the SCAN pass (users with none) cannot mop the member up.
    still_open = service.create_unpaid_order("u1", ttl_s=90)
    redis_client.flushdb()
    read_page = service.records.reads.open_page

    def read_then_pay(*args: Any) -> list[tuple[str, str, int]]:
        rows = read_page(*args)
        if any(order_id == orders[1].id for _, order_id, _ in rows):
            service.mark_paid(orders[1].id)  # commits and removes its (absent) member now
        return rows

    monkeypatch.setattr(service.records.reads, "open_page", read_then_pay)

    service.reconcile(chunk_size=2)

    assert service.get_order(orders[1].id).status == "paid"
    assert service.index.members("u1") == {still_open.id: still_open.expires_at_ms}
    assert service.index.members("u0") == {orders[0].id: orders[0].expires_at_ms}
    assert service.index.members("u2") == {orders[2].id: orders[2].expires_at_ms}


def test_the_scan_batch_check_is_served_by_the_partial_index(engine: Any) -> None:
    if engine.dialect.name == "sqlite":
        plan = explain(engine, record_reads.IDLE_USERS_SQLITE.params(users='["a", "b"]', now_ms=5))
        assert (
            "SEARCH oes_orders USING INDEX ix_oes_orders_unpaid_user_id_expires_at_ms (user_id=?"
            in plan
        )
    else:
        # tests.support.plans spells parameters as literals: the array goes as a string split
        # in SQL.
        sql = str(record_reads.IDLE_USERS_POSTGRESQL.compile(engine))
        sql = sql.replace("%(users)s::VARCHAR[]", "string_to_array(%(users)s, ',')")
        plan = explain_sql(engine, sql, {"users": "a,b", "now_ms": 5})
        # Either per-user partial index over unpaid orders serves it (the planner picks by
        # cost: on a small table the slot index may win); never the whole table.
        assert re.search(r"Index (Only )?Scan using ix_oes_orders_unpaid_user_id_\w+", plan), plan
        assert "Seq Scan on orders" not in plan, plan


def test_a_create_and_a_payment_that_miss_redis_between_the_passes_are_fixed(
    service: OrderService, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    paid = service.create_unpaid_order("payer", ttl_s=60)
    kept = service.create_unpaid_order("payer", ttl_s=90)
    for i in range(4):
        service.create_unpaid_order(f"other{i}", ttl_s=60)
    late: list[Any] = []
    scan_users = service.index.scan_users

    def scan_then_write(**kwargs: Any) -> Iterator[list[str]]:
        yield from scan_users(**kwargs)
        # The SCAN pass is over (it left "payer" to the SQL pass: an open order).
        service.mark_paid(paid.id)
        # As if Redis had been unreachable when the payment tried to remove the member:
        redis_client.zadd(service.index.key("payer"), {paid.id: paid.expires_at_ms})
        late.append(service.create_unpaid_order("late", ttl_s=60))
        redis_client.zrem(service.index.key("late"), late[0].id)  # its Redis write lost

    monkeypatch.setattr(service.index, "scan_users", scan_then_write)

    report = service.reconcile(chunk_size=2)

    users = ["payer", "late", *[f"other{i}" for i in range(4)]]
    assert len(late) == 1
    assert index_state(service, users) == sql_open(service, users)
    assert service.index.members("payer") == {kept.id: kept.expires_at_ms}
    assert service.index.members("late") == {late[0].id: late[0].expires_at_ms}
    assert (report.added, report.removed_terminal) == (1, 1)


@pytest.mark.parametrize("stop_in", ["scan pass", "sql pass"])
def test_a_rebuild_stopped_with_replies_outstanding_closes_their_connection(
    service: OrderService,
    engine: Any,
    clock: ManualClock,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    stop_in: str,
) -> None:
    insert_open_orders(engine, clock, 40, per_user=1)
    service.reconcile(chunk_size=5)  # the index is right: the SCAN pass finds 40 keys
    connection = redis.connection.AbstractConnection
    sent_on: list[Any] = []
    closed: list[Any] = []
    send, disconnect = connection.send_packed_command, connection.disconnect

    def sending(self: Any, command: Any, check_health: bool = True) -> None:
        sent_on.append(self)
        send(self, command, check_health)

    def disconnecting(self: Any, *args: Any) -> None:
        closed.append(self)
        disconnect(self, *args)

    monkeypatch.setattr(connection, "send_packed_command", sending)
    monkeypatch.setattr(connection, "disconnect", disconnecting)

    class Stop(Exception):
        pass

    def stop(users: int) -> None:
        # Nobody is counted during the SCAN pass. When this is called, the next SCAN (or,
        # in the SQL pass, the next page's scripts) was the last thing sent.
        if (users == 0) == (stop_in == "scan pass"):
            raise Stop

    with pytest.raises(Stop):
        service.reconcile(chunk_size=5, on_progress=stop)

    # Its replies unread, that connection must be closed rather than go back to the pool
    # (checked before any other command: redis-py would close it too if data had arrived).
    assert sent_on[-1] in closed
    for u in range(40):
        assert service.index.members(f"bulk{u:05d}") == {f"o{u:05d}-0": clock() + 60_000 + u * 10}
    assert redis_client.ping() is True
    assert service.reconcile(chunk_size=5).fixes == 0


@pytest.mark.parametrize("stall_in", ["scan pass", "sql pass"])
def test_a_read_that_times_out_with_replies_outstanding_is_retried(
    service: OrderService,
    engine: Any,
    clock: ManualClock,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    stall_in: str,
) -> None:
    insert_open_orders(engine, clock, 40, per_user=1)
    service.reconcile(chunk_size=5)  # the SCAN pass now has 40 keys to go through
    redis_client.delete(*[service.index.key(f"bulk{u:05d}") for u in range(0, 40, 2)])
    reads = service.records.reads
    hooked = "users_without_open" if stall_in == "scan pass" else "open_page"
    read = getattr(reads, hooked)
    timeout_ms = int(service.settings.redis_socket_timeout_s * 1000)
    stalled: list[bool] = []

    def stall_then_read(*args: Any) -> Any:
        # Called while a SCAN (or, from the second page on, a page's scripts) is in flight:
        # the server stops answering for longer than a read waits, so the next read of a
        # reply times out, and the call goes again (the client's one retry) and succeeds.
        if not stalled and (stall_in == "scan pass" or args[1] is not None):
            stalled.append(redis_client.client_pause(timeout_ms + 300, all=True))
        return read(*args)

    monkeypatch.setattr(reads, hooked, stall_then_read)

    report = service.reconcile(chunk_size=5)

    assert stalled == [True]
    assert report.users == 40
    for u in range(40):
        assert service.index.members(f"bulk{u:05d}") == {f"o{u:05d}-0": clock() + 60_000 + u * 10}


def test_a_user_whose_orders_span_pages_is_one_user_with_all_its_members(
    service: OrderService, redis_client: redis.Redis
) -> None:
    orders = [service.create_unpaid_order("many", ttl_s=60 + i, limit=5) for i in range(5)]
    service.create_unpaid_order("after", ttl_s=60)
    redis_client.flushdb()

    report = service.reconcile(chunk_size=2)

    assert (report.users, report.added, report.kept_in_flight) == (2, 6, 0)
    assert service.index.members("many") == {o.id: o.expires_at_ms for o in orders}
    assert service.reconcile(chunk_size=2).fixes == 0


def test_a_script_cache_flushed_under_the_rebuild_is_loaded_again(
    service: OrderService, redis_client: redis.Redis
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=60)
    redis_client.flushall()
    redis_client.script_flush()  # as after a restart: EVALSHA answers NOSCRIPT

    report = service.reconcile()

    assert report.added == 1
    assert service.index.members("u1") == {order.id: order.expires_at_ms}


def test_progress_is_reported_after_each_page_and_logged_with_the_rate(
    service: OrderService,
    engine: Any,
    clock: ManualClock,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    insert_open_orders(engine, clock, 50, per_user=2)
    seen: list[int] = []
    monkeypatch.setattr(reconciler, "PROGRESS_LOG_INTERVAL_S", 0.0)  # a line per page
    caplog.set_level(logging.INFO, logger="orders.reconciler")

    report = service.reconcile(chunk_size=10, on_progress=seen.append)

    assert len(seen) >= 10  # 100 rows in pages of 10, then the SCAN batches
    assert seen == sorted(seen)
    assert seen[-1] == report.users == 50
    assert max(b - a for a, b in zip([0, *seen], seen, strict=False)) <= 10
    lines = [r.getMessage() for r in caplog.records if r.name == "orders.reconciler"]
    assert len(lines) >= 10
    assert "users/s" in lines[0]
    assert lines[-1].startswith("reconcile done: 50 users in ")
    assert "users/s" in lines[-1]


def run_in_terminal(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """``orders ARGS`` as a real process whose stdout is a terminal (a pty); its output."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", *args],
        stdout=follower,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env={**env, "TERM": "xterm", "COLUMNS": "120"},
    )
    os.close(follower)
    output = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
        return stop_process(proc, timeout_s=30), output.decode("utf-8", "replace")
    finally:
        stop_process(proc)
        os.close(leader)


# What a terminal shows does not depend on the stores: one combination runs (CI time).
@pytest.mark.rotate("redis_kind", "database_url")
def test_the_command_shows_progress_on_a_terminal_only(
    service: OrderService,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
) -> None:
    for i in range(3):
        service.create_unpaid_order(f"u{i}", ttl_s=600)
    flush_db(redis_client)
    env = child_env(
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_options["redis_url"],
        ORDERS_REDIS_CLUSTER=str(redis_options["redis_cluster"]).lower(),
    )

    status, shown = run_in_terminal("reconcile", env=env)
    piped = run_orders("reconcile", env=env)
    as_json = run_in_terminal("reconcile", "--json", env=env)

    assert status == 0, shown
    assert "reconciling: " in shown
    assert "users/s" in shown
    assert "3 users checked; fixed: 3 added" in shown
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == (
        "3 users checked; fixed: 0 added, 0 re-scored, 0 removed (order no longer open), "
        "0 expired dropped, 0 left by a failed create removed; 0 in flight kept\n"
    )
    assert as_json[0] == 0
    assert "reconciling" not in as_json[1]
    assert json.loads(as_json[1])["users"] == 3


def test_a_holder_paid_while_sql_refuses_does_not_come_back_into_the_index(
    service: OrderService, engine: Engine, redis_client: redis.Redis, monkeypatch: Any
) -> None:
    first = service.create_unpaid_order("u1")
    service.create_unpaid_order("u1")
    service.create_unpaid_order("u1")
    redis_client.flushdb()
    make_room = service.records.slots.make_room

    def paid_meanwhile(*args: Any, **kwargs: Any) -> Any:
        # SQL has listed the holders; a payment then commits and removes its member
        # before the refused create writes the holders back into the emptied index.
        try:
            return make_room(*args, **kwargs)
        except LimitReachedInSql:
            service.mark_paid(first.id)
            raise

    monkeypatch.setattr(service.records.slots, "make_room", paid_meanwhile)

    with pytest.raises(UnpaidOrderLimitReached) as info:
        service.create_unpaid_order("u1")

    assert info.value.source == "sql"
    unpaid = {oid: r.expires_at_ms for oid, r in sql_rows(engine).items() if r.status == "unpaid"}
    assert len(unpaid) == 2
    assert first.id not in unpaid
    # The paid order holds no member: the user's next create is not refused by Redis.
    assert service.index.members("u1") == unpaid
    assert service.create_unpaid_order("u1").status.value == "unpaid"
