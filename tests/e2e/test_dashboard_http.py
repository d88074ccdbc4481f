"""The operator pages on a port of their own, as ``orders dashboard`` serves them (uvicorn
in a thread, on loopback, in process, on one engine): the dashboard's access rules, the login
cookie, the live stream, the probes and metrics beside it, and a stop that ends the streams
and frees the port. What the readings hold is tests/integration/test_dashboard.py's, on
both engines; the same app mounted in a host is tests/e2e/test_dashboard_asgi.py's. The
stream is read as a browser would, from a socket, one event at a time."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from orders.dashboard import Served, bind, start_dashboard
from orders.dashboard.serving import STOP_TIMEOUT_S
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.sse import read_event

TOKEN = "s3cret-dashboard-token"
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


@contextmanager
def dashboard(
    service: OrderService, token: str | None = TOKEN, *, secure_cookie: bool = False
) -> Iterator[Served]:
    sock = bind("127.0.0.1", 0, field="port", token=token)
    served = start_dashboard(
        service, sock, token=token, refresh_s=0.05, secure_cookie=secure_cookie
    )
    try:
        yield served
    finally:
        served.close()


def get(
    served: Served, path: str, headers: dict[str, str] | None = None
) -> tuple[int, http.client.HTTPMessage, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        reply = conn.getresponse()
        return reply.status, reply.headers, reply.read()
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


def login(served: Served, token: str) -> tuple[int, http.client.HTTPMessage]:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    body = f"token={token}"
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    conn.request("POST", "/login", body=body, headers=form)
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply.status, reply.headers


def test_the_login_cookie_is_secure_only_when_asked_for_behind_tls(service: OrderService) -> None:
    with dashboard(service) as served:
        assert "Secure" not in login(served, TOKEN)[1]["Set-Cookie"]
    with dashboard(service, secure_cookie=True) as served:
        status, headers = login(served, TOKEN)
    assert status == 303
    assert headers["Set-Cookie"].endswith("; HttpOnly; SameSite=Strict; Secure")


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


def test_without_a_token_the_pages_are_open_and_the_probes_and_metrics_answer_either_way(
    service: OrderService,
) -> None:
    with dashboard(service, token=None) as served:
        assert get(served, "/api/overview")[0] == 200
        assert get(served, "/login")[0] == 303  # no form without a token
    with dashboard(service) as served:  # no token needed: they hold no order data
        status, _, body = get(served, "/readyz")
        assert (status, json.loads(body)["checks"]) == (200, {"sql": "ok", "redis": "ok"})
        status, _, body = get(served, "/healthz")
        assert (status, json.loads(body)) == (200, {"status": "ok"})
        status, headers, body = get(served, "/metrics")
        assert (status, headers["content-type"].split(";")[0]) == (200, "text/plain")
        assert b"# TYPE orders_creates_total counter" in body


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


def test_a_stop_ends_the_open_streams_at_once_and_frees_the_port(service: OrderService) -> None:
    with dashboard(service) as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        conn.request("GET", "/api/events", headers=bearer(TOKEN))
        reply = conn.getresponse()
        read_event(next_line(reply))
        started = time.monotonic()
        served.close()  # again on the way out: closing twice is harmless
        # Not cut off at uvicorn's graceful-shutdown timeout: ended by the stop itself.
        assert time.monotonic() - started < STOP_TIMEOUT_S
        while reply.fp.readline():
            pass  # the last events, then the end of the stream
        conn.close()
    assert not served.thread.is_alive()
    assert served.app.dashboard is not None
    assert served.app.dashboard.streams.value == 0
    bind("127.0.0.1", served.port, field="port", token=TOKEN).close()  # the port is free
