"""Scheduler heartbeats on a real Redis (and a real Redis Cluster): one hash, one field per
scheduler, the stale ones forgotten by the service clock the beats carry."""

from __future__ import annotations

import pytest
import redis

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.errors import InvalidInput, StoreUnavailable
from orders.index.heartbeat import Heartbeats, SchedulerBeat
from orders.index.nodes import RedisClient
from tests.support.clocks import ManualClock
from tests.support.stores import RoundTripCounter

pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]

FORGET_MS = 15_000


def beat(
    owner: str, now_ms: int, *, active: bool = False, sweep_ms: int | None = None
) -> SchedulerBeat:
    return SchedulerBeat(
        owner=owner,
        active=active,
        last_sweep_ms=sweep_ms,
        lease_expires_ms=now_ms + 5000 if active else None,
        seen_ms=now_ms,
    )


def test_beats_are_read_back_active_first_then_by_owner(
    redis_client: RedisClient, clock: ManualClock
) -> None:
    beats = Heartbeats(redis_client, key_prefix="UnpaidOrder-")
    now = clock()
    zed, active, alpha = (
        beat("zed", now),
        beat("mid", now, active=True, sweep_ms=now - 7),
        beat("alpha", now),
    )
    for one in (zed, active, alpha):
        beats.publish(one, forget_after_ms=FORGET_MS)

    assert beats.read(now) == [active, alpha, zed]
    assert beats.key == "UnpaidOrder-[schedulers]"
    assert sorted(redis_client.hkeys(beats.key)) == [b"alpha", b"mid", b"zed"]
    assert 0 < redis_client.pttl(beats.key) <= FORGET_MS
    # A scheduler's next beat replaces its field.
    later = beat("zed", now + 1000, active=False, sweep_ms=now)
    beats.publish(later, forget_after_ms=FORGET_MS)
    assert beats.read(now + 1000) == [active, alpha, later]


def test_a_beat_older_than_its_window_is_not_read_and_the_next_publish_deletes_it(
    redis_client: RedisClient, clock: ManualClock
) -> None:
    beats = Heartbeats(redis_client, key_prefix="UnpaidOrder-")
    beats.publish(beat("gone", clock()), forget_after_ms=FORGET_MS)
    beats.publish(beat("short", clock()), forget_after_ms=1000)
    clock.advance(ms=1000)
    assert [b.owner for b in beats.read(clock())] == ["gone", "short"]  # at the edge: kept

    clock.advance(ms=1)
    assert [b.owner for b in beats.read(clock())] == ["gone"]
    clock.advance(ms=FORGET_MS)
    assert beats.read(clock()) == []
    assert sorted(redis_client.hkeys(beats.key)) == [b"gone", b"short"]  # read writes nothing

    beats.publish(beat("live", clock()), forget_after_ms=FORGET_MS)
    assert redis_client.hkeys(beats.key) == [b"live"]
    assert [b.owner for b in beats.read(clock())] == ["live"]


def test_a_field_that_is_not_a_beat_is_skipped_and_then_dropped(
    redis_client: RedisClient, clock: ManualClock
) -> None:
    beats = Heartbeats(redis_client, key_prefix="UnpaidOrder-")
    redis_client.hset(beats.key, "foreign", b"\xff not json")
    redis_client.hset(beats.key, "half", '{"owner": "half", "seen_ms": 1}')
    assert beats.read(clock()) == []
    beats.publish(beat("live", clock()), forget_after_ms=FORGET_MS)
    assert redis_client.hkeys(beats.key) == [b"live"]


def test_publish_is_one_round_trip_and_remove_drops_one_field(
    redis_client: RedisClient, clock: ManualClock, redis_round_trips: RoundTripCounter
) -> None:
    beats = Heartbeats(redis_client, key_prefix="UnpaidOrder-")
    beats.publish(beat("A", clock()), forget_after_ms=FORGET_MS)  # loads the script
    beats.publish(beat("B", clock()), forget_after_ms=FORGET_MS)
    before = redis_round_trips.count
    beats.publish(beat("A", clock(), active=True), forget_after_ms=FORGET_MS)
    assert redis_round_trips.count - before == 1

    beats.remove("A")
    assert [b.owner for b in beats.read(clock())] == ["B"]


@pytest.mark.parametrize(
    ("owner", "forget_after_ms", "seen_ms"),
    [("", 1000, 0), ("A", 0, 0), ("A", True, 0), ("A", 1000, -1), ("A", 1.5, 0)],
)
def test_publish_refuses_bad_arguments(
    redis_client: RedisClient, owner: str, forget_after_ms: int, seen_ms: int
) -> None:
    beats = Heartbeats(redis_client, key_prefix="UnpaidOrder-")
    with pytest.raises(InvalidInput):
        beats.publish(beat(owner, seen_ms), forget_after_ms=forget_after_ms)
    assert redis_client.exists(beats.key) == 0


def test_redis_errors_are_store_unavailable(clock: ManualClock) -> None:
    client = build_redis(Settings(redis_url="unix:///tmp/orders-test-no-such-redis.sock"))
    assert isinstance(client, redis.Redis)
    beats = Heartbeats(client, key_prefix="UnpaidOrder-")
    with pytest.raises(StoreUnavailable):
        beats.publish(beat("A", clock()), forget_after_ms=FORGET_MS)
    with pytest.raises(StoreUnavailable):
        beats.read(clock())
    with pytest.raises(StoreUnavailable):
        beats.remove("A")
