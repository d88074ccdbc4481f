"""Waiting lists (issue 44) on both engines with a real Redis: queued first come, first
served the moment units come free (a cancel, a sweep's close, a capacity raised), by an
unpaid order made through the normal create path, exactly once per entry."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders import (
    InvalidInput,
    OrderService,
    OrderStatus,
    StoreUnavailable,
    UnknownResource,
    WaitingEntryNotFound,
)
from orders.domain import ActorKind, ms_to_datetime
from orders.inventory import WaitingStatus
from orders.rules.waiting import order_id_for
from orders.sql.inventory_tables import waiting_table
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock

W = waiting_table.c


def waiting_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(waiting_table).order_by(W.id))]


def created_actor(engine: Engine, order_id: str) -> tuple[str, str]:
    query = select(events_table.c.actor_kind, events_table.c.actor).where(
        events_table.c.order_id == order_id, events_table.c.kind == "created"
    )
    with engine.connect() as conn:
        kind, name = conn.execute(query).one()
    return kind, name


def order_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(orders_table)) or 0)


def sold_out(service: OrderService, resource_id: str, capacity: int) -> list[str]:
    """A resource of ``capacity`` units, every one held by an order of its own."""
    service.set_capacity(resource_id, capacity)
    return [
        service.create_unpaid_order(f"holder{i}", holds={resource_id: 1}).id
        for i in range(capacity)
    ]


@pytest.mark.both_apis
def test_a_cancel_serves_the_first_entry_with_an_order_naming_it(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service()
    [held] = sold_out(service, "ev:1", 1)
    first = service.wait_for("anna", "ev:1")
    second = service.wait_for("ben", "ev:1")
    assert [e.id for e in service.waiting("ev:1")] == [first.id, second.id]
    assert first.status is WaitingStatus.WAITING

    service.cancel_order(held)

    served = service.waiting_entry(first.id)
    assert (served.status, served.order_id) == (WaitingStatus.SERVED, order_id_for(first.id))
    order = service.get_order(order_id_for(first.id))
    assert (order.user_id, order.status, dict(order.holds)) == (
        "anna",
        OrderStatus.UNPAID,
        {"ev:1": 1},
    )
    assert order.metadata == {"waiting_entry": first.id}
    assert created_actor(engine, order.id) == (ActorKind.WAITING_LIST.value, str(first.id))
    assert [e.id for e in service.waiting("ev:1")] == [second.id]


def test_the_sweeps_close_serves_the_queue_first_come_first_served(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service(ttl_s=60)
    service.sweep.after_sweep = None  # the batch serves, not the recovery pass
    sold_out(service, "ev:1", 2)
    anna, ben, cara = (service.wait_for(u, "ev:1") for u in ("anna", "ben", "cara"))
    clock.advance(s=61)

    assert service.sweep_expired().closed == 2
    assert service.serving.drain()  # the sweep's serving threads

    assert [service.waiting_entry(e.id).status for e in (anna, ben)] == [WaitingStatus.SERVED] * 2
    assert [e.id for e in service.waiting("ev:1")] == [cara.id]
    assert service.resource("ev:1").held == 2
    # The served orders expire like any other, which serves the next entry.
    clock.advance(s=61)
    service.sweep_expired()
    assert service.serving.drain()  # the sweep's serving threads
    assert service.waiting_entry(cara.id).status is WaitingStatus.SERVED
    assert service.list_unpaid("cara")[0].id == order_id_for(cara.id)


@pytest.mark.both_apis
def test_a_capacity_raised_serves_the_queue_and_returns_what_is_held_then(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service()
    sold_out(service, "ev:1", 2)
    anna = service.wait_for("anna", "ev:1", 2)

    raised = service.set_capacity("ev:1", 4)

    assert (raised.held, raised.free) == (4, 0)
    assert service.waiting_entry(anna.id).order_id == order_id_for(anna.id)


def test_units_free_now_serve_a_new_entry_at_once(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service()
    service.set_capacity("ev:1", 1)

    entry = service.wait_for("anna", "ev:1")

    assert (entry.status, entry.order_id) == (WaitingStatus.SERVED, order_id_for(entry.id))
    assert service.waiting("ev:1") == []


def test_an_entry_too_large_for_what_is_free_keeps_its_place_and_the_next_is_served(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service()
    held = sold_out(service, "ev:1", 2)
    big = service.wait_for("anna", "ev:1", 2)
    small = service.wait_for("ben", "ev:1", 1)

    service.cancel_order(held[0])

    assert service.waiting_entry(small.id).status is WaitingStatus.SERVED
    assert [e.id for e in service.waiting("ev:1")] == [big.id]
    service.cancel_order(held[1])  # one unit free again: still one short of two
    assert [e.id for e in service.waiting("ev:1")] == [big.id]


def test_a_user_at_the_limit_keeps_the_place_and_is_served_once_there_is_room(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=1)
    held = sold_out(service, "ev:1", 2)
    busy = service.create_unpaid_order("anna")
    anna = service.wait_for("anna", "ev:1")
    ben = service.wait_for("ben", "ev:1")

    service.cancel_order(held[0])

    assert service.waiting_entry(ben.id).status is WaitingStatus.SERVED
    assert [e.id for e in service.waiting("ev:1")] == [anna.id]
    service.cancel_order(held[1])  # a unit free, anna still at her limit
    assert [e.id for e in service.waiting("ev:1")] == [anna.id]
    service.cancel_order(busy.id)  # frees anna's slot, not a unit: the sweep's pass serves
    clock.advance(s=1)
    service.sweep_expired()
    assert service.serving.drain()  # the sweep's serving threads
    assert service.waiting_entry(anna.id).status is WaitingStatus.SERVED


def test_an_entry_past_until_is_dropped_not_served(
    make_service: Callable[..., OrderService], clock: ManualClock, engine: Engine
) -> None:
    service = make_service()
    [held] = sold_out(service, "ev:1", 1)
    until = ms_to_datetime(clock()) + timedelta(seconds=10)
    anna = service.wait_for("anna", "ev:1", until=until)
    ben = service.wait_for("ben", "ev:1")
    assert service.waiting_entry(anna.id).until == until
    clock.advance(s=11)

    service.cancel_order(held)

    dropped = service.waiting_entry(anna.id)
    assert (dropped.status, dropped.order_id, dropped.ended_at_ms) == (
        WaitingStatus.EXPIRED,
        None,
        clock(),
    )
    assert service.waiting_entry(ben.id).status is WaitingStatus.SERVED
    assert service.list_unpaid("anna") == []


@pytest.mark.both_apis
def test_the_same_user_twice_gets_the_entry_already_waiting(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service()
    sold_out(service, "ev:1", 1)
    first = service.wait_for("anna", "ev:1")

    again = service.wait_for("anna", "ev:1", 1)

    assert again == first
    assert len(waiting_rows(engine)) == 1


@pytest.mark.both_apis
def test_bad_input_is_a_typed_error_with_nothing_written(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service()
    service.set_capacity("ev:1", 3, per_user=2)
    now = ms_to_datetime(clock())
    cases: list[tuple[Callable[[], object], type[Exception], str]] = [
        (lambda: service.wait_for("anna", "ev:1", 0), InvalidInput, "quantity"),
        (lambda: service.wait_for("anna", "ev:1", 4), InvalidInput, "capacity"),
        (lambda: service.wait_for("anna", "ev:1", 3), InvalidInput, "per-user"),
        (lambda: service.wait_for("anna", "ev:1", True), InvalidInput, "quantity"),  # type: ignore[arg-type]
        (lambda: service.wait_for("anna", "ev:1", until=now), InvalidInput, "until"),
        (
            lambda: service.wait_for("anna", "ev:1", until=datetime(2099, 1, 1)),
            InvalidInput,
            "time zone",
        ),
        (lambda: service.wait_for("anna", "ev:1", until="2099"), InvalidInput, "until"),  # type: ignore[arg-type]
        (lambda: service.wait_for("", "ev:1"), InvalidInput, "user_id"),
        (lambda: service.wait_for("anna", "ev:404"), UnknownResource, "no resource"),
        (lambda: service.wait_for("anna", "bad id\n"), InvalidInput, "resource"),
        (lambda: service.waiting("ev:404"), UnknownResource, "no resource"),
        (lambda: service.leave_waiting(0), InvalidInput, "entry_id"),
        (lambda: service.leave_waiting(404), WaitingEntryNotFound, "no waiting-list entry"),
        (lambda: service.waiting_entry(404), WaitingEntryNotFound, "no waiting-list entry"),
    ]
    for call, error, words in cases:
        with pytest.raises(error, match=words):
            call()
    assert waiting_rows(engine) == []


@pytest.mark.both_apis
def test_leaving_takes_the_entry_out_of_the_queue_once(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    [held] = sold_out(service, "ev:1", 1)
    anna = service.wait_for("anna", "ev:1")
    ben = service.wait_for("ben", "ev:1")

    left = service.leave_waiting(anna.id)
    clock.advance(s=1)
    again = service.leave_waiting(anna.id)
    service.cancel_order(held)

    assert (left.status, left.ended_at_ms) == (WaitingStatus.LEFT, clock() - 1000)
    assert again == left
    assert service.list_unpaid("anna") == []
    assert service.waiting_entry(ben.id).status is WaitingStatus.SERVED
    assert service.leave_waiting(ben.id).status is WaitingStatus.SERVED  # served stays served


def test_an_entry_is_served_once_when_its_mark_fails_after_the_order_was_made(
    make_service: Callable[..., OrderService], engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service()
    [held] = sold_out(service, "ev:1", 1)
    anna = service.wait_for("anna", "ev:1")
    records = service.waiting_list.records
    real_mark = records.mark_served
    calls: list[int] = []

    def crash_once(entry_id: int, order_id: str, now_ms: int) -> bool:
        calls.append(entry_id)
        if len(calls) == 1:
            raise StoreUnavailable("sql", "crashed before the mark")
        return real_mark(entry_id, order_id, now_ms)

    monkeypatch.setattr(records, "mark_served", crash_once)
    orders_before = order_count(engine)

    service.cancel_order(held)  # the order is made, the mark fails: logged, left waiting
    assert service.waiting_entry(anna.id).status is WaitingStatus.WAITING
    service.waiting_list.recover(service.now_ms())
    service.waiting_list.serve(["ev:1"], service.now_ms())

    entry = service.waiting_entry(anna.id)
    assert (entry.status, entry.order_id) == (WaitingStatus.SERVED, order_id_for(anna.id))
    assert order_count(engine) == orders_before + 1
    assert service.resource("ev:1").held == 1
    assert calls == [anna.id, anna.id]


def test_serving_an_entry_twice_makes_one_order(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service()
    sold_out(service, "ev:1", 1)
    anna = service.wait_for("anna", "ev:1")
    orders_before = order_count(engine)
    service.set_capacity("ev:1", 5)  # serves anna
    # A second server of the same entry (a sweep racing the cancel) finds it served.
    entry = service.waiting_list.records.get(anna.id)
    assert entry is not None
    assert service.waiting_list._offer(entry) is True

    assert order_count(engine) == orders_before + 1
    assert service.resource("ev:1").held == 2


def test_a_release_whose_serve_was_lost_is_served_by_the_next_sweep_and_by_reconcile(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    held = sold_out(service, "ev:1", 2)
    anna = service.wait_for("anna", "ev:1")
    ben = service.wait_for("ben", "ev:1")
    service.admitter.followups.freed = None  # as if the process died after each commit
    service.cancel_order(held[0])
    service.cancel_order(held[1])
    assert len(service.waiting("ev:1")) == 2

    service.sweep_expired()  # nothing due; its recovery pass serves anna and ben
    assert service.serving.drain()  # the sweep's serving threads
    assert [service.waiting_entry(e.id).status for e in (anna, ben)] == [WaitingStatus.SERVED] * 2

    cara = service.wait_for("cara", "ev:1")
    service.cancel_order(order_id_for(anna.id))
    service.sweep_expired()  # within RECOVERY_INTERVAL_MS of the last pass: not yet
    assert service.serving.drain()  # the sweep's serving threads
    assert service.waiting_entry(cara.id).status is WaitingStatus.WAITING
    service.reconcile()
    assert service.waiting_entry(cara.id).status is WaitingStatus.SERVED


def test_erasure_removes_the_users_entries_before_its_cancels_serve_them(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    service = make_service(erasure_key="erasure-key-of-the-tests", unpaid_limit=5)
    service.set_capacity("ev:1", 1)
    service.create_unpaid_order("anna", holds={"ev:1": 1})
    service.wait_for("anna", "ev:1")  # first in the queue
    ben = service.wait_for("ben", "ev:1")
    service.wait_for("cara", "ev:1")

    service.erase_user("anna")  # cancels anna's order: the unit goes to ben, not anna
    service.erase_user("cara")  # a user seen only in a waiting list is erased too

    assert [row[2] for row in waiting_rows(engine)] == ["ben"]
    assert service.waiting_entry(ben.id).status is WaitingStatus.SERVED
    assert service.list_unpaid("anna") == []


def test_a_slow_serve_never_holds_up_the_sweeps_closes(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    """Serving an entry is a whole create: the sweep hands the released resources to the
    serving threads and closes its next batches meanwhile."""
    service = make_service(unpaid_limit=10, sweep_batch_size=2)
    service.set_capacity("ev:1", 1)
    held = service.create_unpaid_order("holder", ttl_s=5, holds={"ev:1": 1})
    others = [service.create_unpaid_order(f"u{n}", ttl_s=6) for n in range(5)]
    entry = service.wait_for("anna", "ev:1")
    create = service.waiting_list.create
    serving = threading.Event()
    go_on = threading.Event()

    def slow_create(*args: Any) -> Any:
        serving.set()
        assert go_on.wait(30)
        return create(*args)

    service.waiting_list.create = slow_create
    clock.advance(s=6)
    try:
        result = service.sweep_expired()  # three batches: the first frees ev:1
        assert serving.wait(30)
        assert result.closed == 6  # every batch closed while the serve was still waiting
        assert all(service.get_order(o.id).status is OrderStatus.CLOSED for o in others)
        assert service.waiting_entry(entry.id).status is WaitingStatus.WAITING
    finally:
        go_on.set()
    assert service.serving.drain()
    assert service.waiting_entry(entry.id).status is WaitingStatus.SERVED
    assert service.get_order(held.id).status is OrderStatus.CLOSED


def test_many_adds_keep_matching_the_queue_index_once_the_driver_prepares_them(
    service: OrderService,
) -> None:
    # psycopg prepares a statement after a few runs on a connection and PostgreSQL then
    # plans it generically: the add's ON CONFLICT target must spell the partial index's
    # predicate, not a parameter, or it stops matching the index and the add fails.
    for n in range(4):
        service.set_capacity(f"ev:{n}", 1)
        service.create_unpaid_order(f"holder-{n}", holds={f"ev:{n}": 1})
    entries = [service.wait_for(f"u{user}", f"ev:{n}") for n in range(4) for user in range(10)]
    assert len({entry.id for entry in entries}) == 40
    assert [len(service.waiting(f"ev:{n}")) for n in range(4)] == [10] * 4
