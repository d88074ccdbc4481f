"""The operator endpoints' HTTP server: a threaded stdlib server on loopback unless told.

The dashboard and the scheduler's health checks are read by a few operators and probes, not
by customers, so the standard library's ``ThreadingHTTPServer`` is enough and adds no
dependency; one thread per connection lets a long-lived event stream sit beside short
requests. The threads are bounded (:data:`MAX_CONNECTIONS` by default): a connection past
the bound gets a 503 at once and is closed, so a flood of clients (or of open streams)
cannot start threads without end. :func:`serve` binds at once, so a taken port or a bad
address is a typed error before the process goes on, and returns a :class:`Served` that
stops the server and joins its thread.

What a route answers does not depend on the server that carries it: a route is a function
from a :class:`Request` to a :class:`Response` (or None, not one of its paths), so the same
pages run here and under an ASGI host (``orders.dashboard.asgi``). :func:`serve` serves
such a function too; :func:`first_of` puts several behind one port.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from orders.errors import InvalidInput
from orders.metrics import exposition

#: Connections served at once (each holds a thread); one more is answered 503 and closed.
MAX_CONNECTIONS = 64
#: How long a connection may sit without sending its request (or reading an answer).
CONNECTION_TIMEOUT_S = 60.0
#: The largest request body read (a login form posts a token, nothing bigger): more is a 413.
MAX_BODY_BYTES = 4096
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


def header_map(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Request headers by lower-case name; a name sent twice is joined as HTTP allows
    (``Cookie`` with ``; ``, which HTTP/2 splits into several, the others with ``, ``)."""
    found: dict[str, str] = {}
    for name, value in pairs:
        key = name.lower()
        if key in found:
            found[key] += ("; " if key == "cookie" else ", ") + value
        else:
            found[key] = value
    return found


@dataclass(frozen=True)
class Request:
    """One request, whichever server carried it."""

    method: str
    #: Below the mount point: ``/api/overview``; ``""`` when the mount point itself was asked.
    path: str
    query: str = ""
    #: By lower-case name (:func:`header_map`).
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: Where the app is mounted (``/ops/orders``); ``""`` when it has the server to itself.
    root: str = ""

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def param(self, name: str) -> str:
        """The first value of query parameter ``name`` ("" when absent)."""
        return parse_qs(self.query).get(name, [""])[0]


class OpenCount:
    """How many of something are open now (event streams), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    @property
    def value(self) -> int:
        return self._value

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._value += 1
        try:
            yield
        finally:
            with self._lock:
                self._value -= 1


@dataclass(frozen=True)
class EventStream:
    """A server-sent event stream: ``next_event()`` now and every ``interval_s`` after, until
    ``closing`` is set or the client goes away. ``next_event`` may block (it reads the
    stores); each server calls it where blocking is allowed."""

    next_event: Callable[[], bytes]
    interval_s: float
    closing: threading.Event
    #: The streams open now, of the app that made this one.
    open: OpenCount


@dataclass(frozen=True)
class Response:
    """What a route answers: a body, or an event stream (then ``body`` is unused)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: EventStream | None = None

    def header_items(self) -> list[tuple[str, str]]:
        """Every header to send: operator pages are never cached nor framed by other sites,
        and a proxy must pass a stream's events on at once."""
        if self.stream is not None:
            sized = [("Content-Type", "text/event-stream"), ("X-Accel-Buffering", "no")]
        else:
            sized = [
                ("Content-Type", self.content_type),
                ("Content-Length", str(len(self.body))),
            ]
        return [
            *sized,
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
            ("X-Frame-Options", "DENY"),
            *self.headers.items(),
        ]


def json_response(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    """``body`` as JSON."""
    return Response(status, json.dumps(body).encode(), "application/json", headers or {})


#: A route: its answer to a request, or None when the path is not one of its own.
Route = Callable[[Request], "Response | None"]
#: An app: a route that answers everything.
App = Callable[[Request], Response]

NOT_FOUND = json_response(404, {"error": "not found"})
TOO_LARGE = json_response(413, {"error": "request body too large"})
BAD_LENGTH = json_response(400, {"error": "bad Content-Length"})


def first_of(*routes: Route) -> App:
    """The app that answers with the first route to take the path, else 404."""

    def app(request: Request) -> Response:
        for route in routes:
            answer = route(request)
            if answer is not None:
                return answer
        return NOT_FOUND

    return app


def metrics_route(request: Request) -> Response | None:
    """``/metrics``: Prometheus' exposition of :func:`orders.metrics.registry` (GET or HEAD)."""
    if request.path != "/metrics" or request.method not in ("GET", "HEAD"):
        return None
    body, content_type = exposition()
    return Response(200, body, content_type)


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
    handler: type[BaseHTTPRequestHandler] | App,
    host: str,
    port: int,
    *,
    name: str,
    field: str,
    on_close: Callable[[], None] | None = None,
    max_connections: int = MAX_CONNECTIONS,
) -> Served:
    """Bind ``host:port`` now and serve ``handler`` from a daemon thread named ``name``,
    at most ``max_connections`` connections at once. ``handler``: a request handler class,
    or an app (a :class:`Request` to :class:`Response` function, served by
    :class:`AppHandler`).

    ``field`` names the setting in errors: a port that is taken or an address that cannot
    be bound is :class:`InvalidInput` on it, raised here rather than in the thread.
    """
    check_port(field, port)
    if not isinstance(handler, type):
        handler = type("BoundAppHandler", (AppHandler,), {"app": staticmethod(handler)})
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
    send_response(handler, json_response(status, body))


def send_bytes(
    handler: BaseHTTPRequestHandler,
    status: int,
    data: bytes,
    content_type: str,
    headers: dict[str, str] | None = None,
) -> None:
    """Answer with ``data`` (see :meth:`Response.header_items`)."""
    send_response(handler, Response(status, data, content_type, headers or {}))


def send_response(handler: BaseHTTPRequestHandler, response: Response) -> None:
    """Write ``response`` on ``handler``'s connection; a stream runs until it ends."""
    handler.send_response(response.status)
    for key, value in response.header_items():
        handler.send_header(key, value)
    handler.end_headers()
    if handler.command == "HEAD":
        if response.stream is not None:
            handler.close_connection = (
                True  # the headers only: no body, least of all an endless one
            )
        return
    if response.stream is None:
        handler.wfile.write(response.body)
        return
    handler.close_connection = True  # a stream ends by closing its connection
    stream = response.stream
    try:
        with stream.open.held():
            while not stream.closing.is_set():
                handler.wfile.write(stream.next_event())
                handler.wfile.flush()
                stream.closing.wait(stream.interval_s)
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        return  # the client went away, or stopped reading


class AppHandler(QuietHandler):
    """Serves :attr:`app` on a connection; :func:`serve` binds the class to its app."""

    protocol_version = "HTTP/1.1"
    app: ClassVar[App]

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        body = self.read_body()
        if isinstance(body, Response):
            self.close_connection = True  # what was not read must not be taken as a request
            send_response(self, body)
            return
        headers = header_map(self.headers.items())
        request = Request(self.command, url.path, url.query, headers, body)
        send_response(self, type(self).app(request))

    do_HEAD = do_POST = do_GET

    def read_body(self) -> bytes | Response:
        """The request's body, or the answer refusing it (too large, a bad length)."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return BAD_LENGTH
        if length < 0:
            return BAD_LENGTH
        if length > MAX_BODY_BYTES:
            return TOO_LARGE
        return self.rfile.read(length) if length else b""
