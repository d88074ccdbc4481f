"""A checkout-and-sweeper process that keeps working while PostgreSQL is restarted under it.

Started through :func:`tests.support.processes.started` with
``module="tests.support.workers.pg"`` and mode ``load`` (same protocol: ``READY``, ``GO``,
``STOP``, the counts as the last stdout line). Its Settings come from the environment.

Creator threads create orders (ids ``<name>-<thread>-<n>``, a few users, short TTLs), a
payer pays a share of them before their expiry, and a sweeper thread calls
``sweep_expired`` in a loop, all until ``STOP``. Each result the service acknowledged
(returned without an exception) is appended to ``acks_path`` as one JSON line, flushed and
fsynced before the next call, so the file is what a caller was told, in order:

* ``{"op": "create", "id", "user", "expires_at_ms"}``;
* ``{"op": "pay", "id", "ref"}``;
* ``{"op": "close", "closed": [[user_id, expires_at_ms, closed_at_ms], ...]}``: the orders
  each batch of an acknowledged sweep closed (read from the batch close's own return);
* ``{"op": "combined", "creates": n}``: with ``ORDERS_COMBINE_CREATES``, how many creates
  ran in batches so far; ``{"op": "combined", "transitions": n}``, the same for the
  payments with ``ORDERS_COMBINE_TRANSITIONS`` (``payers`` threads pay, 1 by default).

Every call is timed. The counts report, per operation, the calls, the failures by
exception type (``StoreUnavailable`` is the expected one), the longest call, and the
system-clock instants of the last failure and of the first success after it.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from orders.domain import SWEEPER
from orders.errors import OrderClosed, StoreUnavailable, UnpaidOrderLimitReached
from orders.service import OrderService
from tests.support.tally import Tally, run_threads
from tests.support.workers.hosts import serve

MODULE = "tests.support.workers.pg"


class AckLog:
    """Appends acknowledged results, one fsynced JSON line each (thread-safe)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.stream.write(json.dumps(record) + "\n")
            self.stream.flush()
            os.fsync(self.stream.fileno())


class CallLog:
    """Times each call of one operation and sorts its outcome."""

    def __init__(self, tally: Tally, op: str) -> None:
        self.tally, self.op = tally, op
        self.lock = threading.Lock()
        self.last_failure_s: float | None = None
        self.first_success_after_s: float | None = None
        tally.put("ops", op, {"calls": 0, "ok": 0, "failed": {}, "longest_s": 0.0})

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        expected: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> tuple[bool, Any]:
        """``fn(*args, **kwargs)``: (True, result) on success, else (False, exception).
        StoreUnavailable and the ``expected`` (business) exceptions are outcomes; any other
        is counted as an error too."""
        started = time.time()
        try:
            result = fn(*args, **kwargs)
        except (StoreUnavailable, *expected) as exc:
            self._done(started, exc)
            return False, exc
        except Exception as exc:
            self._done(started, exc)
            self.tally.error(self.op, exc)
            return False, exc
        self._done(started, None)
        return True, result

    def _done(self, started: float, exc: BaseException | None) -> None:
        ended = time.time()
        with self.lock:
            data = self.tally.data["ops"][self.op]
            data["calls"] += 1
            data["longest_s"] = max(data["longest_s"], round(ended - started, 4))
            if exc is None:
                data["ok"] += 1
                if self.last_failure_s is not None and self.first_success_after_s is None:
                    self.first_success_after_s = ended
            elif not isinstance(exc, OrderClosed | UnpaidOrderLimitReached):
                name = type(exc).__name__
                data["failed"][name] = data["failed"].get(name, 0) + 1
                self.last_failure_s, self.first_success_after_s = ended, None
            data["last_failure_s"] = self.last_failure_s
            data["first_success_after_s"] = self.first_success_after_s
            data["last_ok_s"] = ended if exc is None else data.get("last_ok_s")


def load(service: OrderService, cfg: dict[str, Any], stop: threading.Event) -> Tally:
    name = cfg["name"]
    tally = Tally(name=name, ops={}, sweep_redis_errors=0)
    acks_file = open(cfg["acks_path"], "a", encoding="utf-8")  # noqa: SIM115
    acks = AckLog(acks_file)
    creates, pays, sweeps = CallLog(tally, "create"), CallLog(tally, "pay"), CallLog(tally, "sweep")
    to_pay: list[str] = []
    lock = threading.Lock()

    def creator(number: int) -> None:
        rng = random.Random(f"{name}-{number}")
        n = 0
        while not stop.wait(rng.uniform(0.002, 0.01)):
            oid, n = f"{name}-{number}-{n}", n + 1
            user = f"{name}-user-{rng.randrange(cfg['users'])}"
            ttl_s = rng.uniform(*cfg["ttl_s"])
            ok, order = creates.call(
                service.create_unpaid_order,
                user,
                order_id=oid,
                ttl_s=ttl_s,
                limit=cfg["limit"],
                expected=(UnpaidOrderLimitReached,),
            )
            if ok:
                expires = order.expires_at_ms
                acks.write({"op": "create", "id": oid, "user": user, "expires": expires})
                if rng.random() < cfg["pay_share"]:
                    with lock:
                        to_pay.append(oid)

    def payer() -> None:
        while not stop.wait(0.005):
            while not stop.is_set():
                with lock:
                    if not to_pay:
                        break
                    oid = to_pay.pop(0)
                ref = f"{name}-pay-{oid}"
                ok, _ = pays.call(service.mark_paid, oid, payment_ref=ref, expected=(OrderClosed,))
                if ok:
                    acks.write({"op": "pay", "id": oid, "ref": ref})

    # The orders each batch closed, from the batch close's own return (instrumentation:
    # the same call, its result passed on); written once the sweep call returns.
    batches: list[list[Any]] = []
    close_due = service.sweep.closer.close_due

    def recording(cutoff_ms: int, size: int, closed_at_ms: int, actor: Any = SWEEPER) -> Any:
        rows = close_due(cutoff_ms, size, closed_at_ms, actor)
        batches.append([[user, expires, closed_at_ms] for user, expires, *_ in rows])
        return rows

    service.sweep.closer.close_due = recording  # type: ignore[method-assign]

    combiner = service.combiner
    queue = service.transitions.queue
    seen_combined = [0, 0]

    def sweeper() -> None:
        while not stop.wait(0.02):
            if combiner is not None and combiner.stats.combined != seen_combined[0]:
                # How many creates ran in batches so far (ORDERS_COMBINE_CREATES).
                seen_combined[0] = combiner.stats.combined
                acks.write({"op": "combined", "creates": seen_combined[0]})
            if queue is not None and queue.stats.combined != seen_combined[1]:
                seen_combined[1] = queue.stats.combined  # ORDERS_COMBINE_TRANSITIONS
                acks.write({"op": "combined", "transitions": seen_combined[1]})
            batches.clear()
            ok, swept = sweeps.call(service.sweep_expired)
            if ok:  # batches closed in SQL whose Redis cleanup failed
                tally.add("sweep_redis_errors", swept.redis_errors)
            closed = [row for batch in batches for row in batch]
            if ok and closed:
                acks.write({"op": "close", "closed": closed})

    try:
        creators = [lambda n=n: creator(n) for n in range(cfg["threads"])]
        payers = [payer] * cfg.get("payers", 1)
        run_threads([*creators, *payers, sweeper], tally)
    finally:
        acks_file.close()
    return tally


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], {"load": load}))
