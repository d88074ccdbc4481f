"""Rules that no other test guarded, on the real stores: the pre-close extension's caps, the
lowest free slot, the soonest-first write-back, reconcile's stale-add check, the sweep's
compare-and-set, a parked event kept from a twin, and a consumer's cursor that only moves
forward.

Each test here is named by a break in ``scripts/drill_mutations_guarded.py`` that it must
catch (the mutation drill checks it does).
"""

from __future__ import annotations

from typing import Any, Protocol

import pytest
import redis
from sqlalchemy import Engine, select

from orders.domain import Order
from orders.errors import UnpaidOrderLimitReached
from orders.events.admin import list_parked
from orders.events.consumer import EventConsumer, OrderEvent, read_events
from orders.index.admissions import AdmitRequest
from orders.service import OrderService
from orders.sql.models import events_table, orders_table


class Clock(Protocol):
    """The ``clock`` fixture: the injected clock, moved by hand."""

    def __call__(self) -> int: ...

    def advance(self, *, s: float = 0, ms: int = 0) -> int: ...


def event_kinds(engine: Engine, order_id: str) -> list[str]:
    with engine.connect() as conn:
        query = select(events_table.c.kind).where(events_table.c.order_id == order_id)
        return list(conn.scalars(query.order_by(events_table.c.id)))


def unpaid_slots(engine: Engine, user_id: str) -> dict[str, int]:
    query = select(orders_table.c.id, orders_table.c.slot).where(
        orders_table.c.user_id == user_id, orders_table.c.status == "unpaid"
    )
    with engine.connect() as conn:
        return dict(conn.execute(query).all())


def statuses(engine: Engine) -> dict[str, str]:
    with engine.connect() as conn:
        return dict(conn.execute(select(orders_table.c.id, orders_table.c.status)).all())


# --- the pre-close check's extension ------------------------------------------------------------


def test_a_pre_close_extension_is_cut_to_max_extension_s(make_service: Any, clock: Clock) -> None:
    service: OrderService = make_service(max_extension_s=20)
    order = service.create_unpaid_order("u1", ttl_s=5)
    service.set_pre_close_check(lambda o: 300)  # asks for more than max_extension_s
    clock.advance(s=5)

    assert service.sweep_expired().closed == 0

    extended_to_ms = clock() + 20_000
    assert service.get_order(order.id).expires_at_ms == extended_to_ms
    assert service.index.members("u1") == {order.id: extended_to_ms}


def test_a_pre_close_extension_never_passes_the_maximum_lifetime(
    make_service: Any, engine: Engine, clock: Clock
) -> None:
    service: OrderService = make_service(max_lifetime_s=30)
    fits = service.create_unpaid_order("u1", ttl_s=5)
    too_long = service.create_unpaid_order("u2", ttl_s=5)
    # 5 s lived + 25 s = exactly the maximum lifetime; + 26 s is one second past it.
    service.set_pre_close_check(lambda o: 25 if o.id == fits.id else 26)
    clock.advance(s=5)

    assert service.sweep_expired().closed == 1

    assert service.get_order(fits.id).expires_at_ms == fits.created_at_ms + 30_000
    assert service.index.members("u1") == {fits.id: fits.created_at_ms + 30_000}
    assert service.get_order(too_long.id).status == "closed"
    assert service.index.members("u2") == {}
    assert event_kinds(engine, too_long.id) == ["created", "closed"]


def test_a_pre_close_check_that_sees_the_order_paid_does_not_reopen_it(
    service: OrderService, engine: Engine, clock: Clock
) -> None:
    order = service.create_unpaid_order("u1", ttl_s=5)

    def paid_meanwhile(o: Order) -> float:
        service.mark_paid(o.id, payment_ref="psp-1")  # the payment lands while it asks
        return 30

    service.set_pre_close_check(paid_meanwhile)
    clock.advance(s=5)

    assert service.sweep_expired().closed == 0

    paid = service.get_order(order.id)
    assert (paid.status, paid.expires_at_ms, paid.payment_ref) == (
        "paid",
        order.expires_at_ms,
        "psp-1",
    )
    assert event_kinds(engine, order.id) == ["created", "paid"]
    assert service.index.members("u1") == {}


# --- admission: the SQL slots and the write-back ---------------------------------------------


def test_a_create_takes_the_lowest_free_slot(make_service: Any, engine: Engine) -> None:
    service: OrderService = make_service(unpaid_limit=5)
    first, second, third = (service.create_unpaid_order("u1") for _ in range(3))
    assert unpaid_slots(engine, "u1") == {first.id: 1, second.id: 2, third.id: 3}
    service.mark_paid(first.id)  # frees slot 1; slots 4 and 5 are free too

    fourth = service.create_unpaid_order("u1")

    assert unpaid_slots(engine, "u1") == {fourth.id: 1, second.id: 2, third.id: 3}
    assert set(service.index.members("u1")) == {second.id, third.id, fourth.id}


def test_the_write_back_after_redis_lost_data_puts_the_soonest_expiries_back_first(
    make_service: Any, engine: Engine, redis_client: redis.Redis, clock: Clock
) -> None:
    service: OrderService = make_service(unpaid_limit=3)
    soon = service.create_unpaid_order("u1", ttl_s=10)
    later = service.create_unpaid_order("u1", ttl_s=20)
    latest = service.create_unpaid_order("u1", ttl_s=30)
    redis_client.flushdb()  # Redis lost the user's members
    # Another create of the user is between its Redis and SQL steps: room for two more.
    in_flight_ms = clock() + 40_000
    service.index.admit(
        AdmitRequest("u1", "in-flight", expires_at_ms=in_flight_ms, now_ms=clock(), limit=3)
    )

    with pytest.raises(UnpaidOrderLimitReached) as by_sql:
        service.create_unpaid_order("u1", ttl_s=60)

    assert by_sql.value.source == "sql"
    assert service.index.members("u1") == {
        "in-flight": in_flight_ms,
        soon.id: soon.expires_at_ms,
        later.id: later.expires_at_ms,
    }
    with pytest.raises(UnpaidOrderLimitReached) as by_redis:
        service.create_unpaid_order("u1", ttl_s=60)
    assert by_redis.value.source == "redis"
    # The caller is told the truth: the soonest order frees a slot first.
    assert by_redis.value.retry_after_s == (soon.expires_at_ms - clock()) / 1000
    assert statuses(engine) == {o.id: "unpaid" for o in (soon, later, latest)}


# --- reconcile ---------------------------------------------------------------------------------


def test_reconcile_undoes_every_add_that_raced_a_payment_not_only_the_first(
    service: OrderService, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept = service.create_unpaid_order("u1", ttl_s=60)
    also_kept = service.create_unpaid_order("u2", ttl_s=60)
    second_of_u2 = service.create_unpaid_order("u2", ttl_s=90)
    only_of_u3 = service.create_unpaid_order("u3", ttl_s=60)
    redis_client.flushdb()
    read_page = service.records.reads.open_page
    raced: list[str] = []

    def read_then_pay(*args: Any) -> list[tuple[str, str, int]]:
        page = read_page(*args)
        for order in (second_of_u2, only_of_u3):
            if order.id not in raced:  # commits and removes its (absent) member now
                service.mark_paid(order.id)
                raced.append(order.id)
        return page

    monkeypatch.setattr(service.records.reads, "open_page", read_then_pay)

    service.reconcile()

    assert raced == [second_of_u2.id, only_of_u3.id]
    assert service.index.members_of(["u1", "u2", "u3"]) == {
        "u1": {kept.id: kept.expires_at_ms},
        "u2": {also_kept.id: also_kept.expires_at_ms},
        "u3": {},
    }
    assert service.get_order(second_of_u2.id).status == "paid"
    assert service.get_order(only_of_u3.id).status == "paid"


# --- the sweep -------------------------------------------------------------------------------


def test_the_sweeps_update_itself_closes_only_rows_still_unpaid(
    service: OrderService, engine: Engine, clock: Clock, sql_statements: Any
) -> None:
    """The claim reads unpaid due rows; the UPDATE that closes them re-checks the status
    (compare-and-set), so nothing that changed the row in between is overwritten.

    The claim's own predicate and its locks (SQLite's one writer, PostgreSQL's FOR UPDATE)
    leave no moment in which a test could change a claimed row, so this one reads the
    statement the sweep sent: the UPDATE's WHERE must carry the status.
    """
    due = service.create_unpaid_order("u1", ttl_s=5)
    paid = service.create_unpaid_order("u2", ttl_s=5)
    service.mark_paid(paid.id)
    clock.advance(s=5)
    sql_statements.statements.clear()

    assert service.sweep_expired().closed == 1

    marker = f"UPDATE {orders_table.name} SET status"
    updates = [s for s in sql_statements.statements if marker in s]
    assert len(updates) == 1
    update = updates[0][updates[0].index(marker) :]
    where = update[update.index(" WHERE ") : update.index(" RETURNING ")]
    assert f"{orders_table.name}.status = 'unpaid'" in where
    assert statuses(engine) == {due.id: "closed", paid.id: "paid"}
    assert service.index.members("u1") == {}


# --- event consumers -------------------------------------------------------------------------


def test_a_parked_event_is_not_overwritten_by_a_twins_failure(
    service: OrderService, engine: Engine, clock: Clock
) -> None:
    service.create_unpaid_order("u1")

    def twin_fails(e: OrderEvent) -> None:
        raise RuntimeError("twin: stock service down")

    twin = EventConsumer(engine, "stock", twin_fails, clock=clock, max_attempts=1, start="oldest")
    parked_at_ms = clock()

    def first_fails_later(e: OrderEvent) -> None:
        # The twin, started alongside, takes the same event and parks it first.
        assert twin.run_once().parked == 1
        clock.advance(s=1)
        raise RuntimeError("first: timeout")

    first = EventConsumer(
        engine, "stock", first_fails_later, clock=clock, max_attempts=1, start="oldest"
    )

    assert first.run_once().parked == 0  # parked already: not again, not logged again

    [parked] = list_parked(engine, consumer="stock")
    assert (parked.attempts, parked.last_error, parked.parked_at_ms) == (
        1,
        "RuntimeError: twin: stock service down",
        parked_at_ms,
    )
    assert first.pending_retries() == 0


def test_a_consumer_that_fell_behind_its_twin_never_moves_the_cursor_back(
    service: OrderService, engine: Engine, clock: Clock
) -> None:
    for user in ("u1", "u2", "u3"):
        service.create_unpaid_order(user)
    every = read_events(engine)
    seen_by_twin: list[int] = []
    twin = EventConsumer(
        engine, "mail", lambda e: seen_by_twin.append(e.id), clock=clock, start="oldest"
    )

    def slow(e: OrderEvent) -> None:
        twin.run_once()  # the twin handles the whole stream meanwhile

    first = EventConsumer(engine, "mail", slow, clock=clock, start="oldest")
    first.run_once(limit=1)  # handles the first event, then saves its position

    assert seen_by_twin == [e.id for e in every]
    assert first.position() == every[-1].position
    assert twin.run_once().handled == 0  # nothing is delivered a second time
    assert seen_by_twin == [e.id for e in every]
