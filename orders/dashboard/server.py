"""The dashboard's HTTP side: the page, its two assets, a JSON API and a live event stream.

Routes (all ``GET`` or ``HEAD`` but the login form's ``POST``), below wherever the
dashboard is mounted (``/`` on its own port, ``/ops/orders/`` inside a host app):

* ``/`` the page; ``/static/dashboard.js`` and ``/static/dashboard.css`` its only assets,
  read from the package: nothing comes from the internet and nothing is built.
* ``/api/overview`` the figures as JSON; ``/api/events`` the same figures as server-sent
  events, one every ``refresh_s``; ``/api/user?user_id=...`` one user's slots, SQL beside
  the index.
* ``/login`` the token form (only with a token set); it sets the session cookie.

The page and the form name these by relative URLs, and the redirects and the cookie's path
carry the mount point, so the same files work at any prefix. :meth:`Dashboard.route` is a
plain function from a :class:`Request` to a :class:`Response` (it blocks: it reads the
stores); :mod:`orders.dashboard.asgi` carries it, beside the probes and the metrics.

The overview is read at most once per ``refresh_s`` however many browsers are watching:
the streams share one cached reading, so ten open tabs cost the stores what one does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs

from orders.dashboard.access import Access
from orders.dashboard.snapshot import compare_user, read_overview
from orders.errors import InvalidInput, StoreUnavailable
from orders.service import OrderService
from orders.validation import check_seconds

ASSETS = {
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
#: The page loads only its own assets and talks only to its own origin.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
#: The login form carries its few styles inline, so it loads before any sign-in.
LOGIN_POLICY = PAGE_POLICY.replace("style-src 'self'", "style-src 'unsafe-inline'")
DEFAULT_REFRESH_S = 2.0
HTML = "text/html; charset=utf-8"


@dataclass(frozen=True)
class Request:
    """One request, as the routes see it."""

    method: str
    #: Below the mount point: ``/api/overview``; ``""`` when the mount point itself was asked.
    path: str
    query: str = ""
    #: By lower-case name.
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
    ``closing`` is set or the client goes away. ``next_event`` blocks (it reads the stores)."""

    next_event: Callable[[], bytes]
    interval_s: float
    closing: threading.Event
    #: The streams open now, of the dashboard that made this one.
    open: OpenCount


@dataclass(frozen=True)
class Response:
    """What a route answers: a body, or an event stream (then ``body`` is unused)."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)
    stream: EventStream | None = None


def json_response(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    """``body`` as JSON."""
    return Response(status, json.dumps(body).encode(), "application/json", headers or {})


def _asset(name: str) -> bytes:
    return files("orders.dashboard").joinpath("static", name).read_bytes()


class Overview:
    """The latest overview, read again once it is ``max_age_s`` old (thread-safe)."""

    def __init__(
        self,
        read: Callable[[], dict[str, Any]],
        max_age_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._max_age_s = max_age_s
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._value: bytes | None = None
        self._read_at = 0.0

    def json(self) -> bytes:
        with self._lock:
            now = self._monotonic()
            if self._value is None or now - self._read_at >= self._max_age_s:
                self._value = json.dumps(self._read()).encode()
                self._read_at = now
            return self._value


class Dashboard:
    """One dashboard over one service: its access rule, cached overview and open streams."""

    def __init__(
        self,
        service: OrderService,
        *,
        token: str | None,
        refresh_s: float = DEFAULT_REFRESH_S,
        secure_cookie: bool = False,
    ) -> None:
        self.service = service
        self.access = Access(token)
        #: Mark the login cookie ``Secure`` (served behind TLS: the browser then never sends
        #: it over plain HTTP).
        self.secure_cookie = secure_cookie
        self.refresh_s = check_seconds("refresh_s", refresh_s)
        # Half the refresh: a stream that wakes a little late still gets a fresh reading.
        self.overview = Overview(lambda: read_overview(service), refresh_s / 2)
        #: Set on close: every open event stream ends at its next wake-up.
        self.closing = threading.Event()
        #: The event streams open now.
        self.streams = OpenCount()

    def route(self, request: Request) -> Response | None:
        """The dashboard's answer to ``request``; None for a path that is not its own."""
        path = request.path
        if request.method == "POST":
            return self._login(request) if path == "/login" and not self.access.open else None
        if request.method not in ("GET", "HEAD"):
            return None
        if path == "":  # the mount point without its slash: the page's relative URLs need it
            return _redirect(request.root + "/")
        if path == "/login":
            return self._login_form(request.root, error=False)
        if path == "/favicon.ico":
            return Response(204, b"", "image/x-icon")  # browsers ask, even before a login
        if path not in PATHS:
            return None
        if not self.access.allows(request.header("Authorization"), request.header("Cookie")):
            return _refuse(request)
        return self._guarded(request)

    def _guarded(self, request: Request) -> Response:
        """One of :data:`PATHS`, for a request the access rule let in."""
        path = request.path
        if path in ("/", "/index.html"):
            page_headers = {"Content-Security-Policy": PAGE_POLICY}
            return Response(200, _asset("index.html"), HTML, page_headers)
        if path in ASSETS:
            name, content_type = ASSETS[path]
            return Response(200, _asset(name), content_type)
        if path == "/api/overview":
            return Response(200, self.overview.json())
        if path == "/api/events":
            return Response(200, stream=self._stream())
        return self._user(request.param("user_id"))

    def _login(self, request: Request) -> Response:
        form = parse_qs(request.body.decode("utf-8", "replace"))
        if not self.access.is_token(form.get("token", [""])[0]):
            return self._login_form(request.root, error=True)
        cookie = self.access.set_cookie(secure=self.secure_cookie, path=request.root + "/")
        return _redirect(request.root + "/", {"Set-Cookie": cookie})

    def _login_form(self, root: str, *, error: bool) -> Response:
        if self.access.open:
            return _redirect(root + "/")
        page = _asset("login.html")
        if error:
            page = page.replace(b"<!--error-->", b'<p class="error">Wrong token.</p>')
        headers = {"Content-Security-Policy": LOGIN_POLICY}
        return Response(401 if error else 200, page, HTML, headers)

    def _user(self, user_id: str) -> Response:
        try:
            return json_response(200, compare_user(self.service, user_id))
        except InvalidInput as exc:
            return json_response(400, {"error": str(exc)})
        except StoreUnavailable as exc:
            return json_response(503, {"error": str(exc)})

    def _stream(self) -> EventStream:
        """Server-sent events: the overview now, then every ``refresh_s`` until closed."""

        def next_event() -> bytes:
            return b"event: overview\ndata: " + self.overview.json() + b"\n\n"

        return EventStream(next_event, self.refresh_s, self.closing, self.streams)


#: Every path the dashboard serves behind its access rule.
PATHS = frozenset({"/", "/index.html", *ASSETS, "/api/overview", "/api/events", "/api/user"})


def _redirect(location: str, headers: dict[str, str] | None = None) -> Response:
    return Response(303, b"", "text/plain", {"Location": location, **(headers or {})})


def _refuse(request: Request) -> Response:
    """401 for scripts and the API; a browser asking for a page goes to the form."""
    accept = request.header("Accept") or ""
    if request.path.startswith("/api/") or "text/html" not in accept:
        headers = {"WWW-Authenticate": 'Bearer realm="orders dashboard"'}
        return json_response(401, {"error": "a valid token is required"}, headers)
    return _redirect(request.root + "/login")
