"""The operator pages mounted in a FastAPI host under /ops/orders (orders.dashboard.asgi_app,
through examples/fastapi_checkout/operator_pages.py), served by uvicorn on loopback in this
process, on the test's stores: the JSON, the probes, the token, HEAD, the event stream and
its end when the client leaves, and the page itself in Chromium."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager

import httpx
import pytest
import uvicorn
from playwright.sync_api import ConsoleMessage, Error, expect, sync_playwright
from sqlalchemy import Engine, text

from orders.bootstrap import build_service
from orders.config import Settings
from orders.dashboard import OperatorApp, asgi_app
from orders.dashboard.asgi import DEFAULT_THREADS
from orders.dashboard.server import Request
from orders.errors import InvalidInput
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.aio import loop_kind
from tests.support.browser import CHROMIUM_ARGS, chromium_path
from tests.support.examples import load_example
from tests.support.processes import free_port
from tests.support.sse import read_event

# Each test on one engine, the next on the other (CI time; --full runs both everywhere).
pytestmark = pytest.mark.rotate("database_url")

TOKEN = "asgi-test-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0


@contextmanager
def mounted(
    service: OrderService, refresh_s: float = 0.2, threads: int = DEFAULT_THREADS
) -> Iterator[tuple[str, OperatorApp]]:
    """The example's host app (token pages at /ops/orders) plus ``auth="host"`` pages at
    /ops/open and a sync route of the host's own at /host (run on anyio's default thread
    pool, as FastAPI runs every ``def`` route), under uvicorn in a thread; yields the base
    URL and the token pages' app."""
    ops = asgi_app(service, token=TOKEN, refresh_s=refresh_s, threads=threads)
    app = load_example("fastapi_checkout/operator_pages.py", "operator_pages").host_app(ops)
    app.mount("/ops/open", asgi_app(service, auth="host", refresh_s=refresh_s))

    @app.get("/host")
    def host_route() -> dict[str, bool]:
        return {"ok": True}

    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        loop=loop_kind(),
        ws="none",
        log_config=None,  # the test process's logging stays as pytest set it
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert thread.is_alive(), "uvicorn stopped while starting"
    try:
        yield f"http://127.0.0.1:{port}", ops
    finally:
        server.should_exit = True
        thread.join(15)
    assert not thread.is_alive()
    assert ops.dashboard.closing.is_set()  # the host's lifespan closed the pages


def wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def client(base: str) -> httpx.Client:
    return httpx.Client(base_url=base, timeout=WAIT_S, trust_env=False)


def test_choosing_who_guards_the_pages_is_required_and_checked(service: OrderService) -> None:
    with pytest.raises(InvalidInput, match='auth="host"'):
        asgi_app(service)
    with pytest.raises(InvalidInput, match="takes no token"):
        asgi_app(service, token=TOKEN, auth="host")
    with pytest.raises(InvalidInput, match="at least 16"):
        asgi_app(service, token="short")
    with pytest.raises(InvalidInput, match="auth"):
        asgi_app(service, token=TOKEN, auth="none")  # type: ignore[arg-type]
    for threads in (0, 65, True):
        with pytest.raises(InvalidInput, match="threads"):
            asgi_app(service, auth="host", threads=threads)


def test_built_from_settings_the_app_has_a_service_of_its_own_on_the_same_stores(
    service: OrderService,
) -> None:
    service.create_unpaid_order("alice", order_id="ord-1", ttl_s=600)
    ops = asgi_app(service.settings, auth="host")
    try:
        assert ops.dashboard.service is not service
        answer = ops.answer(Request("GET", "/api/overview"))
        assert json.loads(answer.body)["sql"]["stats"]["by_status"]["unpaid"] == 1
    finally:
        ops.close()
    assert ops.dashboard.closing.is_set()


def test_under_a_prefix_the_json_probes_and_head_answer_and_the_token_guards_them(
    service: OrderService,
) -> None:
    service.create_unpaid_order("alice", order_id="ord-1", ttl_s=600)
    with mounted(service) as (base, ops), client(base) as http:
        # Without the token: the API refuses, a browser is sent to the form under the prefix.
        assert http.get("/ops/orders/api/overview").status_code == 401
        page = http.get("/ops/orders/", headers={"Accept": "text/html"})
        assert (page.status_code, page.headers["location"]) == (303, "/ops/orders/login")
        form = http.get("/ops/orders/login")
        assert form.status_code == 200
        assert 'action="login"' in form.text  # posts to /ops/orders/login
        # The probes need no token.
        assert http.get("/ops/orders/healthz").json() == {"status": "ok"}
        ready = http.get("/ops/orders/readyz")
        assert (ready.status_code, ready.json()["checks"]) == (200, {"sql": "ok", "redis": "ok"})

        login = http.post("/ops/orders/login", data={"token": TOKEN})
        assert (login.status_code, login.headers["location"]) == (303, "/ops/orders/")
        cookie = login.headers["set-cookie"]
        assert "; Path=/ops/orders/; HttpOnly" in cookie
        http.cookies.clear()
        session = {"Cookie": cookie.split(";")[0]}
        overview = http.get("/ops/orders/api/overview", headers=session)
        assert overview.status_code == 200
        assert overview.json()["sql"]["stats"]["by_status"]["unpaid"] == 1
        user = http.get("/ops/orders/api/user", params={"user_id": "alice"}, headers=BEARER)
        assert [row["order_id"] for row in user.json()["rows"]] == ["ord-1"]

        page = http.get("/ops/orders/", headers=BEARER)
        assert page.status_code == 200
        assert 'href="static/dashboard.css"' in page.text  # relative: under the prefix
        assert http.get("/ops/orders/static/dashboard.js", headers=BEARER).status_code == 200
        bare = http.get("/ops/orders", headers=BEARER)  # the host or the app adds the slash
        assert bare.is_redirect
        assert bare.headers["location"].endswith("/ops/orders/")

        head = http.head("/ops/orders/", headers=BEARER)
        assert (head.status_code, head.content) == (200, b"")
        assert int(head.headers["content-length"]) == len(page.content)
        head = http.head("/ops/orders/api/events", headers=BEARER)
        assert (head.status_code, head.headers["content-type"]) == (200, "text/event-stream")
        assert ops.dashboard.streams.value == 0  # a HEAD opens no stream...
        assert http.get("/ops/orders/healthz").status_code == 200  # ...nor holds the connection

        # auth="host": the host's own auth stands in front, the pages ask for nothing.
        assert http.get("/ops/open/api/overview").status_code == 200
        assert http.get("/ops/open/login").headers["location"] == "/ops/open/"
        assert http.get("/ops/orders/nothing", headers=BEARER).status_code == 404


def test_the_stream_sends_an_event_leaves_the_loop_free_and_ends_when_the_client_goes(
    service: OrderService,
) -> None:
    service.create_unpaid_order("alice", order_id="ord-1", ttl_s=600)
    # A long refresh: the stream sits between events while the client goes away.
    with mounted(service, refresh_s=30) as (base, ops):
        with (
            client(base) as http,
            http.stream("GET", "/ops/orders/api/events", headers=BEARER) as events,
        ):
            assert events.headers["content-type"] == "text/event-stream"
            lines = events.iter_lines()
            event = read_event(lambda: next(lines))
            assert event["sql"]["stats"]["by_status"]["unpaid"] == 1
            assert ops.dashboard.streams.value == 1
            with client(base) as other:  # the loop serves others while the stream waits
                assert other.get("/ops/orders/api/overview", headers=BEARER).status_code == 200
        # The client closed its connection: the server's stream ends now, not at its next
        # event 30 s away (nor never: uvicorn drops what is sent to a gone client).
        wait_until(lambda: ops.dashboard.streams.value == 0, "the stream to end")


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_a_burst_of_slow_reads_waits_on_the_pages_own_threads_never_the_hosts(
    database_url: str, redis_url: str, engine: Engine
) -> None:
    """More requests than anyio's default pool has threads (40), each held by a lock on the
    orders table: the pages use their own 2 threads, the rest wait for them, and the host's
    own sync route still answers at once; all of them answer once the lock goes."""
    burst = 45
    # The pages' reads wait on the lock however long a loaded machine takes to queue them.
    patient = Settings(database_url=database_url, redis_url=redis_url, sql_lock_timeout_s=60)
    with (
        closing(build_service(patient)) as service,
        mounted(service, threads=2) as (base, ops),
        ThreadPoolExecutor(burst) as pool,
    ):
        with engine.connect() as holder:  # every read of the orders waits behind this lock
            holder.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
            holder.execute(text(f"LOCK TABLE {orders_table.name} IN ACCESS EXCLUSIVE MODE"))

            def overview(_: int) -> int:
                with client(base) as http:
                    return http.get("/ops/orders/api/overview", headers=BEARER).status_code

            answers = pool.map(overview, range(burst))
            wait_until(
                lambda: (
                    ops.limiter is not None
                    and (ops.limiter.borrowed_tokens, ops.limiter.statistics().tasks_waiting)
                    == (2, burst - 2)
                ),
                "the burst to fill the pages' threads and queue behind them",
            )
            with client(base) as http:
                assert http.get("/host").json() == {"ok": True}
            holder.rollback()
        assert list(answers) == [200] * burst


def test_the_page_loads_under_the_prefix_in_chromium_and_shows_an_order(
    service: OrderService,
) -> None:
    service.create_unpaid_order("alice", order_id="ord-1", ttl_s=600)
    executable = chromium_path()
    errors: list[str] = []

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            errors.append(f"{message.location.get('url')}: {message.text}")

    def on_error(error: Error) -> None:
        errors.append(f"uncaught {error.name}: {error.message}")

    with mounted(service) as (base, _), sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=executable, headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page()
            page.on("console", on_console)
            page.on("pageerror", on_error)
            page.goto(f"{base}/ops/orders/")
            expect(page).to_have_url(f"{base}/ops/orders/login")
            page.locator("#token").fill(TOKEN)
            page.locator('button[type="submit"]').click()
            expect(page).to_have_url(f"{base}/ops/orders/")
            wait_ms = WAIT_S * 1000
            expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=wait_ms)
            expect(page.locator('[data-field="unpaid"]')).to_have_text("1", timeout=wait_ms)
            page.locator('#user-search input[name="user_id"]').fill("alice")
            page.locator('#user-search button[type="submit"]').click()
            first = page.locator("#user-slots tbody td").first
            expect(first).to_have_text("ord-1", timeout=wait_ms)
        finally:
            browser.close()  # before uvicorn stops: the page's stream ends with it
    assert not errors, "\n".join(errors)
