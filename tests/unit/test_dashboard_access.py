"""The dashboard's access rule and its shared reading, without servers."""

from __future__ import annotations

import pytest

from orders.dashboard.access import COOKIE_NAME, Access, check_bind
from orders.dashboard.server import Overview
from orders.errors import InvalidInput

TOKEN = "0123456789abcdef-token"


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_needs_no_token(host: str) -> None:
    check_bind(host, None)


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "dashboard.internal", "localhost.example.com", ""],
)
def test_anything_else_needs_one(host: str) -> None:
    # A name other than localhost may resolve to anything: never taken as loopback.
    with pytest.raises(InvalidInput, match="ORDERS_DASHBOARD_TOKEN"):
        check_bind(host, None)
    check_bind(host, TOKEN)


def test_a_short_token_is_refused_even_on_loopback() -> None:
    with pytest.raises(InvalidInput, match="at least 16"):
        check_bind("127.0.0.1", "x" * 15)
    check_bind("127.0.0.1", "x" * 16)


def test_bearer_and_cookie_let_in_and_nothing_else_does() -> None:
    access = Access(TOKEN)
    session = f"{COOKIE_NAME}={access.session_value}"
    assert access.allows(f"Bearer {TOKEN}", None)
    assert access.allows(f"bearer  {TOKEN} ", None)
    assert access.allows(None, f"theme=dark; {session}")
    assert not access.allows(None, None)
    assert not access.allows(f"Basic {TOKEN}", None)
    assert not access.allows(f"Bearer {TOKEN[:-1]}", None)
    assert not access.allows("Bearer", None)
    assert not access.allows(None, f"{COOKIE_NAME}={TOKEN}")  # the cookie is not the token
    assert not access.allows(None, f"{COOKIE_NAME}=")
    assert not access.allows(None, 'bad"cookie')
    assert TOKEN not in access.set_cookie(secure=True)
    assert "; Secure" in access.set_cookie(secure=True)


def test_another_token_invalidates_the_cookie() -> None:
    old = Access(TOKEN)
    assert not Access(TOKEN + "2").allows(None, f"{COOKIE_NAME}={old.session_value}")


def test_without_a_token_everything_is_let_in() -> None:
    assert Access(None).allows(None, None)


def test_the_overview_is_read_once_per_max_age_however_many_ask() -> None:
    now = [0.0]
    reads: list[float] = []

    def read() -> dict[str, float]:
        reads.append(now[0])
        return {"read": now[0]}

    overview = Overview(read, max_age_s=1.0, monotonic=lambda: now[0])
    assert overview.json() == b'{"read": 0.0}'
    now[0] = 0.99
    assert overview.json() == b'{"read": 0.0}'
    now[0] = 1.0
    assert overview.json() == b'{"read": 1.0}'
    assert reads == [0.0, 1.0]
