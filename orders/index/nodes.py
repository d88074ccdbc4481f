"""Which Redis server a key's commands go to: one node, or the primaries of a cluster.

The service runs on a plain ``redis.Redis`` or on redis-py's ``RedisCluster`` alike. Single
commands and scripts need nothing from here: each touches exactly one key, and the cluster
client sends it to the node serving that key's slot, following MOVED and ASK. What a cluster
changes is bulk traffic (one round trip per node, not per cluster) and anything that walks
the whole keyspace (SCAN runs on every primary), and markers that must tell whether any
node lost or rewound its data (one marker per primary, checked on that primary).
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Sequence
from typing import Any, TypeGuard

import redis
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, ClusterDownError, MovedError, TryAgainError

#: A client the service accepts: one server, or a cluster.
RedisClient = redis.Redis | RedisCluster

#: Replies that mean "not on this node now" (a reshard, a failover): the call is sent again
#: through the cluster client, which follows the redirection and refreshes its slot map.
REDIRECTIONS = (MovedError, AskError, TryAgainError, ClusterDownError)


def is_cluster(client: RedisClient) -> TypeGuard[RedisCluster]:
    return isinstance(client, RedisCluster)


def primaries(client: RedisClient) -> list[redis.Redis]:
    """A client on each server holding part of the keyspace: the client itself, or one per
    cluster primary (as the cluster client knows them now)."""
    if not isinstance(client, RedisCluster):
        return [client]
    cluster: Any = client  # redis-py's cluster client is untyped
    return [node.redis_connection for node in cluster.get_primaries()]


def group_by_node(
    client: RedisClient, keys: Sequence[bytes]
) -> list[tuple[redis.Redis, list[int]]]:
    """The positions of ``keys`` grouped by the server that serves each now (one group on a
    single server). The cluster client's slot map may be stale: callers send again through
    the cluster client what comes back as one of :data:`REDIRECTIONS`."""
    if not isinstance(client, RedisCluster):
        return [(client, list(range(len(keys))))]
    cluster: Any = client
    groups: dict[str, tuple[redis.Redis, list[int]]] = {}
    for position, key in enumerate(keys):
        node = cluster.get_node_from_key(key)
        if node.name not in groups:
            groups[node.name] = (node.redis_connection, [])
        groups[node.name][1].append(position)
    return list(groups.values())


def marker_keys(client: RedisClient, base: str) -> list[str]:
    """Keys for a marker that vanishes when any part of the keyspace loses its data: the
    keys of :func:`marker_nodes`."""
    return [key for _, key in marker_nodes(client, base)]


def marker_nodes(client: RedisClient, base: str) -> list[tuple[redis.Redis, str]]:
    """Each server holding part of the keyspace, with the key of its copy of a marker.

    One server: the client and ``base`` itself. A cluster: each primary (as the cluster
    client knows them now) with ``base`` plus a hash tag placing the key on a slot that
    primary serves now (its lowest), so a primary restarted empty loses its copy. After a
    reshard a primary may find its marker missing although no data was lost: the marker
    then only asks for one rebuild too many.
    """
    if not isinstance(client, RedisCluster):
        return [(client, base)]
    lowest: dict[str, tuple[int, Any]] = {}
    for slot, nodes in sorted(client.nodes_manager.slots_cache.items()):
        if nodes:
            lowest.setdefault(nodes[0].name, (slot, nodes[0]))
    return [
        (node.redis_connection, f"{base}{{{hash_tag(slot)}}}")
        for slot, node in sorted(lowest.values(), key=lambda found: int(found[0]))
    ]


_TAGS: dict[int, str] = {}


def hash_tag(slot: int) -> str:
    """A short string whose CRC16 lands on ``slot`` (found once per process, then kept)."""
    if slot not in _TAGS:
        alphabet = string.ascii_letters + string.digits
        for length in itertools.count(1):
            for letters in itertools.product(alphabet, repeat=length):
                tag = "".join(letters)
                found = key_slot(tag.encode())
                _TAGS.setdefault(found, tag)
                if found == slot:
                    return tag
    return _TAGS[slot]
