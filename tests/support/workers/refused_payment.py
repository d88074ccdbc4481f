"""A payment callback that dies with a refused payment: right after the refusal, or in the
middle of the transaction that records it.

Started by the crash tests as ``python -m tests.support.workers.refused_payment MODE
CONFIG_JSON`` with the test's stores in ``ORDERS_DATABASE_URL`` and ``ORDERS_REDIS_URL``,
through :class:`tests.support.processes.ChildProcess` with ``talk=True``. ``CONFIG_JSON``:
``{"order_id", "user_id", "ttl_s", "payment_ref", "start_ms"}``. The service runs on a
manual clock set to ``start_ms``.

1. It creates the order and prints ``READY``; the test closes the order meanwhile (a sweep
   on its own clock).
2. On ``GO {"now_ms": ...}`` it moves its clock there and calls ``mark_paid`` once. Then
   ``MODE``:

   * ``after-refusal``: in its ``except OrderClosed`` handler, where a real callback would
     issue the refund, it prints ``{"refusal": [txid, event_id]}`` (flushed) and SIGKILLs
     itself;
   * ``at-insert:TABLE``: an ``after_cursor_execute`` listener on its engine SIGKILLs it
     as soon as a statement inserting into TABLE has run, inside the refusal's
     transaction, before its commit; it prints ``{"killed_after": TABLE}`` first.

Whatever else happens (the payment returns, another error) is printed as one JSON line and
the process exits 1, so the test can tell it did not die where it should have.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from sqlalchemy import event

from orders.bootstrap import build_service
from orders.config import Settings
from orders.errors import OrderClosed
from tests.support.clocks import ManualClock

AFTER_REFUSAL = "after-refusal"
AT_INSERT = "at-insert:"


def say(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_after_insert_into(engine: Any, table: str) -> None:
    """SIGKILL this process right after the database ran an INSERT into ``table`` (a
    statement that is one: on PostgreSQL a transition's UPDATE also names the events table,
    in the INSERT of its CTE)."""
    prefix = f"INSERT INTO {table} "

    def after(_conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.lstrip().startswith(prefix):
            say({"killed_after": table})
            die()

    event.listen(engine, "after_cursor_execute", after)


def main(argv: list[str]) -> int:
    mode, config = argv[0], json.loads(argv[1])
    clock = ManualClock(config["start_ms"])
    service = build_service(Settings.from_env(), clock=clock)
    service.create_unpaid_order(
        config["user_id"], order_id=config["order_id"], ttl_s=config["ttl_s"]
    )
    print("READY", flush=True)
    line = sys.stdin.readline()
    if not line.startswith("GO"):
        say({"error": f"expected GO, got {line[:40]!r}"})
        return 1
    clock.set(json.loads(line[2:])["now_ms"])
    if mode.startswith(AT_INSERT):
        kill_after_insert_into(service.engine, mode.removeprefix(AT_INSERT))
    try:
        order = service.mark_paid(
            config["order_id"], payment_ref=config["payment_ref"], actor="psp-webhook"
        )
    except OrderClosed as refused:
        if mode == AFTER_REFUSAL and refused.refusal is not None:
            say({"refusal": list(refused.refusal)})
            die()  # before the refund is issued
        say({"error": f"refused without dying: {refused!r} (refusal {refused.refusal})"})
        return 1
    say({"error": f"the payment returned the order, {order.status.value}"})
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
