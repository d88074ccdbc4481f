"""One Lua script run on many keys in one round trip, packed by hand.

redis-py's pipeline packs each command and handles each reply in Python, which costs the
client more than a short script costs the server. :func:`run_script_on_keys` writes every
``EVALSHA sha 1 key args...`` into one buffer (the Redis protocol, RESP) and reads the
replies straight off the connection; on NOSCRIPT (a restarted server, SCRIPT FLUSH) it
loads the script and runs again only the calls that did not run. Each call touches one key,
so nothing here changes on Redis Cluster but the connection a key's calls go to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

#: One call: the key and the script's arguments, already encoded.
Call = tuple[bytes, Sequence[bytes]]


def run_script_on_keys(client: redis.Redis, script: Script, calls: list[Call]) -> list[Any]:
    """The reply of each call, in order; an error reply comes back as its exception.

    Raises redis.RedisError when the connection fails.
    """
    sha = script.sha.encode()
    replies = _pipelined(client, _pack(sha, calls), len(calls))
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        client.script_load(script.script)
        again = _pipelined(client, _pack(sha, [calls[i] for i in missing]), len(missing))
        for i, reply in zip(missing, again, strict=True):
            replies[i] = reply
    return replies


def _pack(sha: bytes, calls: list[Call]) -> bytes:
    out = bytearray()
    for key, args in calls:
        out += b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%b\r\n$1\r\n1\r\n$%d\r\n%b\r\n" % (
            len(args) + 4,
            len(sha),
            sha,
            len(key),
            key,
        )
        for arg in args:
            out += b"$%d\r\n%b\r\n" % (len(arg), arg)
    return bytes(out)


def _pipelined(client: redis.Redis, packed: bytes, count: int) -> list[Any]:
    """Send ``count`` packed commands at once, then read their replies; a connection that
    fails is retried as redis-py's own pipelines are (the client's Retry)."""
    pool = client.connection_pool
    conn: Any = pool.get_connection()
    try:
        replies: list[Any] = conn.retry.call_with_retry(
            lambda: _send_and_read(conn, packed, count), lambda _error: conn.disconnect()
        )
    finally:
        pool.release(conn)
    return replies


def _send_and_read(conn: Any, packed: bytes, count: int) -> list[Any]:
    try:
        conn.send_packed_command([packed])
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:  # one call's error: the rest still come
                replies.append(exc)
    except BaseException:
        conn.disconnect()  # replies may be left unread: never hand this socket out again
        raise
    return replies
