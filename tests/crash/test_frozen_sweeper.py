"""A sweeper frozen in the middle of a batch (SIGSTOP: a GC pause, a stopped container) on
PostgreSQL, and the two timeouts that bound what any frozen holder of a lock costs.

1. A real ``orders scheduler`` process is stopped while its batch statement runs. The test
   stages the moment: a trigger on the events table makes the batch's ``closed`` events wait
   on an advisory lock the test holds, so the statement has claimed and closed its 500
   rows when it stops; the test sees it waiting in ``pg_stat_activity``, SIGSTOPs the
   process, then lets the statement finish on the server. A payment of one of those
   orders, a payment of a due order outside the batch and a create for a user whose slots
   were all in the batch must then each return at once (well within the lease), and a
   standby must finish the sweep while the frozen one is still stopped. After SIGCONT
   both processes stop cleanly and the stores agree: nothing closed twice, nothing both
   paid and closed, no member for a paid order. The frozen one's log does not read as a
   sweep by a scheduler that no longer held the lease: its sweep line, written after its
   ``lease_lost``, says that the lease was lost during it.
2. A transaction of the service's own engine left open (its process frozen between two
   statements) loses its locks after ``sql_idle_in_transaction_timeout_s``: a payment
   blocked behind it waits that long and then wins.
3. A lock held by a connection that is not the service's (a host's own transaction) is
   waited for at most ``sql_lock_timeout_s``: the payment fails as StoreUnavailable, nothing
   changed, and succeeds once the holder is gone.

Every process a test starts is stopped by its PID in a ``finally`` (SIGCONT first).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
import redis
from sqlalchemy import select, text, update
from sqlalchemy.engine import make_url

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.domain import system_clock
from orders.errors import OrderClosed, OrdersError, StoreUnavailable
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.processes import ChildProcess, child_env
from tests.support.stores import write_orders_as_of_old

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

OC, EC = orders_table.c, events_table.c
BATCH = 500
LEASE_TTL_S = 5.0
SCHEDULER_ARGS = [
    "-m", "orders", "-vv", "scheduler", "--interval", "0.5", "--batch-size", str(BATCH),
    "--lease-ttl", str(LEASE_TTL_S),
]  # fmt: skip
LEASE_ACQUIRED = '"event": "lease_acquired"'
#: The advisory lock the staging trigger waits on.
HOLD_KEY = 724_001
#: Users 0..199 hold slots 1..3 with the earliest expiries; 1,400 more due orders follow.
SLOTTED_USERS = 200
LIMIT = 3
MORE_DUE = 1400
#: What a call may take here when nothing makes it wait (a loaded 2-core machine).
PROMPT_S = LEASE_TTL_S / 2

T = TypeVar("T")


def libpq_dsn(database_url: str) -> str:
    """The test database as a libpq DSN, for a plain psycopg connection that is not the
    service's (none of the engine's session settings)."""
    url = make_url(database_url)
    parts = {"dbname": url.database, "user": url.username, "host": url.query.get("host")}
    parts.update({"host": url.host, "port": url.port} if url.host else {})
    if url.password:
        parts["password"] = url.password
    return " ".join(f"{k}={v}" for k, v in parts.items() if v)


@pytest.fixture
def outside(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection of the test's own, in autocommit, without the service's timeouts."""
    with psycopg.connect(libpq_dsn(database_url), autocommit=True) as conn:
        yield conn


def timed(call: Callable[[], T]) -> tuple[float, T | OrdersError]:
    """How long ``call`` took, and its result or the OrdersError it raised."""
    started = time.monotonic()
    try:
        outcome: T | OrdersError = call()
    except OrdersError as exc:
        outcome = exc
    return time.monotonic() - started, outcome


def wait_until(what: str, check: Callable[[], T | None], timeout_s: float) -> T:
    """Poll ``check`` until it answers something other than None, for at most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (found := check()) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)
    return found


def backend_waiting_on(conn: psycopg.Connection[Any], wait_event: str) -> int | None:
    row = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND wait_event = %s",
        (wait_event,),
    ).fetchone()
    return None if row is None else int(row[0])


def backend_state(conn: psycopg.Connection[Any], pid: int) -> str | None:
    row = conn.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
    return None if row is None else str(row[0])


def write_due_orders(service: OrderService) -> list[dict[str, Any]]:
    """Due unpaid orders with their ``created`` events and (expired) members, written as if
    created an hour ago. The first ``SLOTTED_USERS * LIMIT`` hold their users' slots."""
    now_ms = system_clock()
    orders = []
    for j in range(SLOTTED_USERS * LIMIT + MORE_DUE):
        slotted = j < SLOTTED_USERS * LIMIT
        expires_at_ms = now_ms - 60_000 + j
        orders.append(
            {
                "id": f"due-{j:05d}",
                "user_id": f"u{j % SLOTTED_USERS:03d}" if slotted else f"v{j % 50:02d}",
                "status": "unpaid",
                "slot": j // SLOTTED_USERS + 1 if slotted else None,
                "created_at_ms": expires_at_ms - 1_800_000,
                "expires_at_ms": expires_at_ms,
                "updated_at_ms": expires_at_ms - 1_800_000,
            }
        )
    write_orders_as_of_old(service, orders)
    return orders


def hold_closed_events_on(conn: psycopg.Connection[Any]) -> None:
    """Make every ``closed`` event's insert wait while the test holds ``HOLD_KEY``."""
    conn.execute(
        "CREATE FUNCTION test_hold_closes() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"PERFORM pg_advisory_xact_lock_shared({HOLD_KEY}); RETURN NEW; END $$"
    )
    conn.execute(
        f"CREATE TRIGGER test_hold_closes BEFORE INSERT ON {events_table.name} FOR EACH ROW "
        "WHEN (NEW.kind = 'closed') EXECUTE FUNCTION test_hold_closes()"
    )


def assert_sweep_after_lease_lost_says_so(log: str) -> None:
    """Each ``sweep`` line written after a ``lease_lost`` line carries ``lease_lost``."""
    events = [
        json.loads(line[line.index("{") :])
        for line in log.splitlines()
        if '"event": "sweep"' in line or '"event": "lease_lost"' in line
    ]
    kinds = [event["event"] for event in events]
    assert "lease_lost" in kinds, log[-3000:]
    after = [e for e in events[kinds.index("lease_lost") :] if e["event"] == "sweep"]
    assert after, log[-3000:]
    assert all(e.get("lease_lost") is True for e in after), after


def continue_and_close(child: ChildProcess) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child.pid, signal.SIGCONT)
    child.close(signum=signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_sweeper_frozen_mid_batch_holds_no_order_and_a_standby_finishes_the_sweep(
    database_url: str,
    redis_url: str,
    redis_client: redis.Redis,
    outside: psycopg.Connection[Any],
    tmp_path: Path,
) -> None:
    settings = Settings(database_url=database_url, unpaid_limit=LIMIT, lease_ttl_s=LEASE_TTL_S)
    engine = build_engine(settings)
    service = OrderService(engine, redis_client, settings)
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    env.pop("PYTHONWARNINGS", None)
    frozen = standby = None
    try:
        orders = write_due_orders(service)
        in_batch, outside_batch = orders[0], orders[BATCH + 50]
        assert outside_batch["slot"] == LIMIT  # its user's other slots are in the batch
        # A user all of whose slots are in the frozen batch (its first 500 expiries).
        crowded_user = orders[0]["user_id"]
        assert [o["slot"] for o in orders[:BATCH] if o["user_id"] == crowded_user] == [1, 2, 3]
        hold_closed_events_on(outside)
        outside.execute("SELECT pg_advisory_lock(%s)", (HOLD_KEY,))

        frozen = ChildProcess(SCHEDULER_ARGS, env, tmp_path / "frozen.log")
        frozen.wait_for(LEASE_ACQUIRED, 60)
        backend = wait_until(
            "the first batch waits on the staged lock",
            lambda: backend_waiting_on(outside, "advisory"),
            60,
        )
        os.kill(frozen.pid, signal.SIGSTOP)
        outside.execute("SELECT pg_advisory_unlock(%s)", (HOLD_KEY,))
        # The statement finishes on the server; the client that sent it is stopped.
        state = wait_until(
            "the frozen batch's statement ends on the server",
            lambda: s if (s := backend_state(outside, backend)) != "active" else None,
            30,
        )

        paid_in_batch = timed(lambda: service.mark_paid(in_batch["id"]))
        paid_outside = timed(lambda: service.mark_paid(outside_batch["id"]))
        created = timed(lambda: service.create_unpaid_order(crowded_user, order_id="fresh-1"))

        where = f"frozen sweeper's session: {state}"
        assert paid_in_batch[0] < PROMPT_S, (where, paid_in_batch)
        assert isinstance(paid_in_batch[1], OrderClosed), (where, paid_in_batch)
        assert paid_outside[0] < PROMPT_S, (where, paid_outside)
        assert not isinstance(paid_outside[1], OrdersError), (where, paid_outside)
        assert created[0] < PROMPT_S, (where, created)
        assert not isinstance(created[1], OrdersError), (where, created)

        # The standby takes over once the frozen one's lease lapses and sweeps the rest.
        standby = ChildProcess(SCHEDULER_ARGS, env, tmp_path / "standby.log")
        standby.wait_for(LEASE_ACQUIRED, 60)
        wait_until("the standby leaves nothing due", lambda: service.count_due() == 0 or None, 120)

        os.kill(frozen.pid, signal.SIGCONT)
        frozen.wait_for('"event": "sweep"', 60)
        for child in (frozen, standby):
            child.proc.send_signal(signal.SIGTERM)
            assert child.proc.wait(30) == 0, child.log()[-3000:]
        assert_sweep_after_lease_lost_says_so(frozen.log())
    finally:
        for child in (frozen, standby):
            if child is not None:
                continue_and_close(child)
        with contextlib.suppress(psycopg.Error):
            outside.execute("SELECT pg_advisory_unlock_all()")

    try:
        with engine.connect() as conn:
            status = dict(conn.execute(select(OC.id, OC.status)).all())
            kinds = Counter(conn.execute(select(EC.order_id, EC.kind)).all())
        paid = {outside_batch["id"]}
        assert {o for o, s in status.items() if s == "paid"} == paid
        assert status["fresh-1"] == "unpaid"
        assert Counter(status.values()) == {"closed": len(orders) - 1, "paid": 1, "unpaid": 1}
        for order in orders:
            oid = order["id"]
            terminal = "paid" if oid in paid else "closed"
            assert kinds[(oid, terminal)] == 1, oid
            assert kinds[(oid, "closed" if oid in paid else "paid")] == 0, oid
        members = service.index.members_of(sorted({o["user_id"] for o in orders}))
        assert outside_batch["id"] not in members[outside_batch["user_id"]]
        service.reconcile()
        members = service.index.members_of(sorted({o["user_id"] for o in orders}))
        assert {u: set(m) for u, m in members.items() if m} == {crowded_user: {"fresh-1"}}
    finally:
        engine.dispose()


def test_a_frozen_transaction_of_the_service_loses_its_locks_and_the_payment_wins(
    database_url: str, redis_client: redis.Redis, outside: psycopg.Connection[Any]
) -> None:
    idle_s, lock_s = 0.5, 10.0
    settings = Settings(
        database_url=database_url,
        sql_idle_in_transaction_timeout_s=idle_s,
        sql_lock_timeout_s=lock_s,
    )
    engine = build_engine(settings)
    try:
        service = OrderService(engine, redis_client, settings)
        order = service.create_unpaid_order("u1")
        holder = engine.connect()
        # A write of the service's engine, its process stopped before the COMMIT.
        holder.execute(update(orders_table).where(OC.id == order.id).values(updated_at_ms=1))
        took, paid = timed(lambda: service.mark_paid(order.id, payment_ref="p1"))
        assert not isinstance(paid, OrdersError), paid
        assert idle_s * 0.8 < took < lock_s / 2  # waited for the idle timeout, no longer
        assert service.get_order(order.id).status.value == "paid"
        with pytest.raises(Exception, match="idle-in-transaction"):  # the server ended it
            holder.execute(text("SELECT 1"))
        with contextlib.suppress(Exception):
            holder.close()
        state = outside.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle in transaction'"
        ).fetchone()
        assert state == (0,)
    finally:
        engine.dispose()


def test_a_payment_waits_for_a_foreign_lock_at_most_the_lock_timeout_then_wins(
    database_url: str, redis_client: redis.Redis, outside: psycopg.Connection[Any]
) -> None:
    lock_s = 0.5
    settings = Settings(database_url=database_url, sql_lock_timeout_s=lock_s)
    engine = build_engine(settings)
    try:
        service = OrderService(engine, redis_client, settings)
        order = service.create_unpaid_order("u1")
        # A host's own transaction (not the service's engine: no idle timeout) holds the row.
        with outside.transaction():
            outside.execute(
                f"SELECT 1 FROM {orders_table.name} WHERE id = %s FOR UPDATE",  # type: ignore[call-overload]
                (order.id,),
            )
            took, refused = timed(lambda: service.mark_paid(order.id, payment_ref="p1"))
        assert isinstance(refused, StoreUnavailable), refused
        assert "lock_timeout" in str(refused)
        assert lock_s * 0.8 < took < lock_s + PROMPT_S
        assert service.get_order(order.id).status.value == "unpaid"  # nothing changed
        assert service.mark_paid(order.id, payment_ref="p1").status.value == "paid"
    finally:
        engine.dispose()
