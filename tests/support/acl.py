"""The Redis ACL of the service's user: exactly the keys and commands the service uses
(docs/operations.md gives it to operators; tests/integration/test_redis_acl.py proves it)."""

from __future__ import annotations

PREFIX = "UnpaidOrder-"
#: Exactly what the service sends (tests/integration/test_redis_acl.py says where each comes from).
SERVICE_COMMANDS = (
    "evalsha",
    "script|load",
    "zremrangebyscore",
    "zscore",
    "zcount",
    "zrange",
    "zadd",
    "persist",
    "zrem",
    "set",
    "get",
    "pexpire",
    "del",
    "hset",
    "hget",
    "hgetall",
    "hdel",
    "scan",
    "info",
    "ping",
)
#: The ACL of the service's user, minus its password.
ORDERS_ACL = f"on resetchannels ~{PREFIX}* -@all " + " ".join(f"+{c}" for c in SERVICE_COMMANDS)
