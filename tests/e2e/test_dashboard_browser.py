"""The dashboard in a real browser: headless Chromium driven by Playwright.

The HTTP-level tests (tests/integration/test_dashboard.py) check the JSON; this one checks
what an operator sees: that the page logs in, that its numbers follow creates, payments,
cancels and the sweep *without a reload* (the server-sent events and the JavaScript that
renders them), that the refunds owed list a hostile payment reference as text, that the
resources running out show a hostile resource id as text and mark the sold out, that a
named resource shows its free seats with their first names and the waiting lists their
longest queues (hostile unit names and ids as text), that the user search highlights a
damaged index entry, and that the token keeps a fresh browser and a wrong bearer out.

The browser is the system's Chromium (``ORDERS_CHROMIUM``, else ``chromium`` on PATH):
Playwright never downloads one here. It runs with a temporary profile (Playwright's
``launch`` makes one per browser and deletes it) and with Chromium's own background
traffic (updates, sync, QUIC probes) turned off, since the machine has no network.
Without Chromium the test is skipped on a developer's machine and fails in CI.

Every run saves a full-page screenshot to ``build/screenshots/dashboard.png``; the one in
``docs/images/`` that the README shows is a copy of such a run.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Dialog,
    Error,
    Page,
    Playwright,
    expect,
    sync_playwright,
)

from orders.dashboard import Served, bind, start_dashboard
from orders.errors import OrderClosed
from orders.events.consumer import EventConsumer
from orders.index.heartbeat import Heartbeats, SchedulerBeat
from orders.index.lease import SweeperLease
from orders.index.nodes import RedisClient
from orders.service import OrderService
from tests.support.browser import CHROMIUM_ARGS, chromium_path
from tests.support.clocks import ManualClock

# One engine is enough: the browser sees the same JSON whichever store answers it.
pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)

TOKEN = "browser-test-token-0123456789"
SCREENSHOT = Path(__file__).resolve().parents[2] / "build" / "screenshots" / "dashboard.png"
#: How long the page may take to show a change: many refreshes (0.2 s) on a slow machine.
WAIT_MS = 10_000
SHOP_USERS = [
    "alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi",
    "ivan", "judy", "mallory", "niaj", "olivia", "peggy", "rupert",
]  # fmt: skip
#: Counts the times the live badge turns "lost" (the event stream failed).
LOST_COUNTER = """() => {
  const live = document.querySelector("#live");
  window.__lost = 0;
  new MutationObserver(() => { if (live.dataset.state === "lost") window.__lost += 1; })
    .observe(live, { attributes: true, attributeFilter: ["data-state"] });
}"""
FIGURES = ("unpaid", "open_unpaid", "paid", "cancelled", "closed", "backlog")
#: A payment reference is caller text: the page must show it as text, never run it.
HOSTILE_REF = "<img src=x onerror=alert(1)>"
#: So is a resource id (set_capacity accepts it), shown in the resources running out.
HOSTILE_RESOURCE = "<img src=x onerror=alert(2)>"
#: And a unit name (set_units accepts it), shown among a resource's first free seats.
HOSTILE_SEAT = "<img src=x onerror=alert(4)>"


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    chromium = playwright.chromium.launch(
        executable_path=chromium_path(), headless=True, args=CHROMIUM_ARGS
    )
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture
def dashboard(service: OrderService) -> Iterator[Served]:
    sock = bind("127.0.0.1", 0, field="port", token=TOKEN)
    served = start_dashboard(service, sock, token=TOKEN, refresh_s=0.2)
    try:
        yield served
    finally:
        served.close()


def console_line(message: ConsoleMessage) -> str:
    return f"{message.location.get('url')}: {message.text}"


@dataclass
class Console:
    """What the pages said on their console as errors, and the scripts' uncaught errors;
    a test takes out the ones it caused on purpose (:meth:`expected`)."""

    errors: list[str] = field(default_factory=list)

    def watch(self, page: Page) -> None:
        def on_console(message: ConsoleMessage) -> None:
            if message.type == "error":
                self.errors.append(console_line(message))

        def on_error(error: Error) -> None:
            self.errors.append(f"{page.url}: uncaught {error.name}: {error.message}")

        page.on("console", on_console)
        page.on("pageerror", on_error)

    @contextmanager
    def expected(self, page: Page, url: str, status: int) -> Iterator[None]:
        """The block makes ``page`` load ``url`` and get ``status``: the console error
        Chromium prints for it is expected (and must come)."""

        def matches(message: ConsoleMessage) -> bool:
            return message.location.get("url") == url and f"status of {status}" in message.text

        with page.expect_console_message(matches, timeout=WAIT_MS) as said:
            yield
        self.errors.remove(console_line(said.value))


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
def new_context(
    browser: Browser, dashboard: Served, console: Console
) -> Iterator[Callable[[], BrowserContext]]:
    """Fresh browser contexts (no cookie), every page watched; closed before the dashboard."""
    opened: list[BrowserContext] = []

    def make() -> BrowserContext:
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.on("page", console.watch)
        opened.append(context)
        return context

    try:
        yield make
    finally:
        for context in opened:
            context.close()


@dataclass
class Shop:
    """A small shop's morning: who ordered what, and when each order falls due."""

    orders: dict[str, str] = field(default_factory=dict)  # order id -> user
    expires: dict[str, int] = field(default_factory=dict)  # order id -> expiry, service ms

    def of(self, user: str) -> list[str]:
        return [order for order, owner in self.orders.items() if owner == user]


def open_shop(service: OrderService) -> Shop:
    """Thirty orders over fifteen users, one to three each, due 30 s to 10 min from now
    (distinct TTLs five seconds apart, so the test knows exactly which fall due first)."""
    rng = random.Random(15)
    ttls = iter(rng.sample(range(30, 590, 5), 30))
    shop = Shop()
    for i, user in enumerate(SHOP_USERS):
        for _ in range(1 + i % 3):
            order_id = f"ord-{1001 + len(shop.orders)}"
            order = service.create_unpaid_order(
                user, order_id=order_id, ttl_s=next(ttls), amount=f"{rng.randrange(5, 90)}.90"
            )
            shop.orders[order_id] = user
            shop.expires[order_id] = order.expires_at_ms
    return shop


def expect_figures(page: Page, **expected: int) -> None:
    """Wait until every count card shows its expected number and the expiries chart's
    bars add up to the open unpaid count."""
    assert sorted(expected) == sorted(FIGURES)
    for name, value in expected.items():
        expect(page.locator(f'[data-field="{name}"]')).to_have_text(str(value), timeout=WAIT_MS)
    bars = "[...document.querySelectorAll('#expiries rect[data-count]')]"
    total = f"{bars}.reduce((sum, bar) => sum + Number(bar.dataset.count), 0)"
    wanted = expected["open_unpaid"]
    try:
        page.wait_for_function(f"(n) => {total} === n", arg=wanted, timeout=WAIT_MS)
    except Error:
        shown = page.evaluate(total)
        pytest.fail(f"the chart's bars add up to {shown}, not {wanted}")


def recent_close_ids(page: Page) -> list[str]:
    return sorted(page.locator("#recent-closes tbody tr td:first-child").all_inner_texts())


def search(page: Page, user: str) -> None:
    """Look ``user`` up, and wait for this answer (the summary names the user)."""
    form = page.locator("#user-search")
    form.locator('input[name="user_id"]').fill(user)
    page.evaluate("document.querySelector('#user-summary').textContent = ''")
    form.locator('button[type="submit"]').click()
    expect(page.locator("#user-summary")).to_contain_text(f"{user}:", timeout=WAIT_MS)


def log_in(page: Page, url: str, console: Console) -> None:
    """From ``/`` through the login form: a wrong token first, then the right one."""
    page.goto(url + "/")
    expect(page).to_have_url(re.compile(r"/login$"))
    page.locator("#token").fill("not-the-token-at-all")
    with console.expected(page, url + "/login", 401):
        page.locator('button[type="submit"]').click()
    expect(page.locator("p.error")).to_have_text("Wrong token.")
    page.locator("#token").fill(TOKEN)
    page.locator('button[type="submit"]').click()
    expect(page).to_have_url(url + "/")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=WAIT_MS)


def test_the_page_follows_the_shop_live_and_compares_a_user(
    service: OrderService,
    redis_client: RedisClient,
    clock: ManualClock,
    dashboard: Served,
    new_context: Callable[[], BrowserContext],
    console: Console,
) -> None:
    page = new_context().new_page()
    log_in(page, dashboard.url, console)
    expect_figures(page, unpaid=0, open_unpaid=0, paid=0, cancelled=0, closed=0, backlog=0)
    expect(page.locator('[data-field="refunds_owed"]')).to_have_text("0")
    expect(page.locator("#refunds tbody tr.empty")).to_have_count(1)
    expect(page.locator("#resources tbody tr.empty")).to_have_count(1)
    # Durations as the page writes them: seconds are rounded before minutes are split off.
    shown = page.evaluate("[599600, 600000, 125600, 7199600].map(duration)")
    assert shown == ["10 min 0 s", "10 min 0 s", "2 min 6 s", "2.0 h"]
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    # Marks of this page load: a reload would lose them, and a stream that drops (the
    # browser then reconnects, also a way to get fresh numbers) shows "lost" on the badge.
    loaded = page.evaluate("window.__loaded = Date.now()")
    page.evaluate(LOST_COUNTER)

    shop = open_shop(service)
    expect_figures(page, unpaid=30, open_unpaid=30, paid=0, cancelled=0, closed=0, backlog=0)

    paid = list(shop.orders)[2::5]  # six orders, over several users
    for n, order_id in enumerate(paid):
        service.mark_paid(order_id, payment_ref=f"pay-{n}")
    expect_figures(page, unpaid=24, open_unpaid=24, paid=6, cancelled=0, closed=0, backlog=0)

    service.cancel_order("ord-1004", reason="changed their mind")
    expect_figures(page, unpaid=23, open_unpaid=23, paid=6, cancelled=1, closed=0, backlog=0)
    expect(page.locator("#recent-closes tbody tr.empty")).to_have_count(1)

    done = {*paid, "ord-1004"}
    still_open = [order for order in shop.orders if order not in done]
    by_expiry = sorted(still_open, key=shop.expires.__getitem__)
    first_due = sorted(by_expiry[:2])
    clock.set(shop.expires[by_expiry[1]] + 1500)  # the next is due five seconds later
    expect_figures(page, unpaid=23, open_unpaid=21, paid=6, cancelled=1, closed=0, backlog=2)

    assert service.sweep_expired().closed == 2
    expect_figures(page, unpaid=21, open_unpaid=21, paid=6, cancelled=1, closed=2, backlog=0)
    expect(page.locator("#recent-closes tbody tr")).to_have_count(2)
    assert recent_close_ids(page) == first_due

    # Payments that came too late: refunds owed, one already handled, one with hostile text.
    # Two seconds pass in all: the next order falls due 3.5 s after the sweep's time.
    with pytest.raises(OrderClosed):
        service.mark_paid("ord-1004", payment_ref="psp-handled")
    service.mark_refund_handled("ord-1004", "psp-handled")
    clock.advance(s=1)
    with pytest.raises(OrderClosed):
        service.mark_paid(first_due[0], payment_ref=HOSTILE_REF, amount="12.90", currency="EUR")
    clock.advance(s=1)
    expect(page.locator('[data-field="refunds_owed"]')).to_have_text("1", timeout=WAIT_MS)
    expect(page.locator('[data-field="refunds_owed"]')).to_have_class("bad")
    expect(page.locator('[data-field="refunds_oldest"]')).to_have_text("1.00 s ago")
    owed = page.locator("#refunds tbody tr")
    expect(owed).to_have_count(1)
    expect(owed.locator("td")).to_have_text(
        [
            first_due[0],
            shop.orders[first_due[0]],
            HOSTILE_REF,
            "closed",
            "12.90 EUR",
            "1.00 s ago",
        ]
    )
    expect(page.locator("#refunds img")).to_have_count(0)

    # Counted resources: one sold out under a hostile id, one with units free.
    service.set_capacity("sku:tea", 10)
    service.set_capacity(HOSTILE_RESOURCE, 2)
    service.create_unpaid_order("zoe", order_id="cart-1", holds={HOSTILE_RESOURCE: 2, "sku:tea": 1})
    service.mark_paid("cart-1", payment_ref="pay-cart")
    running_out = page.locator("#resources tbody tr")
    expect(running_out).to_have_count(2, timeout=WAIT_MS)
    expect(running_out.nth(0).locator("td")).to_have_text(
        [HOSTILE_RESOURCE, "2", "0", "2", "0 sold out", ""]
    )
    expect(running_out.nth(0)).to_have_class("soldout")
    expect(running_out.nth(1).locator("td")).to_have_text(["sku:tea", "10", "0", "1", "9", ""])
    expect(running_out.nth(1)).not_to_have_class("soldout")
    expect(page.locator("#resources img")).to_have_count(0)
    expect(page.locator('[data-field="resources_ranked"]')).to_be_hidden()

    # A scheduler and an event consumer, as a running shop has them (the screenshot's panels).
    prefix = service.index.key_prefix
    assert SweeperLease(redis_client, key_prefix=prefix).acquire("scheduler-a", 30_000)
    beat = SchedulerBeat("scheduler-a", True, clock() - 800, clock() + 30_000, clock())
    Heartbeats(redis_client, key_prefix=prefix).publish(beat, forget_after_ms=60_000)
    EventConsumer(
        service.engine, "mailer", lambda event: None, clock=clock, start="oldest"
    ).run_once(limit=30)
    expect(page.locator("#schedulers tbody td").first).to_have_text("scheduler-a")
    expect(page.locator("#consumers tbody td").first).to_have_text("mailer")

    user = next(u for u in SHOP_USERS if len(shop.of(u)) == 3 and not done & set(shop.of(u)))
    mine = shop.of(user)
    search(page, user)
    slots = page.locator("#user-slots tbody tr")
    expect(slots).to_have_count(3)
    assert sorted(slots.locator("td:first-child").all_inner_texts()) == sorted(mine)
    expect(page.locator("#user-slots tr.diff")).to_have_count(0)

    redis_client.zrem(service.index.key(user), mine[0])
    search(page, user)
    damaged = page.locator("#user-slots tr.diff")
    expect(damaged).to_have_count(1)
    expect(damaged.locator("td").first).to_have_text(mine[0])
    expect(damaged.locator("td.state")).to_contain_text("reconcile")
    expect(page.locator("#user-summary")).to_contain_text("1 difference")
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT), full_page=True)

    service.reconcile()
    search(page, user)
    expect(page.locator("#user-summary")).to_contain_text("0 differences")
    expect(page.locator("#user-slots tr.diff")).to_have_count(0)

    banner = page.locator("#pause")
    expect(banner).to_be_hidden()
    service.operations.pause("<b>psp</b> down", actor="oncall")
    expect(banner).to_be_visible()
    expect(banner).to_contain_text("by application:oncall: <b>psp</b> down")
    expect(banner).to_contain_text("nothing closes by expiry")
    service.operations.resume()
    expect(banner).to_be_hidden()

    assert page.evaluate("window.__loaded") == loaded, "the page was reloaded"
    assert page.evaluate("window.__lost") == 0, "the event stream dropped"
    assert dialogs == [], "caller text ran as script"
    assert not console.errors, "\n".join(console.errors)


def test_the_page_shows_seats_running_out_and_the_longest_waiting_lists(
    service: OrderService,
    clock: ManualClock,
    dashboard: Served,
    new_context: Callable[[], BrowserContext],
    console: Console,
) -> None:
    page = new_context().new_page()
    log_in(page, dashboard.url, console)
    expect(page.locator("#waiting tbody tr.empty")).to_have_text("nobody is waiting")
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)

    # A hall of twelve seats (one named with hostile text), a sold-out box of two, and tea.
    hall = [HOSTILE_SEAT, *(f"A-{n:02}" for n in range(2, 13))]
    service.set_units("hall", hall)
    service.set_units(HOSTILE_RESOURCE, ["B-1", "B-2"])
    service.set_capacity("sku:tea", 1)
    service.create_unpaid_order("ann", holds={"hall": ["A-03"], HOSTILE_RESOURCE: 2})
    service.create_unpaid_order("bob", holds={"sku:tea": 1})
    rows = page.locator("#resources tbody tr")
    expect(rows).to_have_count(3, timeout=WAIT_MS)
    expect(rows.nth(0).locator("td")).to_have_text(
        [HOSTILE_RESOURCE, "2", "2", "0", "0 sold out", ""]
    )
    expect(rows.nth(1).locator("td")).to_have_text(["sku:tea", "1", "1", "0", "0 sold out", ""])
    free_hall = [name for name in hall if name != "A-03"]
    expect(rows.nth(2).locator("td")).to_have_text(
        ["hall", "12", "1", "0", "11 seats", ", ".join(free_hall[:10]) + ", …"]
    )

    # Queues: three for the box (one asks both seats), one for tea, a second later.
    service.wait_for("cid", HOSTILE_RESOURCE, quantity=2)
    service.wait_for("dee", HOSTILE_RESOURCE)
    clock.advance(s=1)
    service.wait_for("eve", "sku:tea")
    service.wait_for("fay", HOSTILE_RESOURCE)
    clock.advance(ms=500)
    queues = page.locator("#waiting tbody tr")
    expect(queues).to_have_count(2, timeout=WAIT_MS)
    expect(queues.nth(0).locator("td")).to_have_text([HOSTILE_RESOURCE, "3", "4", "1.50 s", "0"])
    expect(queues.nth(1).locator("td")).to_have_text(["sku:tea", "1", "1", "500 ms", "0"])
    expect(page.locator('[data-field="waiting_ranked"]')).to_be_hidden()
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOT.with_name("dashboard-waiting.png")), full_page=True)

    # Tea comes free: eve is served at once and her queue leaves the panel.
    service.set_capacity("sku:tea", 2)
    expect(queues).to_have_count(1, timeout=WAIT_MS)
    expect(queues.nth(0).locator("td").first).to_have_text(HOSTILE_RESOURCE)
    expect(page.locator("#resources img, #waiting img")).to_have_count(0)
    assert dialogs == [], "caller text ran as script"
    assert not console.errors, "\n".join(console.errors)


def test_without_the_token_the_dashboard_refuses(
    dashboard: Served,
    playwright: Playwright,
    new_context: Callable[[], BrowserContext],
    console: Console,
) -> None:
    url = dashboard.url
    stranger = new_context()
    assert stranger.request.get(url + "/api/overview").status == 401
    assert stranger.request.get(url + "/api/events").status == 401
    page = stranger.new_page()
    page.goto(url + "/")
    expect(page).to_have_url(url + "/login")
    expect(page.locator("#token")).to_be_visible()

    for bearer, status in ((TOKEN[:-1] + "X", 401), ("", 401), (TOKEN, 200)):
        api = playwright.request.new_context(
            extra_http_headers={"Authorization": f"Bearer {bearer}"}
        )
        try:
            assert api.get(url + "/api/overview").status == status, bearer
        finally:
            api.dispose()
    assert not console.errors, "\n".join(console.errors)
