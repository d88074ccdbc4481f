"""A host process SIGKILLed at the end of its own transaction, around the Redis follow-up of
a ``connection=`` call (``tests/support/workers/host_crash.py`` stops it there): what each
moment leaves in the two stores, and what puts it right.

The service hears the host's end through SQLAlchemy's ``commit`` and ``rollback`` events,
which come before the database's COMMIT or ROLLBACK; a kill there means the database never
committed (the server rolls back the dead connection's transaction). So:

* a payment killed after its Redis follow-up leaves an unpaid order with no member: Redis
  under-counts, and the next admission at the limit is refused by the SQL slot guard, which
  writes the member back; reconcile would too;
* a payment killed before it leaves both stores as they were;
* a create killed before its compensation (rollback) or before its COMMIT leaves a member
  with no row: its user is refused by Redis until the create is :data:`SUSPECT_AFTER_MS`
  old; then a refusal (in any process) finds no row and no transaction holding the order,
  removes the member and admits, and reconcile counts it abandoned, not in flight.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from orders.config import Settings
from orders.domain import system_clock
from orders.errors import UnpaidOrderLimitReached
from orders.index.admissions import SUSPECT_AFTER_MS
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.host_app import members, sql_status
from tests.support.processes import ChildProcess, child_env

MARKER_TIMEOUT_S = 60
#: How long the database may take to see a killed client's connection closed.
DEAD_CONNECTION_SEEN_S = 10


def kill_at_the_stop(
    mode: str, order_id: str, database_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Run the host worker in ``mode`` until it stops, then SIGKILL it by its PID."""
    marker = tmp_path / "stopped"
    worker = ChildProcess(
        ["-m", "tests.support.workers.host_crash", str(marker), mode, order_id, "u1"],
        child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url),
        tmp_path / "worker.log",
    )
    worker.kill_at_marker(marker, MARKER_TIMEOUT_S)


@pytest.fixture
def kill_at(database_url: str, redis_url: str, tmp_path: Path) -> Callable[[str, str], None]:
    """``kill_at(mode, order_id)``: :func:`kill_at_the_stop` on the test's stores."""
    return lambda mode, order_id: kill_at_the_stop(
        mode, order_id, database_url, redis_url, tmp_path
    )


@pytest.fixture
def service(engine: Engine, redis_client: redis.Redis, database_url: str) -> OrderService:
    """The service after the crash, on a clock the test moves from the wall clock's now."""
    clock = ManualClock(system_clock())
    return OrderService(engine, redis_client, Settings(database_url=database_url), clock=clock)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["pay", "pay-first"])
def test_payment_killed_around_its_redis_follow_up_is_put_right_by_the_next_admission(
    service: OrderService, engine: Engine, kill_at: Callable[[str, str], None], mode: str
) -> None:
    order = service.create_unpaid_order("u1", limit=1)
    kill_at(mode, order.id)
    assert sql_status(engine, order.id) == "unpaid"  # the COMMIT never happened
    # "pay": the member had left already (Redis under-counts); "pay-first": as it was.
    assert members(service, "u1") == (set() if mode == "pay" else {order.id})
    with pytest.raises(UnpaidOrderLimitReached) as refused:
        service.create_unpaid_order("u1", limit=1)
    # Under-counted, Redis admitted: the SQL slot guard refused, and wrote the member back.
    assert refused.value.source == ("sql" if mode == "pay" else "redis")
    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    assert service.reconcile().fixes == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["create-rollback", "create-commit"])
def test_create_killed_in_its_host_transaction_frees_its_users_slot_seconds_after_its_start(
    service: OrderService, engine: Engine, kill_at: Callable[[str, str], None], mode: str
) -> None:
    clock = service.clock
    assert isinstance(clock, ManualClock)
    kill_at(mode, "crashed-1")
    assert sql_status(engine, "crashed-1") is None
    assert members(service, "u1") == {"crashed-1"}
    started_ms = service.index.admission_starts([("u1", "crashed-1")])[("u1", "crashed-1")]

    clock.set(started_ms + SUSPECT_AFTER_MS - 1)  # it may still be between its two steps
    with pytest.raises(UnpaidOrderLimitReached) as refused:
        service.create_unpaid_order("u1", limit=1)
    assert refused.value.source == "redis"
    dry = service.reconcile(dry_run=True)
    assert (dry.kept_in_flight, dry.removed_abandoned) == (1, 0)

    clock.set(started_ms + SUSPECT_AFTER_MS)
    # The server rolls the dead connection back once it sees it closed: a moment at most.
    deadline = time.monotonic() + DEAD_CONNECTION_SEEN_S
    while (dry := service.reconcile(dry_run=True)).kept_in_flight:
        assert time.monotonic() < deadline, "the killed transaction still looks alive"
        time.sleep(0.01)
    assert (dry.kept_in_flight, dry.removed_abandoned) == (0, 1)
    order = service.create_unpaid_order("u1", limit=1)  # any process: this one never saw it
    assert members(service, "u1") == {order.id}
    assert service.reconcile().fixes == 0
