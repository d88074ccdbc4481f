"""Processes SIGKILLed between a release and its waiting list's offer, and inside the offer
(issue 44: "exactly once, whatever crashes"), on both engines, on one Redis server and on a
cluster.

The stores before each crash: the event "ev7" has four named seats, all taken (an order
"due" holds A-1 and A-2 and has expired, "kept" holds A-3 for ten minutes more, "paid"
bought A-4); "w1" waits for two seats, then "w2" for one. A worker process
(``tests/support/workers/waiting_crash.py``) sweeps: it closes "due" and offers its two
seats to w1 (an order ``waiting-<entry id>``), and is killed by its PID at one point of
that: after the close's commit and before the offer, after the offer's Redis steps and
before its SQL insert, in the offer's SQL commit, or after the offer's commit and before
the entry is marked served.

Then a fresh service's next sweep (its recovery pass, on the serving threads) or a
reconcile finishes it, and the stores must read, straight from the tables: w1 served once
(one order ``waiting-<id>``, one ``created`` event, the entry ``served`` with that order),
A-1 and A-2 held by that order alone, w2 still waiting (nothing is free for it), every
order committed before the kill as it was, the SQL rules of holds kept
(``tests/support/hold_checks.py``), and after one reconcile Redis equal to SQL: counts,
members and the units hash. More sweeps and reconciles change nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, func, select

from orders import Order, OrderService, WaitingEntry
from orders.config import Settings
from orders.sql.inventory_tables import holds_table, units_table
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.hold_checks import index_problems, sql_problems
from tests.support.processes import WorkerCrash

pytestmark = pytest.mark.cluster_too

MARKER_TIMEOUT_S = 60
EVENT = "ev7"
SEATS = ["A-1", "A-2", "A-3", "A-4"]
#: The ways a fresh service finishes what the crash left.
FINISHES = ["sweep", "reconcile"]


@pytest.fixture
def crash(database_url: str, redis_options: dict[str, Any], tmp_path: Path) -> WorkerCrash:
    return WorkerCrash(
        "tests.support.workers.waiting_crash",
        database_url,
        redis_options,
        tmp_path,
        MARKER_TIMEOUT_S,
    )


@pytest.fixture
def service(engine: Engine, redis_client: redis.Redis, database_url: str) -> Iterator[OrderService]:
    """The service after the crash (the worker's clock starts where this one is); its
    serving threads stop at the end (the engine and client are the fixtures')."""
    settings = Settings(database_url=database_url, unpaid_limit=10)
    service = OrderService(engine, redis_client, settings, clock=ManualClock())
    try:
        yield service
    finally:
        service.serving.close()


@dataclass(frozen=True)
class SoldOut:
    """The stores before the crash (the module docstring)."""

    due: Order
    kept: Order
    paid: Order
    first: WaitingEntry
    second: WaitingEntry

    @property
    def offer_id(self) -> str:
        """The one order id the entry is ever served with (the issue's contract)."""
        return f"waiting-{self.first.id}"


def sold_out_with_two_waiting(service: OrderService) -> SoldOut:
    """Every seat taken, w1 (two seats) and w2 (one) waiting; the clock past "due"."""
    clock = service.clock
    assert isinstance(clock, ManualClock)
    service.set_units(EVENT, SEATS)
    due = service.create_unpaid_order("u1", ttl_s=60, holds={EVENT: ["A-1", "A-2"]})
    kept = service.create_unpaid_order("u2", ttl_s=600, holds={EVENT: ["A-3"]})
    paid = service.create_unpaid_order("u3", ttl_s=60, holds={EVENT: ["A-4"]})
    service.mark_paid(paid.id)
    first = service.wait_for("w1", EVENT, quantity=2)
    second = service.wait_for("w2", EVENT, quantity=1)
    assert (first.status.value, second.status.value) == ("waiting", "waiting")
    clock.advance(s=61)
    return SoldOut(due, kept, paid, first, second)


# --- the stores, read from the tables -------------------------------------------------------


def units_in_sql(engine: Engine) -> dict[str, tuple[str, str | None]]:
    """Each seat -> (state, holder); a free seat's holder is ignored (its last one)."""
    query = select(units_table.c.name, units_table.c.state, units_table.c.order_id).where(
        units_table.c.resource_id == EVENT
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return {name: (state, None if state == "free" else holder) for name, state, holder in rows}


def unit_problems(engine: Engine) -> list[str]:
    """Each order whose held or sold hold of the event does not match the seats SQL gives
    it (same count, same state): a seat counted for two orders shows up here."""
    holds = select(holds_table.c.order_id, holds_table.c.quantity, holds_table.c.status).where(
        holds_table.c.resource_id == EVENT, holds_table.c.status.in_(["held", "sold"])
    )
    with engine.connect() as conn:
        rows = conn.execute(holds).all()
    taken = units_in_sql(engine).values()
    problems = []
    for order_id, quantity, status in rows:
        seats = sum(1 for state, holder in taken if holder == order_id and state == status)
        if seats != quantity:
            problems.append(f"{order_id}: {status} {quantity} in holds, {seats} seats")
    held_or_sold = sum(1 for state, _ in taken if state != "free")
    if held_or_sold != sum(int(quantity) for _, quantity, _ in rows):
        problems.append(f"{held_or_sold} seats taken, holds say {[r[1] for r in rows]}")
    return problems


def orders_of(engine: Engine, user_id: str) -> list[tuple[str, str, Any]]:
    query = select(orders_table.c.id, orders_table.c.status, orders_table.c.metadata)
    with engine.connect() as conn:
        return [tuple(row) for row in conn.execute(query.where(orders_table.c.user_id == user_id))]


def order_status(engine: Engine, order_id: str) -> str | None:
    query = select(orders_table.c.status).where(orders_table.c.id == order_id)
    with engine.connect() as conn:
        return conn.scalar(query)


def created_events(engine: Engine, order_id: str) -> list[str | None]:
    """The actor kinds of the order's ``created`` events (one, for an order made once)."""
    query = select(events_table.c.actor_kind).where(
        events_table.c.order_id == order_id, events_table.c.kind == "created"
    )
    with engine.connect() as conn:
        return list(conn.scalars(query))


def order_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(orders_table)) or 0)


# --- before and after -----------------------------------------------------------------------


def offer_not_made(engine: Engine, before: SoldOut) -> None:
    """The crash left the close done and the offer not: "due" closed, A-1 and A-2 free in
    SQL, both entries waiting, no order for w1."""
    assert order_status(engine, before.due.id) == "closed"
    assert units_in_sql(engine)["A-1"] == units_in_sql(engine)["A-2"] == ("free", None)
    assert order_status(engine, before.offer_id) is None
    assert orders_of(engine, "w1") == []
    assert sql_problems(engine) == []


def waiting_status(service: OrderService, before: SoldOut) -> tuple[str, str]:
    first = service.waiting_entry(before.first.id)
    second = service.waiting_entry(before.second.id)
    return first.status.value, second.status.value


def finish(service: OrderService, how: str) -> None:
    """What a fresh service does next: a sweep (its recovery pass hands the resources to
    the serving threads, which are drained), or a reconcile (its pass runs in the call)."""
    if how == "sweep":
        service.sweep_expired()
        assert service.serving.drain(30), "the serving threads did not finish"
    else:
        service.reconcile()


def served_once(service: OrderService, engine: Engine, before: SoldOut) -> None:
    """The final state of both stores (the module docstring)."""
    offer_id = before.offer_id
    first = service.waiting_entry(before.first.id)
    assert (first.status.value, first.order_id) == ("served", offer_id)
    assert service.waiting_entry(before.second.id).status.value == "waiting"
    assert orders_of(engine, "w1") == [(offer_id, "unpaid", {"waiting_entry": before.first.id})]
    assert created_events(engine, offer_id) == ["waiting_list"]
    assert orders_of(engine, "w2") == []
    assert order_count(engine) == 4  # due, kept, paid and the offer: nothing more, nothing lost
    # Every order committed before the kill as it was, the offer holding the freed seats.
    assert order_status(engine, before.due.id) == "closed"
    assert order_status(engine, before.kept.id) == "unpaid"
    assert order_status(engine, before.paid.id) == "paid"
    assert units_in_sql(engine) == {
        "A-1": ("held", offer_id),
        "A-2": ("held", offer_id),
        "A-3": ("held", before.kept.id),
        "A-4": ("sold", before.paid.id),
    }
    assert service.get_order(offer_id).holds == {EVENT: ("A-1", "A-2")}
    assert unit_problems(engine) == []
    assert sql_problems(engine) == []
    # One reconcile: Redis counts and names the seats as SQL does.
    service.reconcile()
    now_ms = service.clock()
    assert index_problems(service.resource_index, engine, [EVENT], now_ms) == []
    snapshot = service.resource_index.snapshot(EVENT, now_ms)
    assert snapshot is not None
    assert snapshot.units == {
        "A-1": offer_id,
        "A-2": offer_id,
        "A-3": before.kept.id,
        "A-4": "!" + before.paid.id,
    }


def again_changes_nothing(service: OrderService, engine: Engine, before: SoldOut) -> None:
    """Later sweeps (each with its recovery pass) and reconciles serve nobody twice."""
    clock = service.clock
    assert isinstance(clock, ManualClock)
    for _ in range(2):
        clock.advance(s=2)  # past the recovery pass's interval
        finish(service, "sweep")
        finish(service, "reconcile")
    served_once(service, engine, before)


# --- the tests ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", FINISHES)
def test_a_sweep_killed_between_its_close_and_the_offer_serves_the_entry_once_after(
    service: OrderService, engine: Engine, crash: WorkerCrash, how: str
) -> None:
    before = sold_out_with_two_waiting(service)

    crash.kill_at("sweep-closed", now_ms=service.clock())

    offer_not_made(engine, before)
    assert waiting_status(service, before) == ("waiting", "waiting")
    finish(service, how)
    served_once(service, engine, before)
    again_changes_nothing(service, engine, before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", FINISHES)
def test_an_offer_killed_after_its_order_committed_marks_the_entry_served_once_after(
    service: OrderService, engine: Engine, crash: WorkerCrash, how: str
) -> None:
    before = sold_out_with_two_waiting(service)

    crash.kill_at("offer-committed", now_ms=service.clock())

    # The order is made and holds the seats; the entry still waits (not marked).
    assert orders_of(engine, "w1") == [
        (before.offer_id, "unpaid", {"waiting_entry": before.first.id})
    ]
    assert units_in_sql(engine)["A-1"] == ("held", before.offer_id)
    assert waiting_status(service, before) == ("waiting", "waiting")
    assert sql_problems(engine) == []
    finish(service, how)
    served_once(service, engine, before)
    again_changes_nothing(service, engine, before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", FINISHES)
@pytest.mark.parametrize("mode", ["offer-admitted", "offer-uncommitted"])
def test_an_offer_killed_inside_its_create_makes_the_order_once_after(
    service: OrderService, engine: Engine, crash: WorkerCrash, mode: str, how: str
) -> None:
    before = sold_out_with_two_waiting(service)

    crash.kill_at(mode, now_ms=service.clock())

    # SQL never committed the offer (the server rolls back the dead connection's work);
    # Redis has its reservation and admission.
    offer_not_made(engine, before)
    assert waiting_status(service, before) == ("waiting", "waiting")
    finish(service, how)
    served_once(service, engine, before)
    again_changes_nothing(service, engine, before)
