"""What about a Redis server's configuration could lose the index: checked at startup.

Eviction (any ``maxmemory-policy`` but ``noeviction``) may drop users' keys; no persistence
loses everything at a restart. Both are survivable (SQL is the record and reconcile rebuilds
the index), but an operator should know. On a cluster every primary is asked; a warning
that several give is said once. Servers that refuse CONFIG (managed services, restricted
ACL users) yield no warning.
"""

from __future__ import annotations

from typing import Any

import redis

from orders.index.nodes import RedisClient, primaries


def server_warnings(client: RedisClient) -> list[str]:
    """The warnings for ``client``'s server, or for each primary of its cluster."""
    try:
        nodes = primaries(client)
    except redis.RedisError as exc:
        return [_unusable(exc)]
    found: dict[str, None] = {}
    for node in nodes:
        found.update(dict.fromkeys(_node_warnings(node)))
    return list(found)


def _node_warnings(node: redis.Redis) -> list[str]:
    try:
        config: dict[Any, Any] = node.config_get("maxmemory-policy")
        config.update(node.config_get("save"))
        config.update(node.config_get("appendonly"))
    except redis.ResponseError:
        return []  # CONFIG refused (ACL, managed service): nothing to say
    except redis.RedisError as exc:
        return [_unusable(exc)]
    values = {_text(k): _text(v) for k, v in config.items()}
    warnings = []
    policy = values.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        warnings.append(
            f"redis maxmemory-policy is {policy}: keys of the index may be evicted "
            "(set noeviction; reconcile repairs what is lost)"
        )
    if not values.get("save") and values.get("appendonly") != "yes":
        warnings.append(
            "redis has no persistence (no RDB save points, appendonly no): a restart "
            "empties the index until the scheduler rebuilds it from SQL"
        )
    return warnings


def _unusable(exc: redis.RedisError) -> str:
    return (
        f"redis not usable at startup ({type(exc).__name__}): creates will be refused "
        "until it is (check ORDERS_REDIS_URL and its credentials)"
    )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value
