"""The load worker of the concurrency tests, on the synchronous OrderService.

Started through :func:`tests.support.processes.started` (``python -m
tests.support.workers.sync MODE CONFIG_JSON``, the protocol that module describes) with the
repository root as its working directory and the test's stores in ``ORDERS_DATABASE_URL``
and ``ORDERS_REDIS_URL`` (every other ``ORDERS_*`` variable stripped). It runs on the system
clock, like a real checkout or scheduler process. ``STOP`` ends a ``sweep`` worker's loop;
the other modes end on their own (their helpers stop when their creators or schedules are
done).

Modes:

``contend``  16 creator threads (configurable) make ``attempts`` create attempts for one
             user in bursts aligned on wall-clock ticks, so the attempts of every process
             arrive together; a payer, a canceller and a sweeper thread work alongside
             until the creators are done.
``pay``      pays a schedule of orders (``GO`` payload), each at its own wall-clock instant,
             from several threads, and reports every outcome.
``sweep``    calls ``sweep_expired`` in a loop until told to stop.
``drain``    calls ``sweep_expired(batch_size=...)`` in a loop until nothing is due.
``create``   creator threads create orders (a user each) until ``refusals`` creates were
             refused with StoreUnavailable, recording every outcome with its times; prints
             ``CREATED <n>`` on stderr when the ``report_at``-th create succeeds.

Every worker also has a deadline: past it, loops end and the shortfall shows in the counts.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tests.support.clocks import now_ms, sleep_until_ms
from tests.support.tally import Tally, bucket, run_threads, split
from tests.support.workers.protocol import close_service, stop_on_stdin

MODULE = "tests.support.workers.sync"


def contend(service: Any, cfg: dict[str, Any], stop: threading.Event, deadline: float) -> Tally:
    from orders.domain import OrderStatus  # noqa: PLC0415
    from orders.errors import (  # noqa: PLC0415
        OrderAlreadyPaid,
        OrderClosed,
        UnpaidOrderLimitReached,
    )
    from orders.sql.records import LimitReachedInSql  # noqa: PLC0415

    name, user, limit = cfg["name"], cfg["user"], cfg["limit"]
    ttl_lo, ttl_hi = cfg["ttl_ms"]
    tick_ms, pace_ticks = cfg["tick_ms"], cfg["pace_ticks"]
    tally = Tally(
        name=name,
        attempts=0,
        admitted=0,
        refused=0,
        paid=0,
        cancelled=0,
        closed=0,
        pay_lost=0,
        cancel_lost=0,
        sweeps=0,
        sweep_redis_errors=0,
        sql_refused=0,
        admitted_ids=[],
        paid_refs={},
        cancelled_ids=[],
    )
    guard = service.records.insert_guarded

    def counted_guard(*args: Any, **kwargs: Any) -> Any:
        # Count the refusals that came from the SQL guard rather than from Redis.
        try:
            return guard(*args, **kwargs)
        except LimitReachedInSql:
            tally.add("sql_refused")
            raise

    service.records.insert_guarded = counted_guard
    creators_done = threading.Event()
    remaining = [cfg["threads"]]
    lock = threading.Lock()

    def creator(number: int, attempts: int) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random(f"{cfg['seed']}-{name}-{number}")
            try:
                for _ in range(attempts):
                    if time.monotonic() > deadline:
                        tally.error("creator", "deadline passed")
                        return
                    # Sleep to a tick boundary a random number of ticks ahead: every thread
                    # of every process fires on the same boundaries, in bursts.
                    ticks = rng.randint(1, 2 * pace_ticks - 1)
                    sleep_until_ms((now_ms() // tick_ms + ticks) * tick_ms)
                    ttl_ms = rng.randint(ttl_lo, ttl_hi)
                    tally.add("attempts")
                    try:
                        order = service.create_unpaid_order(user, ttl_s=ttl_ms / 1000, limit=limit)
                    except UnpaidOrderLimitReached as exc:
                        tally.add("refused")
                        if exc.limit != limit or exc.open_count < limit:
                            tally.error("create", f"refused with {exc.open_count} of {exc.limit}")
                    except Exception as exc:
                        tally.error("create", exc)
                    else:
                        tally.add("admitted")
                        tally.append("admitted_ids", order.id)
                        if (
                            order.user_id != user
                            or order.status is not OrderStatus.UNPAID
                            or order.expires_at_ms - order.created_at_ms != ttl_ms
                        ):
                            tally.error("create", f"odd order returned: {order!r}")
            finally:
                with lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        creators_done.set()

        return run

    def payer() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-payer")
        while not creators_done.wait(rng.uniform(*cfg["pay_every_s"])):
            try:
                listed = service.list_unpaid(user)
            except Exception as exc:
                tally.error("list_unpaid", exc)
                continue
            for order in listed:
                if bucket(order.id) != "pay":
                    continue
                ref = f"{name}-pay-{order.id}"
                try:
                    result = service.mark_paid(order.id, payment_ref=ref)
                except (OrderAlreadyPaid, OrderClosed):
                    tally.add("pay_lost")
                except Exception as exc:
                    tally.error("mark_paid", exc)
                else:
                    if result.status is not OrderStatus.PAID or result.payment_ref != ref:
                        tally.error("mark_paid", f"odd order returned: {result!r}")
                    tally.add("paid")
                    tally.put("paid_refs", order.id, ref)

    def canceller() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-canceller")
        reason = f"{name}-cancel"
        while not creators_done.wait(rng.uniform(*cfg["cancel_every_s"])):
            try:
                listed = service.list_unpaid(user)
            except Exception as exc:
                tally.error("list_unpaid", exc)
                continue
            for order in listed:
                if bucket(order.id) != "cancel":
                    continue
                try:
                    result = service.cancel_order(order.id, reason=reason)
                except (OrderAlreadyPaid, OrderClosed):
                    tally.add("cancel_lost")
                except Exception as exc:
                    tally.error("cancel_order", exc)
                else:
                    if result.status is not OrderStatus.CANCELLED:
                        tally.error("cancel_order", f"odd order returned: {result!r}")
                    elif result.close_reason == reason:  # ours won (not another canceller's)
                        tally.add("cancelled")
                        tally.append("cancelled_ids", order.id)
                    else:
                        tally.add("cancel_lost")

    def sweeper() -> None:
        rng = random.Random(f"{cfg['seed']}-{name}-sweeper")
        while not creators_done.wait(rng.uniform(*cfg["sweep_every_s"])):
            try:
                result = service.sweep_expired()
            except Exception as exc:
                tally.error("sweep_expired", exc)
                continue
            tally.add("sweeps")
            tally.add("closed", result.closed)
            tally.add("sweep_redis_errors", result.redis_errors)

    per_thread = split(cfg["attempts"], cfg["threads"])
    targets = [creator(n, a) for n, a in enumerate(per_thread)]
    run_threads([*targets, payer, canceller, sweeper], tally)
    return tally


def pay(service: Any, cfg: dict[str, Any], payload: Any, deadline: float) -> Tally:
    """Pay each scheduled order at its instant; record what every call returned or raised."""
    from orders.domain import OrderStatus  # noqa: PLC0415
    from orders.errors import OrderClosed  # noqa: PLC0415

    schedule = sorted(payload["schedule"], key=lambda item: item["at_ms"])
    tally = Tally(name=cfg["name"], payments=0, paid=0, refused_closed=0, outcomes={})
    lock = threading.Lock()
    position = [0]

    def next_item() -> dict[str, Any] | None:
        with lock:
            if position[0] >= len(schedule):
                return None
            item: dict[str, Any] = schedule[position[0]]
            position[0] += 1
            return item

    def payer() -> None:
        while (item := next_item()) is not None:
            if time.monotonic() > deadline:
                tally.error("payer", "deadline passed")
                return
            sleep_until_ms(item["at_ms"])
            oid, ref = item["order_id"], item["ref"]
            started_ms = now_ms()
            tally.add("payments")
            outcome: dict[str, Any]
            try:
                order = service.mark_paid(oid, payment_ref=ref)
            except OrderClosed as exc:
                outcome = {"outcome": "closed", "status": exc.status}
                tally.add("refused_closed")
            except Exception as exc:
                outcome = {"outcome": "error", "error": f"{type(exc).__name__}: {exc}"}
                tally.error("mark_paid", exc)
            else:
                outcome = {
                    "outcome": "paid",
                    "status": order.status.value,
                    "ref": order.payment_ref,
                }
                if order.status is not OrderStatus.PAID or order.payment_ref != ref:
                    tally.error("mark_paid", f"odd order returned: {order!r}")
                tally.add("paid")
            outcome["start_ms"] = started_ms
            outcome["end_ms"] = now_ms()
            tally.put("outcomes", oid, outcome)

    run_threads([payer] * cfg["threads"], tally)
    return tally


def sweep(service: Any, cfg: dict[str, Any], stop: threading.Event, deadline: float) -> Tally:
    """sweep_expired in a loop until STOP; counts what this process closed."""
    tally = Tally(name=cfg["name"], sweeps=0, closed=0, batches=0, redis_errors=0, max_lag_ms=0)
    rng = random.Random(cfg["name"])
    while not stop.is_set():
        if time.monotonic() > deadline:
            tally.error("sweeper", "deadline passed")
            break
        try:
            result = service.sweep_expired()
        except Exception as exc:
            tally.error("sweep_expired", exc)
        else:
            tally.add("sweeps")
            tally.add("closed", result.closed)
            tally.add("batches", result.batches)
            tally.add("redis_errors", result.redis_errors)
            if result.max_lag_ms is not None:
                tally.data["max_lag_ms"] = max(tally.data["max_lag_ms"], result.max_lag_ms)
        stop.wait(rng.uniform(*cfg["every_s"]))
    return tally


def drain(service: Any, cfg: dict[str, Any], deadline: float) -> Tally:
    """sweep_expired(batch_size=...) in a loop until a call closes nothing and none is due."""
    size = cfg["batch_size"]
    tally = Tally(name=cfg["name"], calls=0, closed=0, batches=0, redis_errors=0, idle_calls=0)
    started = time.monotonic()
    while True:
        if time.monotonic() > deadline:
            tally.error("drain", "deadline passed")
            break
        try:
            result = service.sweep_expired(batch_size=size)
        except Exception as exc:
            tally.error("sweep_expired", exc)
            continue
        tally.add("calls")
        tally.add("closed", result.closed)
        tally.add("batches", result.batches)
        tally.add("redis_errors", result.redis_errors)
        if result.closed == 0:
            # Nothing claimable: either all done, or the rest is locked by other sweepers.
            tally.add("idle_calls")
            if service.count_due() == 0:
                break
            time.sleep(0.005)
    tally.data["elapsed_s"] = round(time.monotonic() - started, 3)
    return tally


def create(service: Any, cfg: dict[str, Any], deadline: float) -> Tally:
    """Creates until ``refusals`` were refused as StoreUnavailable; every outcome recorded."""
    from orders.errors import StoreUnavailable  # noqa: PLC0415

    tally = Tally(name=cfg["name"], created=0, refused=0, outcomes=[])
    report_at = cfg.get("report_at", 20)
    reported = threading.Event()

    def creator(number: int) -> Callable[[], None]:
        def run() -> None:
            n = 0
            while tally.data["refused"] < cfg["refusals"] and time.monotonic() < deadline:
                n += 1
                outcome: dict[str, Any] = {"start_ms": now_ms()}
                try:
                    service.create_unpaid_order(f"{cfg['name']}-{number}-{n}")
                except StoreUnavailable as exc:
                    outcome.update(outcome="refused", store=exc.store, message=str(exc))
                    tally.add("refused")
                except Exception as exc:
                    outcome.update(outcome="error", message=f"{type(exc).__name__}: {exc}")
                    tally.error("create", exc)
                else:
                    outcome["outcome"] = "created"
                    tally.add("created")
                    if tally.data["created"] >= report_at and not reported.is_set():
                        reported.set()
                        print(f"CREATED {report_at}", file=sys.stderr, flush=True)
                outcome["end_ms"] = now_ms()
                tally.append("outcomes", outcome)

        return run

    run_threads([creator(n) for n in range(cfg["threads"])], tally)
    return tally


def main(argv: list[str]) -> int:
    mode, config = argv[0], json.loads(argv[1])
    from orders.bootstrap import build_service  # noqa: PLC0415
    from orders.config import Settings  # noqa: PLC0415

    settings = Settings.from_env(
        sql_pool_size=config.get("pool_size", 5),
        sql_max_overflow=config.get("max_overflow", 10),
        combine_creates=config.get("combine_creates", False),
        combine_transitions=config.get("combine_transitions", False),
    )
    service = build_service(settings)
    pool = service.engine.pool
    pool_capacity = pool.size() + getattr(pool, "_max_overflow", 0) if hasattr(pool, "size") else -1
    try:
        print("READY", flush=True)
        line = sys.stdin.readline()
        if not line.startswith("GO"):
            print(f"expected GO, got {line[:40]!r}", file=sys.stderr)
            return 2
        payload = json.loads(line[2:]) if line[2:].strip() else None
        stop = stop_on_stdin()
        deadline = time.monotonic() + config.get("deadline_s", 240)
        started = time.monotonic()
        if mode == "contend":
            tally = contend(service, config, stop, deadline)
        elif mode == "pay":
            tally = pay(service, config, payload, deadline)
        elif mode == "sweep":
            tally = sweep(service, config, stop, deadline)
        elif mode == "drain":
            tally = drain(service, config, deadline)
        elif mode == "create":
            tally = create(service, config, deadline)
        else:
            print(f"unknown mode {mode!r}", file=sys.stderr)
            return 2
        tally.data.setdefault("elapsed_s", round(time.monotonic() - started, 3))
        tally.data["pid"] = os.getpid()
        tally.data["pool_capacity"] = pool_capacity
        combiner = service.combiner
        tally.data["combined"] = 0 if combiner is None else combiner.stats.combined
        queue = service.transitions.queue
        tally.data["combined_transitions"] = 0 if queue is None else queue.stats.combined
        print(json.dumps(tally.data), flush=True)
        return 0
    finally:
        close_service(service)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
