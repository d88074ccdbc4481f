"""What a Redis Cluster changes, on a real local cluster (tests/support/cluster.py): the epoch
marker lives on every primary and names that primary's run, bulk calls go to each node at
once, and a cluster no node of which answers is a store failure, not a crash. The contract
itself runs on the cluster through the ``cluster_too`` suites."""

from __future__ import annotations

import socket

import pytest
import redis
from redis.cluster import RedisCluster

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.errors import StoreUnavailable
from orders.index.epoch import IndexEpoch
from orders.index.nodes import group_by_node, marker_keys, marker_nodes, primaries
from orders.index.pipeline import run_per_key
from orders.index.unpaid import UnpaidIndex
from tests.support.cluster import LocalCluster
from tests.support.stores import flush_db


@pytest.fixture
def cluster_client(local_cluster: LocalCluster) -> RedisCluster:
    client = build_redis(Settings(redis_url=local_cluster.url, redis_cluster=True))
    assert isinstance(client, RedisCluster)
    flush_db(client)
    return client


def test_the_epoch_marker_is_gone_when_any_one_primary_loses_its_data(
    cluster_client: RedisCluster,
) -> None:
    index = UnpaidIndex(cluster_client, key_prefix="UnpaidOrder-")
    nodes = primaries(cluster_client)
    keys = marker_keys(cluster_client, index.epoch.key())
    # One marker on each primary, each on a slot that primary serves.
    assert len(nodes) == 3
    assert sorted(
        len(group) for _, group in group_by_node(cluster_client, [k.encode() for k in keys])
    ) == [1, 1, 1]
    for node in nodes:
        index.epoch.set("1800000000000")
        assert index.epoch.get() == "1800000000000"
        assert index.epoch.check() is IndexEpoch.INTACT
        node.flushdb()  # this primary alone loses its data
        assert index.epoch.get() is None
        assert index.epoch.check() is IndexEpoch.LOST


def test_the_epoch_marker_names_the_run_of_its_own_primary_and_one_rewound_is_noticed(
    cluster_client: RedisCluster,
) -> None:
    index = UnpaidIndex(cluster_client, key_prefix="UnpaidOrder-")
    index.epoch.set("1800000000000")
    for node, key in marker_nodes(cluster_client, index.epoch.key()):
        assert node.get(key) == f"1800000000000:{node.info('server')['run_id']}".encode()
    for node, key in marker_nodes(cluster_client, index.epoch.key()):
        index.epoch.set("1800000000000")
        # This primary alone holds data of another run (restarted from a snapshot, or a
        # replica promoted): its marker names a run that is not its own.
        node.set(key, "1800000000000:0123456789abcdef0123456789abcdef01234567")
        assert index.epoch.check() is IndexEpoch.REWOUND
        assert index.epoch.get() == "1800000000000"


def test_bulk_commands_go_to_each_node_at_once_and_answer_in_order(
    cluster_client: RedisCluster,
) -> None:
    keys = [f"UnpaidOrder-u{i}".encode() for i in range(30)]
    for i, key in enumerate(keys):
        if i % 4:  # and some keys do not exist
            cluster_client.zadd(key, {f"o{j}": j for j in range(i % 4)})

    replies = run_per_key(cluster_client, b"ZCARD", keys, ())

    assert replies == [i % 4 for i in range(30)]
    assert len(group_by_node(cluster_client, keys)) == 3  # the keys span every node


def test_a_cluster_no_node_of_which_answers_is_store_unavailable_without_the_password() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = Settings(redis_url=f"redis://:hunter2@127.0.0.1:{port}", redis_cluster=True)
    with pytest.raises(StoreUnavailable) as failed:
        build_redis(settings)
    assert "hunter2" not in str(failed.value)
    assert failed.value.store == "redis"


def test_startup_warnings_ask_every_primary_and_say_each_thing_once(
    cluster_client: RedisCluster,
) -> None:
    index = UnpaidIndex(cluster_client, key_prefix="UnpaidOrder-")
    nodes = primaries(cluster_client)
    assert len(index.server_warnings()) == 1  # no persistence: the same on all three
    assert "no persistence" in index.server_warnings()[0]
    nodes[-1].config_set("maxmemory-policy", "allkeys-lru")  # one primary may evict
    try:
        warnings = index.server_warnings()
    finally:
        nodes[-1].config_set("maxmemory-policy", "noeviction")
    assert len(warnings) == 2
    assert "maxmemory-policy is allkeys-lru" in warnings[1]


def test_a_cluster_refuses_a_script_touching_a_key_on_another_node(
    cluster_client: RedisCluster,
) -> None:
    # Why the scripts name one key (tests/unit/test_scripts_touch_one_key.py): a cluster
    # node runs a script only on keys it serves, so the cluster suites passing shows the
    # scripts stay on their key. A key given as an argument, not in KEYS, on another node:
    here = "UnpaidOrder-u1"
    node = cluster_client.get_node_from_key(here).name
    elsewhere = next(
        f"UnpaidOrder-u{i}"
        for i in range(2, 100)
        if cluster_client.get_node_from_key(f"UnpaidOrder-u{i}").name != node
    )
    with pytest.raises(redis.ResponseError, match=r"non local key|same slot"):
        cluster_client.eval("return redis.call('ZCARD', ARGV[1])", 1, here, elsewhere)
