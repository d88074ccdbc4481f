"""The counted resources' index (orders/index/resources.py and its scripts) on real servers:
a reserve is all or nothing and refuses only what is really taken, an expired hold frees
its units, a retry, a release and a sale count once, a resource without keys is unknown and
never written, a rebuild is exact, and a full server refuses before writing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.index.errors import ServerRefused
from orders.index.nodes import RedisClient, is_cluster, primaries
from orders.index.resources import Reservation, ResourceIndex
from tests.support.cluster import LocalCluster
from tests.support.redis_server import RedisServer, own_server
from tests.support.stores import flush_db, key_count

pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]

PREFIX = "T-"
NOW = 1_800_000_000_000
LATER = NOW + 600_000


@pytest.fixture
def index(redis_client: RedisClient) -> ResourceIndex:
    return ResourceIndex(redis_client, PREFIX)


def raw(index: ResourceIndex, resource_id: str) -> tuple[dict[bytes, bytes], list[Any]]:
    """The resource's two keys as stored, expired members and all."""
    res, holds, _ = index.keys(resource_id)
    return index.client.hgetall(res), index.client.zrange(holds, 0, -1, withscores=True)


def build(index: ResourceIndex, resource_id: str, cap: int, *members: tuple[str, int, int]) -> None:
    index.rebuild(resource_id, cap, 0, list(members), NOW - 1)


def ids_on_distinct_slots(client: RedisClient, count: int) -> list[str]:
    """Resource ids in ``count`` different hash slots, on different nodes of a cluster where
    it has that many."""
    found: list[str] = []
    nodes: set[str] = set()
    for n in range(10_000):
        candidate = f"sku:{n}"
        if is_cluster(client):
            node = client.get_node_from_key(candidate).name
            if node in nodes and len(nodes) < len(primaries(client)):
                continue
            nodes.add(node)
        if key_slot(candidate.encode()) not in {key_slot(f.encode()) for f in found}:
            found.append(candidate)
        if len(found) == count:
            return found
    raise AssertionError("no ids found")


def test_reserve_up_to_capacity_then_refuses_with_free_units_and_writes_nothing(
    index: ResourceIndex,
) -> None:
    build(index, "sku:1", 3)

    assert index.reserve("o1", LATER, NOW, [("sku:1", 2)]) == Reservation(None, None)
    before = raw(index, "sku:1")
    assert index.reserve("o2", LATER, NOW, [("sku:1", 2)]) == Reservation("sku:1", 1)
    assert raw(index, "sku:1") == before
    assert index.reserve("o3", LATER, NOW, [("sku:1", 1)]) == Reservation(None, None)

    snap = index.snapshot("sku:1", NOW)
    assert snap is not None
    assert (snap.cap, snap.sold, snap.held, snap.free) == (3, 0, 3, 0)
    assert snap.members == {"o1": (2, LATER), "o3": (1, LATER)}


def test_a_cart_short_on_one_resource_writes_no_member_anywhere(
    index: ResourceIndex, redis_kind: str
) -> None:
    a, b, c = ids_on_distinct_slots(index.client, 3)
    if redis_kind == "cluster":
        assert len(index.slot_groups([a, b, c])) == 3  # one call a slot: compensation runs
    build(index, a, 5)
    build(index, b, 1, ("o-old", 1, LATER))
    build(index, c, 5)
    before = {rid: raw(index, rid) for rid in (a, b, c)}

    refused = index.reserve("o1", LATER, NOW, [(a, 2), (b, 1), (c, 2)])

    assert refused == Reservation(b, 0)
    assert {rid: raw(index, rid) for rid in (a, b, c)} == before
    # Two short: the first in the cart's order is named.
    assert index.reserve("o1", LATER, NOW, [(c, 9), (b, 1), (a, 1)]).refused == c
    assert index.reserve("o1", LATER, NOW, [(a, 1), (b, 1), (c, 9)]).refused == b
    assert {rid: raw(index, rid) for rid in (a, b, c)} == before
    # The same cart with room is taken whole.
    assert index.reserve("o1", LATER, NOW, [(a, 2), (c, 2)]) == Reservation(None, None)
    for rid in (a, c):
        snap = index.snapshot(rid, NOW)
        assert snap is not None
        assert snap.members == {"o1": (2, LATER)}


def test_expired_members_free_their_units_at_the_next_reserve(index: ResourceIndex) -> None:
    build(index, "sku:1", 2, ("o-old", 1, NOW + 500))
    index.reserve("o1", NOW + 1_000, NOW, [("sku:1", 1)])
    before = raw(index, "sku:1")
    # o-old no longer counts, o1 does; a refusal drops nothing (it writes nothing at all).
    assert index.reserve("o2", LATER, NOW + 999, [("sku:1", 2)]) == Reservation("sku:1", 1)
    assert raw(index, "sku:1") == before

    # At its expiry exactly, o1 no longer counts; this reserve drops both and their units.
    assert index.reserve("o2", LATER, NOW + 1_000, [("sku:1", 2)]) == Reservation(None, None)

    fields, members = raw(index, "sku:1")
    assert fields[b"held"] == b"2"
    assert b"o:o1" not in fields
    assert b"o:o-old" not in fields
    assert [m for m, _ in members] == [b"o2"]


def test_an_expired_member_of_the_same_order_counts_afresh(index: ResourceIndex) -> None:
    build(index, "sku:1", 3)
    index.reserve("o1", NOW + 1_000, NOW, [("sku:1", 2)])

    assert index.reserve("o1", LATER, NOW + 1_000, [("sku:1", 3)]) == Reservation(None, None)

    fields, members = raw(index, "sku:1")
    assert (fields[b"held"], fields[b"o:o1"]) == (b"3", b"3")
    assert members == [(b"o1", float(LATER))]


def test_a_retry_of_the_same_order_is_not_counted_twice(index: ResourceIndex) -> None:
    build(index, "sku:1", 3)

    assert index.reserve("o1", LATER, NOW, [("sku:1", 2)]) == Reservation(None, None)
    assert index.reserve("o1", LATER, NOW + 5, [("sku:1", 2)]) == Reservation(None, None)

    snap = index.snapshot("sku:1", NOW + 5)
    assert snap is not None
    assert snap.held == 2
    assert index.client.hget(index.keys("sku:1")[0], "held") == b"2"
    assert index.reserve("o2", LATER, NOW + 5, [("sku:1", 1)]).refused is None


def test_release_frees_the_units_once(index: ResourceIndex) -> None:
    a, b = ids_on_distinct_slots(index.client, 2)
    build(index, a, 2, ("o-other", 1, LATER))
    build(index, b, 2)
    index.reserve("o1", LATER, NOW, [(a, 1), (b, 2)])

    index.release("o1", [a, b])
    index.release("o1", [a, b])

    snap_a, snap_b = index.snapshot(a, NOW), index.snapshot(b, NOW)
    assert snap_a is not None
    assert snap_b is not None
    assert (snap_a.held, snap_a.members) == (1, {"o-other": (1, LATER)})
    assert (snap_b.held, snap_b.members) == (0, {})


def test_release_many_releases_every_order_named(index: ResourceIndex) -> None:
    a, b = ids_on_distinct_slots(index.client, 2)
    build(index, a, 10)
    build(index, b, 10)
    for n in range(5):
        index.reserve(f"o{n}", LATER, NOW, [(a, 1), (b, 1)])

    index.release_many([(f"o{n}", [a, b]) for n in range(4)] + [("o4", [b])])

    snap_a, snap_b = index.snapshot(a, NOW), index.snapshot(b, NOW)
    assert snap_a is not None
    assert snap_b is not None
    assert (snap_a.held, list(snap_a.members)) == (1, ["o4"])
    assert (snap_b.held, snap_b.members) == (0, {})


def test_sell_moves_units_from_held_to_sold_once(index: ResourceIndex) -> None:
    build(index, "sku:1", 5)
    index.reserve("o1", LATER, NOW, [("sku:1", 2)])

    index.sell("o1", ["sku:1"])
    index.sell("o1", ["sku:1"])

    snap = index.snapshot("sku:1", NOW)
    assert snap is not None
    assert (snap.cap, snap.sold, snap.held, snap.members) == (5, 2, 0, {})


def test_sell_of_a_non_member_changes_nothing(index: ResourceIndex) -> None:
    build(index, "sku:1", 5, ("o-other", 1, LATER))
    before = raw(index, "sku:1")

    index.sell("o-ghost", ["sku:1", "sku:missing"])

    assert raw(index, "sku:1") == before
    assert index.client.exists(*index.keys("sku:missing")) == 0


def test_an_unknown_resource_is_reported_and_nothing_is_written_for_it(
    index: ResourceIndex,
) -> None:
    known, lost, missing = ids_on_distinct_slots(index.client, 3)
    build(index, known, 2)
    build(index, lost, 2, ("o-old", 1, LATER))
    index.client.delete(index.keys(lost)[1])  # one key lost: the hash alone is left

    reservation = index.reserve("o1", LATER, NOW, [(missing, 1), (known, 1), (lost, 1)])

    assert reservation == Reservation(None, None, (missing, lost))
    assert index.client.exists(*index.keys(missing)) == 0
    assert index.client.hget(index.keys(lost)[0], "o:o1") is None
    assert index.snapshot(lost, NOW) is None
    assert index.snapshot(missing, NOW) is None
    snap = index.snapshot(known, NOW)
    assert snap is not None
    assert snap.members == {"o1": (1, LATER)}


def test_rebuild_replaces_state_and_skips_expired(index: ResourceIndex) -> None:
    build(index, "sku:1", 10, ("o-stale", 4, LATER))
    index.reserve("o-late", LATER, NOW, [("sku:1", 1)])
    members = [(f"o{n}", 1, LATER + n) for n in range(2_500)]  # more than one part

    index.rebuild("sku:1", 3_000, 7, [*members, ("o-expired", 5, NOW)], NOW)

    snap = index.snapshot("sku:1", NOW)
    assert snap is not None
    assert (snap.cap, snap.sold, snap.held) == (3_000, 7, 2_500)
    assert snap.members == {o: (u, e) for o, u, e in members}
    fields, _ = raw(index, "sku:1")
    assert fields[b"held"] == b"2500"
    assert b"o:o-expired" not in fields
    assert [index.client.pttl(key) for key in index.keys("sku:1")[:2]] == [-1, -1]
    assert key_count(index.client) == 2  # no temporary key left behind


def test_rebuild_without_members_leaves_no_holds_set(index: ResourceIndex) -> None:
    build(index, "sku:1", 10, ("o-stale", 4, LATER))

    index.rebuild("sku:1", 4, 1, [("o-expired", 1, NOW)], NOW)

    assert raw(index, "sku:1") == ({b"cap": b"4", b"sold": b"1", b"held": b"0"}, [])
    assert index.reserve("o1", LATER, NOW, [("sku:1", 3)]) == Reservation(None, None)


def test_set_capacity_writes_only_where_the_resource_is_known(index: ResourceIndex) -> None:
    assert index.set_capacity("sku:missing", 5) is False
    assert index.client.exists(*index.keys("sku:missing")) == 0

    build(index, "sku:1", 2, ("o1", 2, LATER))
    assert index.set_capacity("sku:1", 1) is True
    # Below what is held: new holds are refused, none is taken back.
    assert index.reserve("o2", LATER, NOW, [("sku:1", 1)]) == Reservation("sku:1", 0)
    snap = index.snapshot("sku:1", NOW)
    assert snap is not None
    assert (snap.cap, snap.held) == (1, 2)


def test_move_rescored_members_only(index: ResourceIndex) -> None:
    a, b = ids_on_distinct_slots(index.client, 2)
    build(index, a, 5)
    build(index, b, 5)
    index.reserve("o1", NOW + 1_000, NOW, [(a, 1)])

    index.move("o1", [a, b], LATER)

    assert index.client.zscore(index.keys(a)[1], "o1") == LATER
    assert index.client.zcard(index.keys(b)[1]) == 0


def test_scan_resources_and_forget(index: ResourceIndex) -> None:
    ids = ids_on_distinct_slots(index.client, 3)
    for rid in ids:
        build(index, rid, 1, ("o1", 1, LATER))
    index.client.set(f"{PREFIX}[res]{{bad{{id}}}}", "x")  # foreign: no resource id

    assert sorted(r for batch in index.scan_resources() for r in batch) == sorted(ids)
    index.forget(ids[0])
    assert index.client.exists(*index.keys(ids[0])) == 0
    assert sorted(r for batch in index.scan_resources() for r in batch) == sorted(ids[1:])
    assert index.snapshot(ids[0], NOW) is None


@pytest.fixture
def full_server(redis_binary: Path | None) -> Iterator[RedisServer]:
    """A server of the test's own (its maxmemory is changed); the script is the same on a
    cluster's nodes."""
    with own_server(redis_binary) as server:
        yield server


def test_a_full_server_refuses_a_reserve_and_writes_nothing(full_server: RedisServer) -> None:
    with redis.Redis.from_url(full_server.url) as client:
        index = ResourceIndex(client, PREFIX)
        # An expired member: dropping it first would be a write that frees memory, and
        # would let every later write of the script pass a full server.
        build(index, "sku:1", 5, ("o-old", 1, NOW + 1_000))
        build(index, "sku:2", 5)
        before = {rid: raw(index, rid) for rid in ("sku:1", "sku:2")}
        client.config_set("maxmemory-policy", "noeviction")
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) // 2)
        try:
            with pytest.raises(ServerRefused, match="out of memory"):
                index.reserve("o1", LATER, NOW + 2_000, [("sku:1", 1), ("sku:2", 1)])
            assert {rid: raw(index, rid) for rid in ("sku:1", "sku:2")} == before
            index.release("o-old", ["sku:1"])  # frees memory: a full server lets it run
        finally:
            client.config_set("maxmemory", 0)
        assert index.reserve("o1", LATER, NOW + 2_000, [("sku:1", 1)]).refused is None


def test_a_cart_costs_one_round_trip_a_node(
    index: ResourceIndex, redis_nodes: int, redis_round_trips: Any
) -> None:
    ids = ids_on_distinct_slots(index.client, 3)
    for rid in ids:
        build(index, rid, 1)
    index.reserve("warm", LATER, NOW, [(rid, 1) for rid in ids])  # scripts loaded
    index.release("warm", ids)

    redis_round_trips.count = 0
    assert index.reserve("o1", LATER, NOW, [(ids[0], 1)]).refused is None
    assert redis_round_trips.count == 1  # one resource: one call on a cluster too
    redis_round_trips.count = 0
    assert index.reserve("o2", LATER, NOW, [(rid, 1) for rid in ids[1:]]).refused is None
    assert redis_round_trips.count == min(redis_nodes, 2)
    redis_round_trips.count = 0
    index.release_many([("o1", ids), ("o2", ids)])
    assert redis_round_trips.count == redis_nodes
    redis_round_trips.count = 0
    assert index.reserve("o4", LATER, NOW, []) == Reservation(None, None)
    assert redis_round_trips.count == 0
    if not is_cluster(index.client):  # the whole cart is one script call
        before = evalsha_calls(index.client)
        assert index.reserve("o3", LATER, NOW, [(rid, 1) for rid in ids]).refused is None
        assert evalsha_calls(index.client) == before + 1


def evalsha_calls(client: RedisClient) -> int:
    stats: dict[str, Any] = client.info("commandstats")
    return int(stats["cmdstat_evalsha"]["calls"])


def test_a_reader_sees_the_old_state_or_the_new_never_half_a_rebuild(
    index: ResourceIndex,
) -> None:
    old = [(f"old{n}", 1, LATER) for n in range(3_000)]
    new = [(f"new{n}", 2, LATER) for n in range(2_500)]
    index.rebuild("sku:1", 10_000, 0, old, NOW)
    seen: set[tuple[int, int, int] | None] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            snap = index.snapshot("sku:1", NOW)
            seen.add(None if snap is None else (snap.cap, snap.held, len(snap.members)))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(3):
            index.rebuild("sku:1", 20_000, 5, new, NOW)
            index.rebuild("sku:1", 10_000, 0, old, NOW)
    finally:
        done.set()
        reader.join(30)

    assert seen <= {(10_000, 3_000, 3_000), (20_000, 5_000, 2_500)}, seen


@pytest.fixture
def cluster_index(local_cluster: LocalCluster) -> ResourceIndex:
    client = build_redis(Settings(redis_url=local_cluster.url, redis_cluster=True))
    flush_db(client)
    return ResourceIndex(client, PREFIX)


def test_a_cart_one_cluster_node_refuses_is_taken_back_from_the_others(
    cluster_index: ResourceIndex,
) -> None:
    index = cluster_index
    ids = ids_on_distinct_slots(index.client, 3)
    for rid in ids:
        build(index, rid, 5)
    index.reserve("warm", LATER, NOW, [(rid, 1) for rid in ids])  # scripts loaded
    index.release("warm", ids)
    before = {rid: raw(index, rid) for rid in ids}
    full = index.client.get_node_from_key(index.keys(ids[1])[0]).redis_connection
    full.config_set("maxmemory", int(full.info("memory")["used_memory"]) // 2)
    try:
        with pytest.raises(ServerRefused, match="out of memory"):
            index.reserve("o1", LATER, NOW, [(rid, 1) for rid in ids])
        assert {rid: raw(index, rid) for rid in ids} == before
    finally:
        full.config_set("maxmemory", 0)
        index.client.close()


def test_named_units_are_refused_while_their_holder_is_live_and_freed_by_its_release(
    index: ResourceIndex,
) -> None:
    build(index, "ev7", 4)
    assert index.reserve("o1", LATER, NOW, [("ev7", 2)], {"ev7": ["A-1", "A-2"]}).refused is None
    index.hold_units("o1", {"ev7": ["A-1", "A-2"]})

    refused = index.reserve("o2", LATER, NOW, [("ev7", 2)], {"ev7": ["A-3", "A-2"]})
    retry = index.reserve("o1", LATER, NOW, [("ev7", 2)], {"ev7": ["A-1", "A-2"]})
    expired = index.reserve("o3", LATER + 10, LATER, [("ev7", 1)], {"ev7": ["A-1"]})

    assert (refused.refused, refused.free, refused.taken) == ("ev7", None, ("A-2",))
    assert retry.refused is None  # its own units
    assert expired.refused is None  # o1's member expired at LATER: it holds nothing
    index.sell("o1", ["ev7"])
    bought = index.reserve("o4", LATER + 10, NOW, [("ev7", 1)], {"ev7": ["A-1"]})
    assert bought.taken == ("A-1",)
    index.release("o3", ["ev7"])  # o3 holds no unit: A-1 stays o1's
    assert index.client.hget(index.keys("ev7")[2], "A-1") == b"!o1"


def test_a_rebuild_writes_the_units_of_live_members_and_those_sold(index: ResourceIndex) -> None:
    named = [
        ("A-1", "held", "o1"),
        ("A-2", "sold", "o0"),
        ("A-3", "held", "o-gone"),
        ("A-4", "free", None),
    ]

    index.rebuild("ev7", 4, 1, [("o1", 1, LATER), ("o-gone", 1, NOW)], NOW, named)

    snap = index.snapshot("ev7", NOW)
    assert snap is not None
    assert snap.units == {"A-1": "o1", "A-2": "!o0"}
    index.release("o1", ["ev7"])
    assert index.client.hgetall(index.keys("ev7")[2]) == {b"A-2": b"!o0"}
