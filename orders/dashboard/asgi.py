"""The operator pages as one ASGI app: the dashboard, ``/healthz``, ``/readyz`` and
``/metrics``, mounted by a FastAPI or Starlette host under a path, or served on a port
of its own (:mod:`orders.dashboard.serving`).

The app is written against the ASGI spec (HTTP and lifespan scopes), so a host needs
nothing but anyio, which orders has already. Every route runs in a worker thread
(``anyio.to_thread``), since its reads of SQL and Redis block; the event loop only moves
bytes. The threads are bounded by a limiter of the app's own, so a burst of slow reads
never takes the threads the host's own sync routes run on. An event stream reads the
overview in a thread too, sleeps on the loop between events, and ends when the client
disconnects (the ``http.disconnect`` message, watched beside it) or when
:meth:`OperatorApp.close` is called.

The app works at any mount point: the path the host routed it under comes in the scope's
``root_path``, and the page names everything else by relative URLs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread

from orders.bootstrap import build_service
from orders.config import Settings
from orders.dashboard.access import check_token
from orders.dashboard.server import (
    DEFAULT_REFRESH_S,
    Dashboard,
    EventStream,
    Request,
    Response,
    json_response,
)
from orders.errors import InvalidInput
from orders.metrics import exposition
from orders.probes import StoreHealth
from orders.service import OrderService
from orders.validation import check_count, check_seconds

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Who guards the pages: the dashboard's token login, or the host's own auth in front.
Auth = Literal["token", "host"]
#: Worker threads the pages may use at once (their own, never the host's): reads of the
#: overview are shared between requests, so a few serve many operators.
DEFAULT_THREADS = 4
#: The largest request body read (a login form posts a token, nothing bigger): more is a 413.
MAX_BODY_BYTES = 4096
NOT_FOUND = json_response(404, {"error": "not found"})
TOO_LARGE = json_response(413, {"error": "request body too large"})


class Probes(Protocol):
    """What ``/healthz`` and ``/readyz`` answer: a status and a JSON body each."""

    def healthz(self) -> tuple[int, dict[str, Any]]: ...

    def readyz(self) -> tuple[int, dict[str, Any]]: ...


class OperatorApp:
    """An ASGI app of the probes, the metrics and the dashboard (see :func:`asgi_app`)."""

    def __init__(
        self,
        probes: Probes,
        dashboard: Dashboard | None = None,
        *,
        owned: OrderService | None = None,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        """``dashboard`` None: its paths are 404 until one is set (a scheduler sets it once
        its service is built); ``owned``: a service the app closes with itself."""
        self.probes = probes
        self.dashboard = dashboard
        self.threads = check_count("threads", threads, 1, 64)
        #: The pages' own bound on worker threads, made on the first request (on the
        #: server's event loop): a burst of slow reads waits here, and the host's own
        #: thread pool (anyio's default limiter, which FastAPI's sync routes use) stays free.
        self.limiter: anyio.CapacityLimiter | None = None
        self._owned = owned
        self._closed = False

    def answer(self, request: Request) -> Response:
        """The answer to ``request``; it blocks (the probes and the dashboard read the
        stores). The probes and the metrics need no token: they hold no order data."""
        if request.method in ("GET", "HEAD"):
            if request.path == "/healthz":
                return json_response(*self.probes.healthz())
            if request.path == "/readyz":
                return json_response(*self.probes.readyz())
            if request.path == "/metrics":
                body, content_type = exposition()
                return Response(200, body, content_type)
        found = None if self.dashboard is None else self.dashboard.route(request)
        return NOT_FOUND if found is None else found

    def close(self) -> None:
        """End every open event stream (at its next wake-up, within ``refresh_s``) and
        close the service the app owns, if any. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.dashboard is not None:
            self.dashboard.closing.set()
        if self._owned is not None:
            self._owned.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        else:  # a websocket: nothing here speaks it
            await send({"type": "websocket.close", "code": 1000})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Run on its own (``uvicorn orders_ops:app``), the app follows the server's life;
        mounted, the host's lifespan is the host's, and it calls :meth:`close`."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            return  # the client left before its request was in
        limiter = self._limiter()
        if isinstance(body, Response):
            await _send(scope, body, receive, send, limiter)
            return
        request = _request(scope, body)
        response = await anyio.to_thread.run_sync(self.answer, request, limiter=limiter)
        await _send(scope, response, receive, send, limiter)

    def _limiter(self) -> anyio.CapacityLimiter:
        if self.limiter is None:
            self.limiter = anyio.CapacityLimiter(self.threads)
        return self.limiter


def _request(scope: Scope, body: bytes) -> Request:
    """The scope as a :class:`Request`, its path below the mount point (the host leaves the
    full path in ``path`` and the mount point in ``root_path``, as the ASGI spec and
    Starlette's ``Mount`` do). A header sent twice is joined as HTTP allows (``Cookie``
    with ``; ``, which HTTP/2 splits into several, the others with ``, ``)."""
    root = (scope.get("root_path") or "").rstrip("/")
    path = scope["path"]
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root) :]
    headers: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers", []):
        name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
        if name in headers:
            value = headers[name] + ("; " if name == "cookie" else ", ") + value
        headers[name] = value
    query = scope.get("query_string", b"").decode("latin-1")
    return Request(scope["method"], path, query, headers, body, root)


async def _read_body(receive: Receive) -> bytes | Response | None:
    """The body (at most ``MAX_BODY_BYTES``: more is refused), or None if the client left."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > MAX_BODY_BYTES:
            return TOO_LARGE
        if not message.get("more_body", False):
            return bytes(body)


def _headers(response: Response) -> list[tuple[bytes, bytes]]:
    """Every header to send: operator pages are never cached nor framed by other sites,
    and a proxy must pass a stream's events on at once."""
    if response.stream is not None:
        sized = [("content-type", "text/event-stream"), ("x-accel-buffering", "no")]
    else:
        sized = [
            ("content-type", response.content_type),
            ("content-length", str(len(response.body))),
        ]
    pairs = [
        *sized,
        ("cache-control", "no-store"),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        *response.headers.items(),
    ]
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in pairs]


async def _send(
    scope: Scope, response: Response, receive: Receive, send: Send, limiter: anyio.CapacityLimiter
) -> None:
    headers = _headers(response)
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    if scope["method"] == "HEAD":
        await send({"type": "http.response.body", "body": b""})
    elif response.stream is None:
        await send({"type": "http.response.body", "body": response.body})
    elif not await _stream(response.stream, receive, send, limiter):
        await send({"type": "http.response.body", "body": b""})  # the end of the stream


async def _stream(
    stream: EventStream, receive: Receive, send: Send, limiter: anyio.CapacityLimiter
) -> bool:
    """Send events until the stream closes or the client goes; True if the client went."""
    gone = False
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        with stream.open.held():
            while not stream.closing.is_set():
                event = await anyio.to_thread.run_sync(stream.next_event, limiter=limiter)
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await anyio.sleep(stream.interval_s)
        group.cancel_scope.cancel()
    return gone


def asgi_app(
    source: OrderService | Settings,
    *,
    token: str | None = None,
    auth: Auth = "token",
    refresh_s: float = DEFAULT_REFRESH_S,
    secure_cookie: bool = False,
    threads: int = DEFAULT_THREADS,
) -> OperatorApp:
    """The dashboard, the store probes and the metrics as an ASGI app, to mount under any
    path::

        ops = asgi_app(service, token=os.environ["ORDERS_DASHBOARD_TOKEN"])
        app.mount("/ops/orders", ops)   # FastAPI or Starlette; call ops.close() at shutdown

    ``source``: the service to show, or settings to build one from (the app then owns it,
    and :meth:`OperatorApp.close` closes it).

    Who may look is a choice to make, never a default: ``auth="token"`` (the default) needs
    ``token`` (16 characters at least) and guards the pages with the dashboard's login
    form and bearer check; ``auth="host"`` takes no token and serves the pages to every
    request that reaches them, for a host whose own auth stands in front of the mount.
    ``/healthz``, ``/readyz`` and ``/metrics`` answer without a token either way (they
    hold no order data). ``secure_cookie``: mark the login cookie ``Secure`` (the host is
    reached over HTTPS). ``threads``: the worker threads the pages use at once, 1 to 64,
    their own (never the host's thread pool). Anything else is
    :class:`~orders.errors.InvalidInput`, raised here.
    """
    if auth == "host":
        if token is not None:
            raise InvalidInput("token", 'auth="host" takes no token: the host guards the pages')
    elif auth == "token":
        if token is None:
            raise InvalidInput(
                "token",
                'required with auth="token"; pass auth="host" if the host\'s own auth '
                "stands in front of the pages",
            )
        check_token(token)
    else:
        raise InvalidInput("auth", f'must be "token" or "host" (got {auth!r})')
    check_seconds("refresh_s", refresh_s)
    check_count("threads", threads, 1, 64)
    service = build_service(source) if isinstance(source, Settings) else source
    owned = service if isinstance(source, Settings) else None
    try:
        dashboard = Dashboard(
            service, token=token, refresh_s=refresh_s, secure_cookie=secure_cookie
        )
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    return OperatorApp(StoreHealth(service), dashboard, owned=owned, threads=threads)
