"""The dashboard on real stores: its figures after real use cases, the user comparison after
the index is damaged on purpose, and its HTTP side (access rules, the live stream).

Time moves with the service's ManualClock; the live stream is read as a browser would,
from a socket, one event at a time.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from orders.dashboard import start_dashboard
from orders.dashboard.snapshot import compare_user, read_overview
from orders.errors import InvalidInput
from orders.httpd import Served
from orders.redis_nodes import RedisClient
from orders.service import OrderService
from tests.conftest import ManualClock

TOKEN = "s3cret-dashboard-token"


def overview_figures(service: OrderService) -> dict[str, Any]:
    sql = read_overview(service)["sql"]
    assert "error" not in sql, sql
    return dict(sql["stats"])


def test_the_figures_follow_creates_payments_cancels_and_the_sweep(
    service: OrderService, clock: ManualClock
) -> None:
    for user in ("a", "b", "c"):
        service.create_unpaid_order(user, ttl_s=60, order_id=f"{user}-1")
        service.create_unpaid_order(user, ttl_s=300, order_id=f"{user}-2")
    service.mark_paid("a-1", payment_ref="p1")
    service.cancel_order("b-1")
    clock.advance(s=61)  # c-1 is due, not closed yet

    stats = overview_figures(service)
    assert stats["by_status"] == {"unpaid": 4, "paid": 1, "cancelled": 1, "closed": 0}
    assert (stats["open_unpaid"], stats["backlog"]) == (3, 1)
    assert sum(count for _, count in stats["upcoming"]) == 3

    clock.advance(s=2)
    assert service.sweep_expired().closed == 1
    overview = read_overview(service)
    stats = overview["sql"]["stats"]
    assert stats["by_status"]["closed"] == 1
    assert stats["backlog"] == 0
    [close] = overview["sql"]["recent_closes"]
    assert (close["order_id"], close["user_id"], close["lag_ms"]) == ("c-1", "c", 3000)
    assert overview["redis"]["servers"] >= 1
    assert overview["redis"]["keys"] >= 3  # the three users' sets at least
    assert overview["scheduling"]["lease_owner"] is None


def test_the_user_comparison_names_what_reconcile_would_repair(
    service: OrderService, redis_client: RedisClient, clock: ManualClock
) -> None:
    for n in range(3):
        service.create_unpaid_order("u", ttl_s=100 + n, order_id=f"u-{n}")
    service.create_unpaid_order("u2", ttl_s=100, order_id="paid")
    service.mark_paid("paid", payment_ref="p")
    same = compare_user(service, "u")
    assert [row["state"] for row in same["rows"]] == ["same"] * 3
    assert same["differences"] == 0
    assert sorted(row["slot"] for row in same["rows"]) == [1, 2, 3]

    key = service.index.key("u")
    redis_client.zrem(key, "u-0")
    redis_client.zadd(
        key,
        {
            "u-1": clock() + 999_000,
            "ghost": clock() + 5_000,
            "stale": clock() - 1,
            "paid": clock() + 100_000,
        },
    )
    damaged = compare_user(service, "u")
    states = {row["order_id"]: row["state"] for row in damaged["rows"]}
    assert states == {
        "u-0": "missing_in_index",
        "u-1": "index_expiry_differs",
        "u-2": "same",
        "ghost": "no_row",
        "stale": "expired_in_index",
        "paid": "terminal_in_sql",
    }
    assert damaged["differences"] == 5
    assert set(damaged["states"]) >= set(states.values())
    ghost = next(row for row in damaged["rows"] if row["order_id"] == "ghost")
    assert (ghost["sql_expires_at_ms"], ghost["time_left_ms"]) == (None, 5_000)

    # reconcile repairs every difference it promises to; a member with no row stays
    service.reconcile()
    after = compare_user(service, "u")
    assert {row["order_id"]: row["state"] for row in after["rows"]} == {
        "u-0": "same",
        "u-1": "same",
        "u-2": "same",
        "ghost": "no_row",
    }


def test_an_order_due_in_sql_shows_until_the_sweep_closes_it(
    service: OrderService, clock: ManualClock
) -> None:
    service.create_unpaid_order("u", ttl_s=10, order_id="due")
    clock.advance(s=11)
    [row] = compare_user(service, "u")["rows"]
    assert (row["state"], row["time_left_ms"]) == ("expired_in_sql", 0)
    service.sweep_expired()
    assert compare_user(service, "u")["rows"] == []


def test_a_bad_user_id_is_refused_before_any_read(service: OrderService) -> None:
    with pytest.raises(InvalidInput):
        compare_user(service, " ")


# --- over HTTP ----------------------------------------------------------------------------


@contextmanager
def dashboard(service: OrderService, token: str | None = TOKEN) -> Iterator[Served]:
    served = start_dashboard(service, "127.0.0.1", 0, token=token, refresh_s=0.05)
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


def test_the_login_form_sets_a_cookie_that_is_not_the_token(service: OrderService) -> None:
    with dashboard(service) as served:

        def login(token: str) -> tuple[int, dict[str, str]]:
            conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
            body = f"token={token}"
            form = {"Content-Type": "application/x-www-form-urlencoded"}
            conn.request("POST", "/login", body=body, headers=form)
            reply = conn.getresponse()
            reply.read()
            conn.close()
            return reply.status, dict(reply.getheaders())

        assert login("wrong-token-wrong-token")[0] == 401
        status, headers = login(TOKEN)
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


def read_event(reply: http.client.HTTPResponse) -> dict[str, Any]:
    """The next ``overview`` event of a server-sent event stream."""
    kind = data = None
    while True:
        line = reply.fp.readline().decode().rstrip("\n")
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data is not None:
            assert kind == "overview"
            parsed: dict[str, Any] = json.loads(data)
            return parsed


def test_the_stream_carries_a_change_without_a_new_request(
    service: OrderService, clock: ManualClock
) -> None:
    with dashboard(service) as served:
        conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
        conn.request("GET", "/api/events", headers=bearer(TOKEN))
        reply = conn.getresponse()
        assert reply.getheader("Content-Type") == "text/event-stream"
        first = read_event(reply)
        assert first["sql"]["stats"]["by_status"]["unpaid"] == 0
        service.create_unpaid_order("u", ttl_s=60, order_id="o1")
        clock.advance(ms=1)
        event = read_event(reply)
        while event["at_ms"] == first["at_ms"]:
            event = read_event(reply)  # a reading cached from before the create
        assert event["sql"]["stats"]["by_status"]["unpaid"] == 1
        conn.close()
