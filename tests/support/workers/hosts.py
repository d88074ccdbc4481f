"""Processes that play the hosts of one deployment, each on a clock of its own.

Started as ``python -m tests.support.workers.hosts MODE CONFIG_JSON`` through
:func:`tests.support.processes.started` (same protocol: ``READY``, then ``GO``, then the
counts as the last stdout line; ``STOP`` on stdin ends the loops). Its Settings come from the
environment (``ORDERS_DATABASE_URL``, ``ORDERS_REDIS_URL`` and whatever else the test passes
through, ``ORDERS_REDIS_CLUSTER`` included), so a test may point it at any Redis.

Each process's service reads the system clock plus ``offset_ms`` from its config: a host
whose clock is that far ahead (or, negative, behind). Times the test compares across
processes (``*_s`` fields) are the system clock, the "true" time every process shares here.

Modes:

``checkout``   creator threads make orders for a few shared users (ids ``<name>-<n>``) until
               ``run_s`` has passed; a payer pays a share of them near their expiry, as
               this host's clock reads it. Reports every acknowledged create and payment,
               every refused payment, and the orders this process closed to make room for
               a create (the ``slot_reuse`` closes).
``scheduler``  the scheduler's sweeper in APScheduler (what ``orders scheduler`` runs), until
               ``STOP``; every tick is appended to ``ticks_path`` as one JSON line (start,
               end, whether it held the lease), flushed at once, so a test reads them even
               after a SIGKILL.
"""

from __future__ import annotations

import heapq
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import IO, Any

from orders.bootstrap import build_service
from orders.config import Settings
from orders.domain import Clock
from orders.errors import OrderClosed, UnpaidOrderLimitReached
from orders.scheduler.jobs import build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.slots import SLOT_REUSE
from orders.sql.transitions import CLOSE_ALL_EXPIRED, CompareAndSet
from tests.support.clocks import now_ms
from tests.support.tally import Tally, run_threads
from tests.support.workers.protocol import close_service, stop_on_stdin

MODULE = "tests.support.workers.hosts"


def skewed_clock(offset_ms: int) -> Clock:
    """The system clock in integer milliseconds, ``offset_ms`` ahead (behind if negative)."""

    def clock() -> int:
        return now_ms() + offset_ms

    return clock


# --- checkout --------------------------------------------------------------------------------


def record_slot_reuse_closes(tally: Tally) -> None:
    """Note each order this process's creates close to take its slot (instrumentation only:
    the wrapped call is the same, its result passed on). The SQL guard closes them with
    ``CLOSE_ALL_EXPIRED`` itself (``orders.sql.slots``), so the hook is on the transition, for
    this whole process (a worker holds one service)."""
    run_all = CompareAndSet.run_all

    def recording(
        self: CompareAndSet,
        conn: Any,
        params: Mapping[str, Any],
        data: dict[str, Any] | None,
        actor: Any,
    ) -> Any:
        rows = run_all(self, conn, params, data, actor)
        if self is CLOSE_ALL_EXPIRED and data == SLOT_REUSE:
            for row in rows:
                tally.append("slot_reuse_closed", row.id)
        return rows

    CompareAndSet.run_all = recording  # type: ignore[method-assign]


def checkout(service: OrderService, cfg: dict[str, Any], _stop: threading.Event) -> Tally:
    name, users, limit = cfg["name"], cfg["users"], cfg["limit"]
    ttl_lo, ttl_hi = cfg["ttl_ms"]
    tally = Tally(name=name, created={}, paid={}, pay_refused={}, refused=0)
    record_slot_reuse_closes(tally)
    ends = time.monotonic() + cfg["run_s"]
    to_pay: list[tuple[int, str]] = []
    lock = threading.Lock()
    creators_done = threading.Event()
    remaining = [cfg["threads"]]

    def creator(number: int) -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-{number}")
        n = 0
        try:
            while time.monotonic() < ends:
                time.sleep(rng.uniform(*cfg["pause_s"]))
                oid, n = f"{name}-{number}-{n}", n + 1
                user = rng.choice(users)
                try:
                    order = service.create_unpaid_order(
                        user, order_id=oid, ttl_s=rng.randint(ttl_lo, ttl_hi) / 1000, limit=limit
                    )
                except UnpaidOrderLimitReached:
                    tally.add("refused")
                    continue
                except Exception as exc:
                    tally.error("create", exc)
                    continue
                tally.put("created", oid, [user, order.expires_at_ms])
                if rng.random() < cfg["pay_share"]:
                    # Near the expiry as this host reads it: some payments race the closes.
                    at = order.expires_at_ms + rng.randint(*cfg["pay_around_ms"])
                    with lock:
                        heapq.heappush(to_pay, (at, oid))
        finally:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    creators_done.set()

    def payer() -> None:
        while True:
            with lock:
                item = heapq.heappop(to_pay) if to_pay else None
            if item is None:
                if creators_done.is_set():
                    return
                time.sleep(0.005)
                continue
            at, oid = item
            delay_ms = at - service.clock()
            if delay_ms > 0:
                time.sleep(delay_ms / 1000)
            ref = f"{name}-pay-{oid}"
            try:
                paid = service.mark_paid(oid, payment_ref=ref)
            except OrderClosed as exc:
                tally.put("pay_refused", oid, exc.status)
            except Exception as exc:
                tally.error("mark_paid", exc)
            else:
                tally.put("paid", oid, paid.payment_ref)

    run_threads([*(lambda n=n: creator(n) for n in range(cfg["threads"])), payer], tally)
    return tally


# --- scheduler -------------------------------------------------------------------------------


class RecordingSweeper(Sweeper):
    """The production sweeper; each tick is also written to ``ticks`` as one JSON line."""

    def __init__(self, service: OrderService, ticks: IO[str], **options: Any) -> None:
        super().__init__(service, **options)
        self.ticks = ticks

    def tick(self) -> float:
        started = time.time()
        delay = super().tick()
        line = {
            "start_s": started,
            "end_s": time.time(),
            "held": self.holds_lease,
            "next_s": round(delay, 4),
        }
        self.ticks.write(json.dumps(line) + "\n")
        self.ticks.flush()  # the page cache outlives a SIGKILL of this process
        return delay


def scheduler(service: OrderService, cfg: dict[str, Any], stop: threading.Event) -> Tally:
    tally = Tally(name=cfg["name"])
    with open(cfg["ticks_path"], "a", encoding="utf-8") as ticks:
        sweeper = RecordingSweeper(
            service, ticks, interval_s=cfg["interval_s"], lease_ttl_s=cfg["lease_ttl_s"]
        )
        tally.data["owner"] = sweeper.owner
        running = build_scheduler(sweeper, blocking=True)
        threading.Thread(target=lambda: (stop.wait(), sweeper.request_stop()), daemon=True).start()
        try:
            running.start()  # returns once the stop request is seen
        finally:
            sweeper.close()
    return tally


Mode = Callable[[OrderService, dict[str, Any], threading.Event], Tally]


def serve(argv: list[str], modes: dict[str, Mode]) -> int:
    """The worker protocol around ``modes[MODE](service, config, stop)``; ``stop`` is set by
    ``STOP`` or the end of stdin (so a mode that must run to its own end ignores it)."""
    mode, config = argv[0], json.loads(argv[1])
    if mode not in modes:
        print(f"unknown mode {mode!r}", file=sys.stderr)
        return 2
    clock = skewed_clock(config.get("offset_ms", 0))
    service = build_service(Settings.from_env(), clock=clock)
    try:
        print("READY", flush=True)
        if not sys.stdin.readline().startswith("GO"):
            return 2
        tally = modes[mode](service, config, stop_on_stdin())
        tally.data["pid"] = os.getpid()
        print(json.dumps(tally.data), flush=True)
        return 0
    finally:
        close_service(service)


if __name__ == "__main__":
    # A checkout ends on its own (stdin closes when the test collects its result).
    sys.exit(serve(sys.argv[1:], {"checkout": checkout, "scheduler": scheduler}))
