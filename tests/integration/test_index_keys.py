"""A user's key carries no expiry (it would cost an expires entry a user, about 45 bytes):
no script sets one, one left from before is cleared when members are added, and no key
outlives its orders: an emptied set vanishes, the sweep empties the sets of the orders it
closes, and reconcile removes what a failed Redis call left behind (test_reconcile.py:
test_reconcile_removes_members_of_paid_cancelled_closed_and_expired_orders and
test_reconcile_covers_keys_of_users_sql_no_longer_has_open_orders_for)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import redis
from redis.crc import key_slot

from orders.index.admissions import AdmitRequest
from orders.index.keys import admits_key
from orders.index.nodes import is_cluster
from orders.index.unpaid import UnpaidIndex
from orders.service import OrderService
from tests.support.clocks import ManualClock

#: The contract holds on one Redis server and on a Redis Cluster alike.
pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]

KEY = "UnpaidOrder-u1"


@pytest.fixture
def index(redis_client: redis.Redis) -> UnpaidIndex:
    return UnpaidIndex(redis_client, key_prefix="UnpaidOrder-")


#: Each script that adds members to a user's key: admit (a create), reconcile (the index
#: rebuild, and settling an interrupted create). An extension's ZADD XX adds none.
Add = Callable[[UnpaidIndex, int, int], None]


def by_admit(index: UnpaidIndex, now_ms: int, expires_at_ms: int) -> None:
    index.admit(AdmitRequest("u1", "o-new", expires_at_ms=expires_at_ms, now_ms=now_ms, limit=3))


def by_reconcile(index: UnpaidIndex, now_ms: int, expires_at_ms: int) -> None:
    batch = index.reconcile_batch({"u1": {"o-new": expires_at_ms}}, now_ms=now_ms, dry_run=False)
    assert batch.read().added == 1


ADDS = [by_admit, by_reconcile]


@pytest.mark.parametrize("add", ADDS, ids=lambda f: f.__name__)
def test_no_script_sets_an_expiry_on_a_users_key(
    index: UnpaidIndex, redis_client: redis.Redis, clock: ManualClock, add: Add
) -> None:
    add(index, clock(), clock() + 60_000)

    assert redis_client.zscore(KEY, "o-new") == clock() + 60_000
    assert redis_client.pttl(KEY) == -1  # the key exists and has no expiry


@pytest.mark.parametrize("add", ADDS, ids=lambda f: f.__name__)
def test_an_expiry_left_from_before_is_cleared_when_a_member_is_added(
    index: UnpaidIndex, redis_client: redis.Redis, clock: ManualClock, add: Add
) -> None:
    # A key written by a version that set expiries: its expiry covered its members then,
    # and would take a member added later with it. PEXPIREAT is the server's wall clock.
    redis_client.zadd(KEY, {"o-old": clock() + 1_000})
    redis_client.pexpireat(KEY, round(time.time() * 1000) + 3_600_000)

    add(index, clock(), clock() + 600_000)

    assert redis_client.zscore(KEY, "o-new") == clock() + 600_000
    assert redis_client.pttl(KEY) == -1


def test_a_refusal_leaves_the_key_as_it_was(
    index: UnpaidIndex, redis_client: redis.Redis, clock: ManualClock
) -> None:
    # Nothing is added, so an expiry left from before still covers every member.
    redis_client.zadd(KEY, {"o-old": clock() + 1_000})
    redis_client.pexpireat(KEY, round(time.time() * 1000) + 3_600_000)

    index.admit(
        AdmitRequest("u1", "o-new", expires_at_ms=clock() + 60_000, now_ms=clock(), limit=1)
    )

    assert redis_client.zrange(KEY, 0, -1) == [b"o-old"]
    assert redis_client.pttl(KEY) > 3_000_000  # the hour set above, less the time since


def test_the_sweep_deletes_the_keys_it_empties(
    service: OrderService, redis_client: redis.Redis, clock: ManualClock
) -> None:
    for user in ("u1", "u2"):
        service.create_unpaid_order(user, ttl_s=10)
    kept = service.create_unpaid_order("u2", ttl_s=60)
    clock.advance(s=10)

    assert service.sweep_expired().closed == 2

    assert redis_client.exists(KEY) == 0
    assert service.index.members("u2") == {kept.id: kept.expires_at_ms}
    assert redis_client.pttl("UnpaidOrder-u2") == -1


@pytest.mark.parametrize("user_key", ["UnpaidOrder-u1", "{shop}UnpaidOrder-u1"])
def test_a_users_admissions_hash_shares_its_slot_and_is_no_user_key(
    redis_client: redis.Redis, user_key: str
) -> None:
    prefix = user_key.removesuffix("u1")
    hash_key = admits_key(user_key, prefix)

    assert hash_key.startswith(prefix)  # an ACL that grants ~<prefix>* covers it
    assert key_slot(hash_key.encode()) == key_slot(user_key.encode())
    if is_cluster(redis_client):  # the server says the same
        assert redis_client.cluster_keyslot(hash_key) == redis_client.cluster_keyslot(user_key)
    assert admits_key(prefix + "u2", prefix) != hash_key


def test_the_admissions_hash_expires_after_the_window_and_the_scan_skips_it(
    index: UnpaidIndex, redis_client: redis.Redis, clock: ManualClock
) -> None:
    index.admit(
        AdmitRequest("u1", "o-new", expires_at_ms=clock() + 60_000, now_ms=clock(), limit=3)
    )

    assert redis_client.hget(index.admits_key("u1"), "o-new") == str(clock()).encode()
    assert 0 < redis_client.pttl(index.admits_key("u1")) <= index.window_ms
    assert redis_client.pttl(KEY) == -1
    assert list(index.scan_users()) == [["u1"]]
