"""Bulk Redis traffic (reconcile's, the sweep's cleanup) packed by hand on a raw connection.

One Lua script (or one plain command) run on many keys in one round trip, packed by hand
and read later:

redis-py's pipeline packs each command and handles each reply in Python, which costs the
client more than a short script costs the server. :func:`run_per_key` packs one plain
command per key, sends them and reads the replies. :class:`CallPacker` writes each
``EVALSHA sha 1 key args...`` in the Redis protocol (RESP); :func:`send_calls` writes them
all at once on a connection it keeps checked out and returns at once, so the caller can do
other work (read SQL) while the server runs them; :meth:`SentCalls.read` then collects the
replies off that connection. On NOSCRIPT (a restarted server, SCRIPT FLUSH) it loads the
script and runs again only the calls that did not run. A connection whose replies were not
all read is disconnected, never handed out again. Each call touches one key, so nothing here
changes on Redis Cluster but the connection a key's calls go to.

:func:`scan_ahead` is SCAN one call ahead: the next call runs on the server while the
caller works on the keys of the last; :func:`scan_named` reads the user each key names.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import closing
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from orders.index.errors import redis_errors
from orders.index.nodes import REDIRECTIONS, RedisClient, group_by_node, primaries

#: Where foreign data under the prefix is reported: (key, what is wrong with it), as
#: :meth:`orders.index.unpaid.UnpaidIndex.foreign`.
Foreign = Callable[[bytes | str, str], None]


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(value), value)


class CallPacker:
    """Packs calls of one script, each on one key, all starting with the same ``head``
    arguments (already encoded)."""

    def __init__(self, script: Script, head: Sequence[bytes]) -> None:
        self.script = script
        sha = script.sha.encode()
        self._fixed = len(head) + 4  # EVALSHA, sha, numkeys, key
        self._prefix = b"$7\r\nEVALSHA\r\n%b$1\r\n1\r\n" % _bulk(sha)
        self._sha = sha
        self._head_count = len(head)
        self._head = b"".join(_bulk(arg) for arg in head)
        #: One packed command per call, in the order added, and the key of each.
        self.calls: list[bytes] = []
        self.keys: list[bytes] = []

    def add_pairs(self, key: bytes, pairs: dict[str, int]) -> None:
        """Queue ``EVALSHA sha 1 key *head`` then ``score member`` for each member (the
        shape of ZADD's arguments), encoded on the way."""
        call = b"*%d\r\n%b$%d\r\n%b\r\n%b" % (
            self._fixed + 2 * len(pairs),
            self._prefix,
            len(key),
            key,
            self._head,
        )
        for member, score in pairs.items():
            number = b"%d" % score
            text = member.encode()
            call += b"$%d\r\n%b\r\n$%d\r\n%b\r\n" % (len(number), number, len(text), text)
        self.calls.append(call)
        self.keys.append(key)

    def add_call(self, keys: Sequence[bytes], args: Sequence[bytes]) -> None:
        """Queue ``EVALSHA sha len(keys) *keys *head *args``: a script of several keys (all in
        one hash slot), sent to the node of the first."""
        parts = [b"EVALSHA", self._sha, b"%d" % len(keys), *keys]
        call = b"*%d\r\n%b%b%b" % (
            len(parts) + self._head_count + len(args),
            b"".join(_bulk(part) for part in parts),
            self._head,
            b"".join(_bulk(arg) for arg in args),
        )
        self.calls.append(call)
        self.keys.append(keys[0])


def run_per_key(
    client: RedisClient, command: bytes, keys: Sequence[bytes], tail: Sequence[bytes]
) -> list[Any]:
    """``command key *tail`` for each key, packed by hand and sent in one round trip; the
    replies in order. The first error reply is raised (as a redis-py pipeline does)."""
    if not keys:
        return []
    head = b"*%d\r\n%b" % (len(tail) + 2, _bulk(command))
    rest = b"".join(_bulk(arg) for arg in tail)
    calls = [b"%b$%d\r\n%b\r\n%b" % (head, len(key), key, rest) for key in keys]
    replies = _send(client, None, calls, keys).read()
    for reply in replies:
        if isinstance(reply, redis.RedisError):
            raise reply
    return replies


def send_calls(client: RedisClient, packer: CallPacker) -> SentCalls | ClusterCalls:
    """Write every queued call now; read the replies with :meth:`SentCalls.read`, or give
    them up with :meth:`SentCalls.abandon` (one of the two must follow)."""
    return _send(client, packer.script, packer.calls, packer.keys)


def _send(
    client: RedisClient, script: Script | None, calls: list[bytes], keys: Sequence[bytes]
) -> SentCalls | ClusterCalls:
    if isinstance(client, redis.Redis):
        return SentCalls(client, script, calls)
    return ClusterCalls(client, script, calls, keys)


class ClusterCalls:
    """Calls written to the primaries of a cluster, each node's at once, replies not read.

    A node's batch that could not be sent or read (the node failed), and each call that came
    back redirected, goes again alone through the cluster client when read.
    """

    def __init__(
        self, client: Any, script: Script | None, calls: list[bytes], keys: Sequence[bytes]
    ) -> None:
        self._client = client
        self._script = script
        self._calls = calls
        self._parts: list[tuple[list[int], SentCalls | None]] = []
        try:
            for node, positions in group_by_node(client, keys):
                try:
                    sent: SentCalls | None = SentCalls(node, script, [calls[i] for i in positions])
                except (redis.ConnectionError, redis.TimeoutError):
                    sent = None  # the node is down: its calls go through the cluster client
                self._parts.append((positions, sent))
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        for _, sent in self._parts:
            if sent is not None:
                sent.abandon()

    def read(self) -> list[Any]:
        replies: list[Any] = [None] * len(self._calls)
        again: list[int] = []
        try:
            for positions, sent in self._parts:
                got = _read_or_none(sent)
                if got is None:
                    again += positions
                    continue
                for position, reply in zip(positions, got, strict=True):
                    if isinstance(reply, REDIRECTIONS):
                        again.append(position)
                    else:
                        replies[position] = reply
        finally:
            self.abandon()  # parts not read when one raised; a no-op for the rest
        for position in sorted(again):
            replies[position] = self._one(self._calls[position])
        return replies

    def _one(self, call: bytes) -> Any:
        name, *args = unpack(call)
        command = (name.decode(), *args)  # the cluster client looks commands up by str
        try:
            try:
                return self._client.execute_command(*command)
            except NoScriptError:
                assert self._script is not None  # only EVALSHA answers NOSCRIPT
                self._client.script_load(self._script.script)  # on every primary
                return self._client.execute_command(*command)
        except redis.ResponseError as exc:  # one call's error: the rest still count
            return exc


def _read_or_none(sent: SentCalls | None) -> list[Any] | None:
    """A node's replies, or None when the node could not be reached (after its Retry)."""
    if sent is None:
        return None
    try:
        return sent.read()
    except (redis.ConnectionError, redis.TimeoutError):
        return None


def unpack(call: bytes) -> list[bytes]:
    """The arguments of one packed command (the inverse of the packing above)."""
    count_end = call.index(b"\r\n")
    args: list[bytes] = []
    at = count_end + 2
    for _ in range(int(call[1:count_end])):
        size_end = call.index(b"\r\n", at)
        size = int(call[at + 1 : size_end])
        args.append(call[size_end + 2 : size_end + 2 + size])
        at = size_end + 4 + size
    return args


class SentCalls:
    """Calls written on a checked-out connection, their replies not read yet."""

    def __init__(self, client: redis.Redis, script: Script | None, calls: list[bytes]) -> None:
        self._client = client
        self._script = script
        self._calls = calls
        self._packed = b"".join(calls)
        self._pool = client.connection_pool
        conn: Any = self._pool.get_connection()
        self._conn: Any = conn
        self._send_error: redis.RedisError | None = None
        try:
            conn.send_packed_command([self._packed])
        except redis.RedisError as exc:  # retried by read(), as the client's Retry allows
            conn.disconnect()
            self._send_error = exc
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """Give the replies up: the connection is closed, so none is left on the socket."""
        if self._conn is not None:
            conn, self._conn = self._conn, None
            conn.disconnect()
            self._pool.release(conn)

    def read(self) -> list[Any]:
        """The reply of each call, in order; an error reply comes back as its exception.

        Raises redis.RedisError when the connection fails (after the client's Retry: the
        whole batch is sent again, as redis-py's own pipelines do).
        """
        replies = self._collect()
        if self._script is None:  # plain commands: no script to load
            return replies
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            self._client.script_load(self._script.script)
            again = SentCalls(self._client, self._script, [self._calls[i] for i in missing])
            for i, reply in zip(missing, again._collect(), strict=True):
                replies[i] = reply
        return replies

    def _collect(self) -> list[Any]:
        conn = self._conn
        if conn is None:
            raise RuntimeError("these replies were read or abandoned already")
        attempts = 0

        def attempt() -> list[Any]:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # the first attempt's commands went out in __init__
                conn.send_packed_command([self._packed])
            elif self._send_error is not None:
                raise self._send_error
            return _read_replies(conn, len(self._calls))

        try:
            replies: list[Any] = conn.retry.call_with_retry(
                attempt, lambda _error: conn.disconnect()
            )
        except BaseException:
            self.abandon()
            raise
        self._conn = None
        self._pool.release(conn)
        return replies


def _read_replies(conn: Any, count: int) -> list[Any]:
    replies: list[Any] = []
    try:
        for _ in range(count):
            try:
                replies.append(conn.read_response())
            except redis.ResponseError as exc:  # one call's error: the rest still come
                replies.append(exc)
    except BaseException:
        conn.disconnect()  # replies may be left unread: never hand this socket out again
        raise
    return replies


def scan_all(client: RedisClient, pattern: str, count: int) -> Generator[list[bytes]]:
    """:func:`scan_ahead` on each primary in turn (one server: on it). A key moved by a
    reshard while the walk runs may be missed or seen twice."""
    for node in primaries(client):
        yield from scan_ahead(node, pattern, count)


def scan_named(
    client: RedisClient,
    op: str,
    pattern: str,
    chunk: int,
    name_of: Callable[[bytes], str | None],
    foreign: Foreign,
) -> Generator[list[str]]:
    """The users ``name_of`` reads from the keys matching ``pattern``, a SCAN batch at a
    time (empty batches left out); a key it reads no user from is foreign."""
    with (
        redis_errors(op),
        closing(scan_all(client, pattern, chunk)) as batches,
    ):
        for keys in batches:
            users = []
            for key in keys:
                user = name_of(key)
                if user is None:
                    foreign(key, "key name is not a user id")
                elif not user.startswith("["):  # "[...]" names the service's own keys
                    users.append(user)
            if users:
                yield users


def scan_ahead(client: redis.Redis, pattern: str, count: int) -> Generator[list[bytes]]:
    """The keys matching ``pattern``, a SCAN call's worth at a time (empty lists left out),
    with the next call sent before a batch is handed out: the server works on it while the
    caller works on the batch. Close the iterator when stopping early (the connection is
    then closed, its reply unread). A failed connection is retried from the last cursor,
    as the client's Retry allows."""
    pool = client.connection_pool
    conn: Any = pool.get_connection()
    args = ("MATCH", pattern, "COUNT", count)
    try:
        cursor = 0
        sent = _send_quietly(conn, ("SCAN", cursor, *args))
        while True:
            cursor, keys = _scan_reply(conn, ("SCAN", cursor, *args), sent=sent)
            if cursor:
                sent = _send_quietly(conn, ("SCAN", cursor, *args))
            if keys:
                yield keys
            if not cursor:
                return
    except BaseException:
        conn.disconnect()  # a reply may be left unread: never hand this socket out again
        raise
    finally:
        pool.release(conn)


def _send_quietly(conn: Any, command: tuple[Any, ...]) -> bool:
    """Send ``command``; False when that failed (the connection is closed; the read sends
    again)."""
    try:
        conn.send_command(*command)
    except redis.RedisError:
        conn.disconnect()
        return False
    return True


def _scan_reply(conn: Any, command: tuple[Any, ...], *, sent: bool) -> tuple[int, list[bytes]]:
    """The reply of ``command`` (sent already unless ``sent`` is False); it is sent again
    after a connection failure."""
    attempts = 0

    def attempt() -> tuple[int, list[bytes]]:
        nonlocal attempts
        attempts += 1
        if attempts > 1 or not sent:
            conn.send_command(*command)
        cursor, keys = conn.read_response()
        return int(cursor), keys

    result: tuple[int, list[bytes]] = conn.retry.call_with_retry(
        attempt, lambda _error: conn.disconnect()
    )
    return result
