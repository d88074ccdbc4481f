"""The dashboard over HTTP (access rules, the login cookie, the live stream), served in
process on one engine: what is tested here does not depend on the stores, which
tests/integration/test_dashboard.py covers on both engines. The stream is read as a
browser would, from a socket, one event at a time."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from orders.dashboard import start_dashboard
from orders.errors import InvalidInput
from orders.httpd import Served
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.sse import read_event

TOKEN = "s3cret-dashboard-token"
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@contextmanager
def dashboard(
    service: OrderService, token: str | None = TOKEN, *, secure_cookie: bool = False
) -> Iterator[Served]:
    served = start_dashboard(
        service, "127.0.0.1", 0, token=token, refresh_s=0.05, secure_cookie=secure_cookie
    )
    try:
        yield served
    finally:
        served.close()


def get(
    served: Served, path: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_with_a_token_every_request_needs_it(service: OrderService) -> None:
    with dashboard(service) as served:
        for path in ("/", "/static/dashboard.js", "/api/overview", "/api/user?user_id=u"):
            status, headers, _ = get(served, path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert get(served, path, bearer(TOKEN + "x"))[0] == 401, path
            assert get(served, path, bearer(TOKEN))[0] == 200, path
        # a browser asking for the page is sent to the form, which needs nothing
        status, headers, _ = get(served, "/", {"Accept": "text/html"})
        assert (status, headers["Location"]) == (303, "/login")
        assert get(served, "/login")[0] == 200


def login(served: Served, token: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    body = f"token={token}"
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    conn.request("POST", "/login", body=body, headers=form)
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply.status, dict(reply.getheaders())


def test_the_login_cookie_is_secure_only_when_asked_for_behind_tls(service: OrderService) -> None:
    with dashboard(service) as served:
        assert "Secure" not in login(served, TOKEN)[1]["Set-Cookie"]
    with dashboard(service, secure_cookie=True) as served:
        status, headers = login(served, TOKEN)
    assert status == 303
    assert headers["Set-Cookie"].endswith("; HttpOnly; SameSite=Strict; Secure")


def test_a_head_of_the_stream_answers_its_headers_and_ends(service: OrderService) -> None:
    with dashboard(service) as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        conn.request("HEAD", "/api/events", headers=bearer(TOKEN))
        reply = conn.getresponse()
        assert (reply.status, reply.getheader("Content-Type")) == (200, "text/event-stream")
        # A HEAD reply has no body: the server must not write one, nor keep the socket.
        assert conn.sock is None or conn.sock.recv(1) == b""
        conn.close()


def test_the_login_form_sets_a_cookie_that_is_not_the_token(service: OrderService) -> None:
    with dashboard(service) as served:
        assert login(served, "wrong-token-wrong-token")[0] == 401
        status, headers = login(served, TOKEN)
        assert status == 303
        cookie = headers["Set-Cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=Strict" in cookie
        assert TOKEN not in cookie
        session = cookie.split(";")[0]
        assert get(served, "/api/overview", {"Cookie": session})[0] == 200
        forged = session.split("=")[0] + "=" + TOKEN
        assert get(served, "/api/overview", {"Cookie": forged})[0] == 401


def test_without_a_token_only_loopback_is_served(service: OrderService) -> None:
    with pytest.raises(InvalidInput, match="ORDERS_DASHBOARD_TOKEN"):
        start_dashboard(service, "0.0.0.0", 0, token=None)
    with pytest.raises(InvalidInput, match="at least 16"):
        start_dashboard(service, "127.0.0.1", 0, token="short")
    with dashboard(service, token=None) as served:
        assert get(served, "/api/overview")[0] == 200
        assert get(served, "/login")[0] == 303  # no form without a token


def test_a_bad_user_id_is_a_400_and_an_unknown_path_a_404(service: OrderService) -> None:
    with dashboard(service) as served:
        status, _, body = get(served, "/api/user?user_id=%20", bearer(TOKEN))
        assert status == 400
        assert "user_id" in json.loads(body)["error"]
        assert get(served, "/nothing", bearer(TOKEN))[0] == 404


def next_line(reply: http.client.HTTPResponse) -> Callable[[], str]:
    return lambda: reply.fp.readline().decode().rstrip("\n")


def test_the_stream_carries_a_change_without_a_new_request(
    service: OrderService, clock: ManualClock
) -> None:
    with dashboard(service) as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        conn.request("GET", "/api/events", headers=bearer(TOKEN))
        reply = conn.getresponse()
        assert reply.getheader("Content-Type") == "text/event-stream"
        first = read_event(next_line(reply))
        assert first["sql"]["stats"]["by_status"]["unpaid"] == 0
        service.create_unpaid_order("u", ttl_s=60, order_id="o1")
        clock.advance(ms=1)
        event = read_event(next_line(reply))
        while event["at_ms"] == first["at_ms"]:
            event = read_event(next_line(reply))  # a reading cached from before the create
        assert event["sql"]["stats"]["by_status"]["unpaid"] == 1
        conn.close()
