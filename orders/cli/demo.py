"""``orders demo``: a short scripted checkout day on the embedded stores, checked at the end.

A few users place orders with TTLs of seconds; one hits the limit and is told when to
retry; some pay, one cancels, one pays after the sweeper closed the order and is refused;
the rest expire and a scheduler running in this process closes them. The closing summary
is checked against the SQL rows and the Redis keys: exit 1 if they disagree.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from sqlalchemy import func, select

from orders.bootstrap import build_service
from orders.config import Settings
from orders.domain import EventKind, OrderStatus
from orders.embedded.binary import usable_redis_server
from orders.embedded.server import check_can_start, redis_status, stop_redis
from orders.errors import OrderClosed, OrdersError, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql.models import events_table, orders_table

STATUS_STYLE = {
    OrderStatus.UNPAID: "yellow",
    OrderStatus.PAID: "green",
    OrderStatus.CANCELLED: "blue",
    OrderStatus.CLOSED: "red",
}


@dataclass
class _Script:
    """What the demo did, and so what the stores must show at the end."""

    service: OrderService
    console: Console
    scale: float
    expected: dict[str, OrderStatus] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    refusals: int = 0
    refunds: int = 0

    def say(self, line: str) -> None:
        self.log.append(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {line}")

    def create(self, user: str, ttl_s: float, label: str, amount: str = "20.00") -> str:
        order = self.service.create_unpaid_order(
            user, ttl_s=ttl_s * self.scale, amount=amount, currency="EUR"
        )
        self.expected[order.id] = OrderStatus.CLOSED  # unless something below changes it
        self.labels[order.id] = label
        self.say(f"{user}: order {label} created, {ttl_s * self.scale:.1f} s to pay")
        return order.id

    def try_create(self, user: str, ttl_s: float, label: str) -> None:
        try:
            self.create(user, ttl_s, label)
        except UnpaidOrderLimitReached as refused:
            self.refusals += 1
            self.say(
                f"[bold]{user}: refused[/bold], {refused.open_count} of {refused.limit} "
                f"open; retry in {refused.retry_after_s:.1f} s"
            )

    def pay(self, order_id: str) -> None:
        label = self.labels[order_id]
        try:
            self.service.mark_paid(order_id, payment_ref=f"psp-{label}")
        except OrderClosed as closed:
            self.refunds += 1
            self.say(
                f"[bold]payment for {label} refused[/bold]: order {closed.status}; "
                "refund owed, recorded in SQL"
            )
            return
        self.expected[order_id] = OrderStatus.PAID
        self.say(f"order {label} paid")

    def pay_late(self, order_id: str) -> None:
        """A payment that arrives once the sweeper has closed the order (waits for that)."""
        deadline = time.monotonic() + 10
        while self.service.get_order(order_id).status is OrderStatus.UNPAID:
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)
        self.pay(order_id)

    def cancel(self, order_id: str) -> None:
        self.service.cancel_order(order_id, reason="changed mind")
        self.expected[order_id] = OrderStatus.CANCELLED
        self.say(f"order {self.labels[order_id]} cancelled")


class _SweepLog(logging.Handler):
    """Shows the scheduler's sweep lines (DEBUG) in the demo's own log instead of on stderr."""

    def __init__(self, script: _Script) -> None:
        super().__init__(logging.DEBUG)
        self.script = script

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
        except ValueError:
            return
        if event.get("event") == "sweep":
            self.script.say(
                f"[red]sweeper closed {event['closed']}[/red] "
                f"({event['max_lag_ms']} ms after expiry)"
            )


def _view(script: _Script) -> Group:
    orders = [script.service.get_order(order_id) for order_id in script.expected]
    table = Table("order", "user", "status", "time left", title="orders", expand=False)
    for order in orders:
        style = STATUS_STYLE[order.status]
        left = f"{order.time_left_s:4.1f} s" if order.is_open else ""
        table.add_row(
            script.labels[order.id], order.user_id, f"[{style}]{order.status}[/{style}]", left
        )
    return Group(table, *script.log[-12:])


def _steps(script: _Script) -> list[tuple[float, Callable[[], None]]]:
    ids: dict[str, str] = {}

    def make(user: str, ttl_s: float, label: str) -> Callable[[], None]:
        return lambda: ids.__setitem__(label, script.create(user, ttl_s, label))

    return [
        (0.0, make("alice", 3, "A1")),
        (0.0, make("alice", 4, "A2")),
        (0.0, make("alice", 5, "A3")),
        (0.2, lambda: script.try_create("alice", 5, "A4")),
        (0.4, make("bob", 6, "B1")),
        (0.4, make("bob", 5, "B2")),
        (0.6, make("carol", 6, "C1")),
        (0.8, make("dave", 2, "D1")),
        (1.0, make("erin", 4, "E1")),
        (1.5, lambda: script.pay(ids["B1"])),
        (2.0, lambda: script.cancel(ids["C1"])),
        (2.5, lambda: script.pay(ids["E1"])),
        (3.6, lambda: script.pay_late(ids["D1"])),  # D1 expired at 2.8 s
        (3.7, make("alice", 2, "A5")),  # A1's slot is free again
    ]


#: The events that end an order's life as unpaid: exactly one per order.
TERMINAL_KINDS = [EventKind.PAID.value, EventKind.CANCELLED.value, EventKind.CLOSED.value]


def _check(script: _Script) -> list[str]:
    """Every disagreement between what the script did and what the stores hold."""
    problems = []
    service = script.service
    for order_id, want in script.expected.items():
        order = service.get_order(order_id)
        if order.status is not want:
            problems.append(f"{script.labels[order_id]} is {order.status}, expected {want}")
    with service.engine.connect() as conn:
        terminal: dict[str, int] = dict(
            conn.execute(
                select(events_table.c.order_id, func.count())
                .where(events_table.c.kind.in_(TERMINAL_KINDS))
                .group_by(events_table.c.order_id)
            ).all()
        )
        unpaid = conn.scalar(
            select(func.count()).select_from(orders_table).where(orders_table.c.status == "unpaid")
        )
    problems += [
        f"{script.labels[o]} has {terminal.get(o, 0)} terminal events"
        for o in script.expected
        if terminal.get(o, 0) != 1
    ]
    if unpaid:
        problems.append(f"{unpaid} orders still unpaid in SQL")
    for user in {o.user_id for o in map(service.get_order, script.expected)}:
        left = service.index.members(user)
        if left:
            problems.append(f"Redis still holds {len(left)} members for {user}")
    owed = service.refused_payments(pending_only=True)
    if [script.labels.get(r.order_id) for r in owed] != ["D1"]:
        problems.append(f"{len(owed)} refunds recorded as owed, expected D1's alone")
    if script.refusals != 1 or script.refunds != 1:
        problems.append(f"{script.refusals} refusals and {script.refunds} refunds, expected 1 each")
    return problems


def _summary(script: _Script, problems: list[str]) -> Table:
    counts = dict.fromkeys(OrderStatus, 0)
    for order_id in script.expected:
        counts[script.service.get_order(order_id).status] += 1
    table = Table("", "count", title="summary (from SQL)")
    for status, count in counts.items():
        table.add_row(status.value, str(count))
    table.add_row("refused at the limit", str(script.refusals))
    table.add_row("late payments refunded", str(script.refunds))
    table.add_row("checks", "[green]passed[/green]" if not problems else "[red]FAILED[/red]")
    return table


def run_demo(*, fast: bool = False, console: Console | None = None) -> int:
    """Run the demo; 0 if the stores agree with the script at the end, else 1.

    Without a redis-server to start it raises (:class:`~orders.errors.RedisServerMissing`,
    one line and exit 8 from the CLI) before it makes its home or prints anything."""
    console = console or Console()
    given_home = os.environ.get("ORDERS_HOME")
    if given_home:
        check_can_start(Path(given_home))
    else:
        usable_redis_server()
    home = Path(given_home) if given_home else Path(tempfile.mkdtemp(prefix="orders-demo-"))
    server_was_running = redis_status(home) is not None
    # Always the embedded stores: a demo must not write into a real database.
    settings = Settings(home=home, unpaid_limit=3, sweep_interval_s=0.25, lease_ttl_s=2)
    console.print(f"orders demo: embedded stores in {home}")
    try:
        return _run(build_service(settings), console, 0.5 if fast else 1.0)
    except OrdersError as error:
        console.print(f"[red]error:[/red] {error}")
        return 1
    finally:
        if not server_was_running:
            stop_redis(home)
        if not given_home:
            shutil.rmtree(home, ignore_errors=True)


def _run(service: OrderService, console: Console, scale: float) -> int:
    from orders.scheduler.jobs import build_scheduler  # noqa: PLC0415
    from orders.scheduler.sweeper import Sweeper  # noqa: PLC0415

    script = _Script(service, console, scale)
    sweep_log = logging.getLogger("orders.sweeper")
    handler = _SweepLog(script)
    sweep_log.addHandler(handler)
    sweep_log.propagate = False
    level = sweep_log.level
    sweep_log.setLevel(logging.DEBUG)
    sweeper = Sweeper(service)
    scheduler = build_scheduler(sweeper, blocking=False)
    scheduler.start()
    try:
        start = time.monotonic()
        deadline = start + 20
        with Live(_view(script), console=console, refresh_per_second=8) as live:
            for at_s, step in _steps(script):
                while time.monotonic() < start + at_s * scale:
                    live.update(_view(script))
                    time.sleep(0.05)
                step()
            while service.count_due() or _open(script):
                if time.monotonic() > deadline:
                    break
                live.update(_view(script))
                time.sleep(0.05)
            live.update(_view(script))
    finally:
        sweeper.request_stop()
        scheduler.shutdown(wait=True)
        sweeper.close()
        sweep_log.removeHandler(handler)
        sweep_log.propagate = True
        sweep_log.setLevel(level)
    problems = _check(script)
    console.print()
    console.print(_summary(script, problems))
    for problem in problems:
        console.print(f"[red]check failed:[/red] {problem}")
    try:
        return 1 if problems else 0
    finally:
        service.engine.dispose()
        service.index.client.close()


def _open(script: _Script) -> bool:
    return any(script.service.get_order(o).status is OrderStatus.UNPAID for o in script.expected)
