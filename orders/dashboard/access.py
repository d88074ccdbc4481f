"""Who may read the dashboard: loopback by default, everyone else with the token.

With ``ORDERS_DASHBOARD_TOKEN`` set, every request but the login form's must carry it,
either as ``Authorization: Bearer <token>`` (scripts, curl) or as the session cookie the
login form sets (browsers: an ``EventSource`` cannot send headers). The cookie holds an
HMAC of the token, not the token itself, so a cookie leaked from a browser profile does not
give the token away, and changing the token logs every browser out. Comparisons are
constant-time.

Without a token the dashboard only listens on loopback: :func:`check_bind` refuses any
other address before a socket is opened.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from http.cookies import CookieError, SimpleCookie

from orders.errors import InvalidInput

TOKEN_ENV = "ORDERS_DASHBOARD_TOKEN"  # noqa: S105 - the variable's name, not a secret
#: A token shorter than this is refused: it guards order data on the network.
TOKEN_MIN_LENGTH = 16
COOKIE_NAME = "orders_dashboard"
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


def check_token(token: str | None) -> None:
    """Refuse a token too short to guard the pages (None: no token, nothing to check)."""
    if token is not None and len(token) < TOKEN_MIN_LENGTH:
        raise InvalidInput(TOKEN_ENV, f"must be at least {TOKEN_MIN_LENGTH} characters")


def check_bind(host: str, token: str | None) -> None:
    """Refuse a non-loopback ``host`` without a token, and a token too short to guard it."""
    check_token(token)
    if token is None and not is_loopback(host):
        raise InvalidInput(
            "host", f"{host} is not loopback: set {TOKEN_ENV} to serve the dashboard there"
        )


class Access:
    """The access rule of one dashboard: ``token`` None lets every request in."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        #: The cookie value a successful login sets ("" when there is no token).
        self.session_value = (
            ""
            if token is None
            else hmac.new(token.encode(), b"orders-dashboard-session", hashlib.sha256).hexdigest()
        )

    @property
    def open(self) -> bool:
        return self.token is None

    def allows(self, authorization: str | None, cookie_header: str | None) -> bool:
        """Whether a request with these headers may read the dashboard."""
        if self.token is None:
            return True
        if authorization is not None:
            scheme, _, credential = authorization.partition(" ")
            if scheme.lower() == "bearer" and self.is_token(credential.strip()):
                return True
        session = _cookie(cookie_header, COOKIE_NAME)
        return session is not None and hmac.compare_digest(
            session.encode(), self.session_value.encode()
        )

    def is_token(self, candidate: str) -> bool:
        """Whether ``candidate`` is the token (constant-time)."""
        return self.token is not None and hmac.compare_digest(
            candidate.encode("utf-8", "surrogateescape"), self.token.encode()
        )

    def set_cookie(self, *, secure: bool, path: str = "/") -> str:
        """The ``Set-Cookie`` value for a logged-in browser: script-proof, same-site only,
        sent only below ``path`` (where the dashboard is mounted)."""
        flags = "; Secure" if secure else ""
        value = self.session_value
        return f"{COOKIE_NAME}={value}; Path={path}; HttpOnly; SameSite=Strict{flags}"


def _cookie(header: str | None, name: str) -> str | None:
    if not header:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except CookieError:
        return None
    morsel = jar.get(name)
    return None if morsel is None else morsel.value
