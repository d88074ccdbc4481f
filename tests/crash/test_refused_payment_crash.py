"""A payment callback SIGKILLed around a refused payment (``tests/support/workers/
refused_payment.py`` kills itself at the moment the test names): what SQL holds afterwards.

The child creates an order; the test closes it with a sweep on its own clock; the child
then pays it, on a clock past the close, and is refused:

* killed in its ``except OrderClosed`` handler, before it could issue the refund: the
  refund owed is in SQL, found by :func:`orders.sql.refusals.list_refusals` on an engine
  alone, its ``payment_refused`` event at the position the child was told;
* killed inside the refusal's transaction, after its event's INSERT or after its refusal
  row's INSERT, before the COMMIT: nothing of it is left (the database rolls the dead
  connection's transaction back), and the payment provider's retry records the refusal
  exactly once.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders.domain import OrderStatus, RefusalReason
from orders.errors import OrderClosed
from orders.service import OrderService
from orders.sql.models import events_table, orders_table, refusals_table
from orders.sql.refusals import list_refusals
from tests.support.clocks import ManualClock
from tests.support.processes import ChildProcess, child_env

MODULE = "tests.support.workers.refused_payment"
READY_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 60
TTL_S = 60
ORDER_ID = "crash-order-1"
USER_ID = "u1"
PAYMENT_REF = "psp-late-1"

EC = events_table.c


def run_callback_until_killed(
    mode: str,
    service: OrderService,
    clock: ManualClock,
    database_url: str,
    redis_url: str,
    tmp_path: Path,
) -> dict[str, Any]:
    """Run the callback child in ``mode``: it creates the order, this process closes it by
    a sweep, the child pays it one second after the close and dies. Its last line."""
    config = {
        "order_id": ORDER_ID,
        "user_id": USER_ID,
        "ttl_s": TTL_S,
        "payment_ref": PAYMENT_REF,
        "start_ms": clock(),
    }
    worker = ChildProcess(
        ["-m", MODULE, mode, json.dumps(config)],
        child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url),
        tmp_path / "callback.log",
        name="callback",
        talk=True,
    )
    try:
        worker.wait_ready(time.monotonic() + READY_TIMEOUT_S)
        clock.advance(s=TTL_S)
        assert service.sweep_expired().closed == 1
        clock.advance(s=1)
        worker.go({"now_ms": clock()})
        out = worker.output_at_exit(EXIT_TIMEOUT_S).decode()
    finally:
        worker.close(signum=signal.SIGKILL)
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    if worker.proc.returncode != -signal.SIGKILL or not lines:
        raise worker.fail(f"did not die by SIGKILL where it should have; it said {lines}")
    last: dict[str, Any] = lines[-1]
    return last


@pytest.fixture
def killed_callback(
    service: OrderService, clock: ManualClock, database_url: str, redis_url: str, tmp_path: Path
) -> Callable[[str], dict[str, Any]]:
    """``killed_callback(mode)``: :func:`run_callback_until_killed` on the test's stores,
    ``service`` sweeping on ``clock``."""
    return lambda mode: run_callback_until_killed(
        mode, service, clock, database_url, redis_url, tmp_path
    )


def events_of(engine: Engine, order_id: str) -> list[Any]:
    query = select(events_table).where(EC.order_id == order_id).order_by(EC.id)
    with engine.connect() as conn:
        return list(conn.execute(query).all())


def status_of(engine: Engine, order_id: str) -> str:
    query = select(orders_table.c.status).where(orders_table.c.id == order_id)
    with engine.connect() as conn:
        return str(conn.execute(query).scalar_one())


def refusal_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(refusals_table)) or 0)


@pytest.mark.timeout(120)
def test_a_callback_killed_right_after_the_refusal_leaves_the_refund_owed_in_sql(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    killed_callback: Callable[[str], dict[str, Any]],
) -> None:
    said = killed_callback("after-refusal")
    paid_at_ms = clock()

    # From SQL alone: the refunds nobody has handled yet.
    [owed] = list_refusals(engine, pending_only=True)
    assert (owed.order_id, owed.user_id, owed.payment_ref) == (ORDER_ID, USER_ID, PAYMENT_REF)
    assert owed.reason is RefusalReason.CLOSED
    assert owed.refused_at_ms == paid_at_ms
    assert list(owed.position) == said["refusal"]
    kinds = [(e.kind, e.actor) for e in events_of(engine, ORDER_ID)]
    assert kinds == [("created", None), ("closed", None), ("payment_refused", "psp-webhook")]
    refused = events_of(engine, ORDER_ID)[-1]
    assert ((refused.txid or 0), refused.id) == owed.position
    assert refused.data == {"payment_ref": PAYMENT_REF, "reason": "closed"}
    assert status_of(engine, ORDER_ID) == OrderStatus.CLOSED.value

    # The provider retries the callback: the same refusal, nothing more written.
    with pytest.raises(OrderClosed) as again:
        service.mark_paid(ORDER_ID, payment_ref=PAYMENT_REF)
    assert again.value.refusal == owed.position
    assert refusal_count(engine) == 1
    # The refund consumer issues it and says so: no refund is owed any more.
    service.mark_refund_handled(ORDER_ID, PAYMENT_REF, actor="refund-worker")
    assert list_refusals(engine, pending_only=True) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("table", [events_table.name, refusals_table.name])
def test_a_callback_killed_inside_the_refusal_transaction_leaves_nothing_and_its_retry_is_one(
    service: OrderService,
    engine: Engine,
    clock: ManualClock,
    killed_callback: Callable[[str], dict[str, Any]],
    table: str,
) -> None:
    said = killed_callback(f"at-insert:{table}")

    assert said == {"killed_after": table}
    assert [e.kind for e in events_of(engine, ORDER_ID)] == ["created", "closed"]
    assert refusal_count(engine) == 0
    assert list_refusals(engine) == []
    assert status_of(engine, ORDER_ID) == OrderStatus.CLOSED.value

    # The provider retries: refused once, recorded once (and a second retry adds nothing).
    clock.advance(s=1)
    with pytest.raises(OrderClosed) as retried:
        service.mark_paid(ORDER_ID, payment_ref=PAYMENT_REF, actor="psp-webhook")
    with pytest.raises(OrderClosed) as again:
        service.mark_paid(ORDER_ID, payment_ref=PAYMENT_REF, actor="psp-webhook")
    [owed] = list_refusals(engine, pending_only=True)
    assert (owed.order_id, owed.payment_ref, owed.reason) == (
        ORDER_ID,
        PAYMENT_REF,
        RefusalReason.CLOSED,
    )
    assert owed.refused_at_ms == clock()
    assert retried.value.refusal == again.value.refusal == owed.position
    events = events_of(engine, ORDER_ID)
    assert [e.kind for e in events] == ["created", "closed", "payment_refused"]
    assert ((events[-1].txid or 0), events[-1].id) == owed.position
    assert status_of(engine, ORDER_ID) == OrderStatus.CLOSED.value
