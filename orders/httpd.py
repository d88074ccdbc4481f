"""The operator endpoints' HTTP server: a threaded stdlib server on loopback unless told.

The dashboard and the scheduler's health checks are read by a few operators and probes, not
by customers, so the standard library's ``ThreadingHTTPServer`` is enough and adds no
dependency; one thread per connection lets a long-lived event stream sit beside short
requests. The threads are bounded (:data:`MAX_CONNECTIONS` by default): a connection past
the bound gets a 503 at once and is closed, so a flood of clients (or of open streams)
cannot start threads without end. :func:`serve` binds at once, so a taken port or a bad
address is a typed error before the process goes on, and returns a :class:`Served` that
stops the server and joins its thread.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from orders.errors import InvalidInput

#: Connections served at once (each holds a thread); one more is answered 503 and closed.
MAX_CONNECTIONS = 64
#: How long a connection may sit without sending its request (or reading an answer).
CONNECTION_TIMEOUT_S = 60.0
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
    b"Retry-After: 1\r\nContent-Length: 5\r\nConnection: close\r\n\r\nbusy\n"
)

#: Host names taken as loopback without asking a resolver.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only listens on this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything, so it is not taken as loopback


def check_port(field: str, port: object) -> int:
    """``port`` as a TCP port number (0: any free one), or :class:`InvalidInput`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidInput(field, f"must be a TCP port, 0 to 65535 (got {port!r})")
    return port


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler whose access lines go to the ``orders.httpd`` logger at DEBUG,
    not to stderr (the stdlib default), so a probe every second does not flood the log."""

    #: A client that sends nothing (or reads nothing) for this long loses its connection.
    timeout = CONNECTION_TIMEOUT_S

    def log_message(self, format: str, *args: Any) -> None:
        logging.getLogger("orders.httpd").debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # an open event stream must not keep the process alive
    block_on_close = False

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the connection if one of the bounded slots is free, else a 503."""
        if not self.slots.acquire(blocking=False):
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass  # the client is gone or not reading: closing is all that is left
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()  # no thread started: the slot is free again
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


@dataclass
class Served:
    """A running server: where it listens, and how to stop it."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    host: str
    port: int
    #: Called first on close: ends what the handlers keep open (event streams).
    on_close: Callable[[], None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop accepting, close the socket and wait for the serving thread."""
        if self.on_close is not None:
            self.on_close()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


def serve(
    handler: type[BaseHTTPRequestHandler],
    host: str,
    port: int,
    *,
    name: str,
    field: str,
    on_close: Callable[[], None] | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> Served:
    """Bind ``host:port`` now and serve ``handler`` from a daemon thread named ``name``,
    at most ``max_connections`` connections at once.

    ``field`` names the setting in errors: a port that is taken or an address that cannot
    be bound is :class:`InvalidInput` on it, raised here rather than in the thread.
    """
    check_port(field, port)
    server_class = _Server6 if ":" in host else _Server
    try:
        server = server_class((host.strip("[]"), port), handler, max_connections)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidInput(field, f"cannot listen on {host}:{port}: {reason}") from None
    # A short poll: close() (shutdown) waits up to one interval for the loop to notice.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name=name, daemon=True
    )
    thread.start()
    return Served(server, thread, host, int(server.server_address[1]), on_close)


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Answer with ``body`` as JSON, never cached."""
    send_bytes(handler, status, json.dumps(body).encode(), "application/json")


def send_bytes(
    handler: BaseHTTPRequestHandler,
    status: int,
    data: bytes,
    content_type: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer with ``data``; operator pages are never cached nor framed by other sites."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.send_header("Cache-Control", "no-store")
    handler.send_header("X-Content-Type-Options", "nosniff")
    handler.send_header("X-Frame-Options", "DENY")
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(data)
