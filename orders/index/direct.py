"""One command packed by hiredis and run on a connection of the client's pool: the
admission's way to Redis, the hot path of every create and of every refusal at the limit.

redis-py's ``execute_command`` encodes each argument in Python (an admission has twelve)
and runs its observability hooks on every call: for a refusal that costs the client more
than the rest of the call. Here the command is packed in C (``hiredis.pack_command``, the
packer redis-py itself calls), then written and its reply read on a connection of the
client's pool, under the client's Retry: a connection that fails is closed before the
retry, as redis-py does, and one interrupted between the write and the read is closed by
redis-py's ``read_response`` (or found with data pending, and reconnected, by the pool).
An error reply is raised as redis-py raises it (``NoScriptError`` included).

Only for a plain ``redis.Redis`` on its pool: a cluster client, a single-connection client
and one with a client-side cache go through redis-py's own call (:func:`pool_of` says).
"""

from __future__ import annotations

from typing import Any

import redis
from hiredis import pack_command

from orders.index.nodes import RedisClient


def pool_of(client: RedisClient) -> Any:
    """The pool to run packed commands on, or None when ``client`` must be called instead."""
    if not isinstance(client, redis.Redis):
        return None
    if client.connection is not None or client.get_cache() is not None:
        return None
    return client.connection_pool


def packed(command: tuple[str | int, ...]) -> bytes:
    """``command`` in the Redis protocol: strings as UTF-8, integers in decimal (hiredis's
    stub types a one-element tuple only)."""
    args: Any = command
    result: bytes = pack_command(args)
    return result


def run_packed(pool: Any, packed: bytes) -> Any:
    """Write ``packed`` (one command) on a connection of ``pool`` and read its reply."""
    conn: Any = pool.get_connection()
    try:
        return conn.retry.call_with_retry(
            lambda: _send_and_read(conn, packed), lambda _error: conn.disconnect()
        )
    finally:
        pool.release(conn)


def _send_and_read(conn: Any, packed: bytes) -> Any:
    conn.send_packed_command([packed])
    return conn.read_response()
