"""A redis-py client whose sockets move their bytes on the running event loop.

The service's Redis code (its scripts, the hand-packed bulk calls of
:mod:`orders.index.pipeline`, the cluster routing) is written once, against redis-py's
synchronous client. Under :func:`orders.aio.greenlets.run` that client is made
non-blocking at its lowest layer: each connection's socket is a :class:`LoopSocket`,
whose waits (connect, send, receive, each bounded by the connection's timeouts) are
awaited on the loop. Everything above the socket (the parser, retries, health checks,
redirections of a cluster) is redis-py's own code, unchanged.

:func:`loop_client` builds such a client from a ``redis.asyncio`` client: the same server
(or cluster), database, credentials, timeouts, health checks and TLS settings. It keeps
its own connections; the ``redis.asyncio`` client's pool is not shared.

TLS runs over the same awaited socket: the standard library's ``ssl.SSLObject`` works on
two memory buffers (:meth:`ssl.SSLContext.wrap_bio`), and :class:`LoopTLSSocket` moves
their bytes through the :class:`LoopSocket`'s waits. The ``SSLContext`` is the one the
host's client builds for its own connections (its CA, client certificate, verification
mode and host-name check, and anything a subclass of its connection adds).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import redis
import redis.asyncio
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import UnixDomainSocketConnection
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from orders.errors import InvalidInput
from orders.index.errors import no_cluster_node
from orders.index.nodes import RedisClient
from orders.sql.greenlet import wait_for

T = TypeVar("T")

AsyncRedisClient = redis.asyncio.Redis | AsyncRedisCluster

#: The loop client's pools have no cap (redis-py 8 caps at 100 by default; see loop_client).
UNCAPPED = 2**31 - 1

#: What a connection of the ``redis.asyncio`` client carries over: where the server is,
#: who we are, how long to wait, how often to check an idle connection, which errors and
#: timeouts to retry, the protocol. Its TLS settings come as its ``SSLContext`` (see
#: :func:`host_tls_context`). What is its own stays its own: its pool, its parser, its
#: Retry (whose back-off awaits; the loop client's is :class:`~orders.aio.greenlets.LoopRetry`
#: with the service's policy), its encoder (responses must be bytes either way).
_CARRIED = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "credential_provider",
    "client_name",
    "lib_name",
    "lib_version",
    "driver_info",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "socket_keepalive_options",
    "socket_read_size",
    "health_check_interval",
    "retry_on_timeout",
    "retry_on_error",
    "protocol",
    "legacy_responses",
)


class LoopSocket:
    """A connected socket, non-blocking, whose waits are awaited on the event loop.

    The part of ``socket.socket`` that redis-py's connections and parsers use. A timeout
    of 0 (redis-py's "is anything there?") never waits: it raises ``BlockingIOError``
    like a non-blocking socket.
    """

    def __init__(self, sock: socket.socket, timeout: float | None) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._timeout = timeout

    def settimeout(self, timeout: float | None) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def fileno(self) -> int:
        return self._sock.fileno()

    def getsockname(self) -> Any:
        return self._sock.getsockname()

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def plain_socket(self) -> socket.socket:
        """The socket itself, for a :class:`LoopTLSSocket` to take over."""
        return self._sock

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if flags or self._timeout == 0:
            return self._sock.recv_into(buffer, nbytes, flags)
        loop = asyncio.get_running_loop()
        view = memoryview(buffer)[:nbytes] if nbytes else buffer
        return wait_for(self._bounded(loop.sock_recv_into(self._sock, view)))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if flags or self._timeout == 0:
            return self._sock.recv(bufsize, flags)
        loop = asyncio.get_running_loop()
        return wait_for(self._bounded(loop.sock_recv(self._sock, bufsize)))

    def sendall(self, data: bytes | memoryview) -> None:
        try:  # a command fits the socket's buffer almost always: no wait, no switch
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            loop = asyncio.get_running_loop()
            wait_for(self._bounded(loop.sock_sendall(self._sock, memoryview(data)[sent:])))

    async def _bounded(self, step: Awaitable[T]) -> T:
        if self._timeout is None:
            return await step
        async with asyncio.timeout(self._timeout):  # raises TimeoutError (socket.timeout)
            return await step


class LoopTLSSocket(LoopSocket):
    """A :class:`LoopSocket` speaking TLS: an ``ssl.SSLObject`` between two memory
    buffers, whose encrypted bytes go through the plain socket's awaited waits.

    :meth:`handshake` runs once, under the connect timeout; afterwards each read and
    write is the plain socket's, bounded by the socket timeout as before. A timeout of 0
    still never waits: with no decrypted byte at hand it raises ``BlockingIOError``.
    """

    def __init__(
        self,
        sock: socket.socket,
        timeout: float | None,
        tls: ssl.SSLObject,
        into: ssl.MemoryBIO,
        out: ssl.MemoryBIO,
    ) -> None:
        super().__init__(sock, timeout)
        self._tls, self._into, self._out = tls, into, out

    def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
                continue
            self._flush()
            return

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        if flags:
            raise ValueError("flags are not supported on a TLS socket")
        size = nbytes or len(buffer)
        while True:
            try:
                read: int = self._tls.read(size, buffer)  # type: ignore[assignment]
                return read
            except ssl.SSLWantReadError:
                self._flush()  # a post-handshake message (a TLS 1.3 ticket, a key update)
                self._fill()
            except ssl.SSLZeroReturnError:
                return 0

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        buffer = bytearray(bufsize)
        return bytes(buffer[: self.recv_into(buffer, bufsize, flags)])

    def sendall(self, data: bytes | memoryview) -> None:
        self._tls.write(data)  # into memory: all of it at once
        self._flush()

    def _flush(self) -> None:
        """Send what the TLS object wrote (the plain socket waits if its buffer is full)."""
        if self._out.pending:
            super().sendall(self._out.read())

    def _fill(self) -> None:
        """Feed the TLS object the next encrypted bytes (or the end of the stream)."""
        received = super().recv(65536)
        if received:
            self._into.write(received)
        else:
            self._into.write_eof()


async def _open(
    family: int, address: Any, connect_timeout: float | None, options: list[tuple[int, int, int]]
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        for level, option, value in options:
            sock.setsockopt(level, option, value)
        async with asyncio.timeout(connect_timeout):
            await asyncio.get_running_loop().sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


class LoopConnection(redis.Connection):
    """redis-py's TCP connection over a :class:`LoopSocket`."""

    def _connect(self) -> LoopSocket:
        options = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
        if self.socket_keepalive:
            options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
            keepalive = self.socket_keepalive_options.items()
            options += [(socket.IPPROTO_TCP, option, value) for option, value in keepalive]
        loop = asyncio.get_running_loop()
        found = wait_for(loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM))
        error: OSError = OSError("getaddrinfo returned no address")
        for family, _type, _proto, _name, address in found:
            try:
                sock = wait_for(_open(family, address, self.socket_connect_timeout, options))
            except OSError as exc:  # TimeoutError included: redis-py reports it as such
                error = exc
                continue
            return LoopSocket(sock, self.socket_timeout)
        raise error


class LoopTLSConnection(LoopConnection):
    """:class:`LoopConnection` over TLS, with the ``SSLContext`` of the host's client
    (:func:`loop_client` makes a subclass that sets :attr:`tls_context`)."""

    tls_context: ssl.SSLContext

    def _connect(self) -> LoopTLSSocket:
        plain = super()._connect()
        into, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.tls_context.wrap_bio(into, out, server_hostname=self.host)
        sock = LoopTLSSocket(plain.plain_socket(), self.socket_connect_timeout, tls, into, out)
        try:
            sock.handshake()
        except BaseException:
            sock.close()
            raise
        sock.settimeout(self.socket_timeout)
        return sock


class LoopUnixConnection(UnixDomainSocketConnection):
    """redis-py's unix-socket connection over a :class:`LoopSocket`."""

    def _connect(self) -> LoopSocket:
        sock = wait_for(_open(socket.AF_UNIX, self.path, self.socket_connect_timeout, []))
        return LoopSocket(sock, self.socket_timeout)


def _carried(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {name: kwargs[name] for name in _CARRIED if name in kwargs}


def check_async_client(client: object) -> AsyncRedisClient:
    """Refuse (InvalidInput) what :func:`loop_client` cannot copy."""
    if isinstance(client, AsyncRedisCluster):
        decode = client.encoder.decode_responses
    elif isinstance(client, redis.asyncio.Redis):
        decode = client.connection_pool.connection_kwargs.get("decode_responses", False)
    else:
        raise InvalidInput("redis_client", "must be a redis.asyncio Redis or RedisCluster")
    if decode:
        raise InvalidInput("redis_client", "must not decode responses (ids are read as bytes)")
    return client


def host_tls_context(client: AsyncRedisClient) -> ssl.SSLContext | None:
    """The ``SSLContext`` the host's client gives its own connections (None: no TLS).

    One connection object of the host's own class is made (not connected) and asked for
    its context, so the loop client verifies, presents and checks exactly as the host's
    connections do. A context that cannot be built (a CA file gone since) is
    InvalidInput, naming no file and no password.
    """
    connection: Any  # redis-py's asyncio SSLConnection (its node's is untyped)
    if isinstance(client, AsyncRedisCluster):
        kwargs = client.connection_kwargs
        if not issubclass(kwargs["connection_class"], redis.asyncio.SSLConnection):
            return None
        # A node of the host's own kind (not one of its nodes: their pools are theirs).
        startup = next(iter(client.nodes_manager.startup_nodes.values()))
        node = AsyncClusterNode(startup.host, startup.port, **kwargs)
        connection = node.acquire_connection()
    else:
        if not issubclass(client.connection_pool.connection_class, redis.asyncio.SSLConnection):
            return None
        connection = client.connection_pool.make_connection()  # type: ignore[no-untyped-call]
    try:
        context: ssl.SSLContext = connection.ssl_context.get()
    except (ssl.SSLError, OSError):
        raise InvalidInput(
            "redis_client", "its TLS settings do not load (CA, cert or key)"
        ) from None
    return context


def tls_connection(context: ssl.SSLContext) -> type[LoopTLSConnection]:
    """A :class:`LoopTLSConnection` class whose connections use ``context`` (redis-py's
    pools and cluster nodes build connections from a class and keyword arguments)."""
    return type("HostTLSConnection", (LoopTLSConnection,), {"tls_context": context})


def loop_client(client: AsyncRedisClient, retry: Retry) -> RedisClient:
    """A synchronous client on the server or cluster ``client`` names, for code run by
    :func:`orders.aio.greenlets.run` (call it there: a cluster client connects at once)."""
    check_async_client(client)
    context = host_tls_context(client)
    tcp = LoopConnection if context is None else tls_connection(context)
    if isinstance(client, AsyncRedisCluster):
        nodes = [
            ClusterNode(node.host, node.port)  # type: ignore[no-untyped-call]
            for node in client.nodes_manager.startup_nodes.values()
        ]
        try:
            return RedisCluster(
                # Given a URL (no credentials in it), each node's pool takes connection_class.
                url=f"redis://{nodes[0].host}:{nodes[0].port}",
                startup_nodes=nodes,
                connection_class=tcp,
                max_connections=UNCAPPED,  # per node; see below
                retry=retry,
                **_carried(client.connection_kwargs),
            )
        except (redis.RedisError, RedisClusterException) as exc:
            raise no_cluster_node(f"{nodes[0].host}:{nodes[0].port}", exc) from None
    pool = client.connection_pool
    unix = issubclass(pool.connection_class, redis.asyncio.UnixDomainSocketConnection)
    # No cap: redis-py's capped pool fails a call past it (MaxConnectionsError), and its
    # blocking pool would wait in the loop's own thread. Connections are held for one round
    # trip each, so there are as many as Redis calls in flight at once.
    loop_pool = redis.ConnectionPool(
        connection_class=LoopUnixConnection if unix else tcp,
        max_connections=UNCAPPED,
        retry=retry,
        **_carried(pool.connection_kwargs),
    )
    return redis.Redis(connection_pool=loop_pool)


def disconnect(client: RedisClient) -> None:
    """Close every connection of a client :func:`loop_client` built (run it in
    :func:`orders.aio.greenlets.run`). redis-py's ``close()`` leaves a pool it was handed
    connected, and these pools are ours alone."""
    if isinstance(client, RedisCluster):
        for node in client.get_nodes():  # type: ignore[no-untyped-call]
            if node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
    else:
        client.connection_pool.disconnect()
