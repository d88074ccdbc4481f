"""The dashboard's HTTP side: the page, its two assets, a JSON API and a live event stream.

Routes (all ``GET`` but the login form's ``POST``):

* ``/`` the page; ``/static/dashboard.js`` and ``/static/dashboard.css`` its only assets,
  read from the package: nothing comes from the internet and nothing is built.
* ``/api/overview`` the figures as JSON; ``/api/events`` the same figures as server-sent
  events, one every ``refresh_s``; ``/api/user?user_id=...`` one user's slots, SQL beside
  the index.
* ``/login`` the token form (only with a token set); it sets the session cookie.

The overview is read at most once per ``refresh_s`` however many browsers are watching:
the streams share one cached reading, so ten open tabs cost the stores what one does.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qs, urlsplit

from orders.dashboard.access import Access, check_bind
from orders.dashboard.snapshot import compare_user, read_overview
from orders.errors import InvalidInput, StoreUnavailable
from orders.httpd import QuietHandler, Served, send_bytes, send_json, serve
from orders.service import OrderService
from orders.validation import check_seconds

ASSETS = {
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
}
#: A login form posts a token, nothing bigger.
MAX_FORM_BYTES = 4096
#: The page loads only its own assets and talks only to its own origin.
PAGE_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
#: The login form carries its few styles inline, so it loads before any sign-in.
LOGIN_POLICY = PAGE_POLICY.replace("style-src 'self'", "style-src 'unsafe-inline'")
DEFAULT_REFRESH_S = 2.0


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

    def serve(self, host: str, port: int) -> Served:
        """Listen on ``host:port`` (refused off loopback without a token) from a thread."""
        check_bind(host, self.access.token)
        handler = _handler(self)
        name = "orders-dashboard"
        return serve(handler, host, port, name=name, field="port", on_close=self.closing.set)


class DashboardHandler(QuietHandler):
    """One request to a dashboard; :func:`_handler` binds the class to its dashboard."""

    protocol_version = "HTTP/1.1"
    dashboard: Dashboard

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/login":
            self._login_form(error=False)
        elif url.path == "/favicon.ico":
            send_bytes(self, 204, b"", "image/x-icon")  # browsers ask, even before a login
        elif not self.dashboard.access.allows(
            self.headers.get("Authorization"), self.headers.get("Cookie")
        ):
            self._refuse(url.path)
        elif url.path in ("/", "/index.html"):
            headers = {"Content-Security-Policy": PAGE_POLICY}
            send_bytes(self, 200, _asset("index.html"), "text/html; charset=utf-8", headers)
        elif url.path in ASSETS:
            name, content_type = ASSETS[url.path]
            send_bytes(self, 200, _asset(name), content_type)
        elif url.path == "/api/overview":
            send_bytes(self, 200, self.dashboard.overview.json(), "application/json")
        elif url.path == "/api/events":
            self._stream()
        elif url.path == "/api/user":
            self._user(parse_qs(url.query).get("user_id", [""])[0])
        else:
            send_json(self, 404, {"error": "not found"})

    def do_POST(self) -> None:
        access = self.dashboard.access
        if urlsplit(self.path).path != "/login" or access.open:
            send_json(self, 404, {"error": "not found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 <= length <= MAX_FORM_BYTES:
            send_json(self, 413, {"error": "form too large"})
            return
        form = parse_qs(self.rfile.read(length).decode("utf-8", "replace"))
        if access.is_token(form.get("token", [""])[0]):
            cookie = access.set_cookie(secure=self.dashboard.secure_cookie)
            headers = {"Location": "/", "Set-Cookie": cookie}
            send_bytes(self, 303, b"", "text/plain", headers)
        else:
            self._login_form(error=True)

    def _refuse(self, path: str) -> None:
        """401 for scripts and the API; a browser asking for a page goes to the form."""
        if path.startswith("/api/") or "text/html" not in self.headers.get("Accept", ""):
            headers = {"WWW-Authenticate": 'Bearer realm="orders dashboard"'}
            body = json.dumps({"error": "a valid token is required"}).encode()
            send_bytes(self, 401, body, "application/json", headers)
        else:
            send_bytes(self, 303, b"", "text/plain", {"Location": "/login"})

    def _login_form(self, *, error: bool) -> None:
        if self.dashboard.access.open:
            send_bytes(self, 303, b"", "text/plain", {"Location": "/"})
            return
        page = _asset("login.html")
        if error:
            page = page.replace(b"<!--error-->", b'<p class="error">Wrong token.</p>')
        headers = {"Content-Security-Policy": LOGIN_POLICY}
        send_bytes(self, 401 if error else 200, page, "text/html; charset=utf-8", headers)

    def _user(self, user_id: str) -> None:
        try:
            send_json(self, 200, compare_user(self.dashboard.service, user_id))
        except InvalidInput as exc:
            send_json(self, 400, {"error": str(exc)})
        except StoreUnavailable as exc:
            send_json(self, 503, {"error": str(exc)})

    def _stream(self) -> None:
        """Server-sent events: the overview now, then every ``refresh_s`` until closed."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Accel-Buffering", "no")  # a proxy must pass events at once
        self.end_headers()
        self.close_connection = True
        if self.command == "HEAD":
            return  # the headers only: a HEAD has no body, least of all an endless one
        closing = self.dashboard.closing
        try:
            while not closing.is_set():
                data = self.dashboard.overview.json()
                self.wfile.write(b"event: overview\ndata: " + data + b"\n\n")
                self.wfile.flush()
                closing.wait(self.dashboard.refresh_s)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return  # the browser went away, or stopped reading


def _handler(dashboard: Dashboard) -> type[DashboardHandler]:
    return type("BoundDashboardHandler", (DashboardHandler,), {"dashboard": dashboard})
