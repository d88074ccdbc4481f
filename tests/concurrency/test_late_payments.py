"""Late payments under races: with ``late_payment_window_s`` set, payments for orders the
sweep has closed race each other, creates of the same user, a second sweep and reconciles.

Every call of a race runs in a thread of its own, released together by a barrier, through
several services over the same two stores (the test's engine and Redis, or an
AsyncOrderService each under ``both_apis``). Time moves only through the manual clock.
Each test then reads the final state of both stores: the orders, their events and the
refunds owed in SQL, the members in Redis.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

from orders.domain import Order, OrderStatus, SweepResult
from orders.errors import OrderAlreadyPaid, UnpaidOrderLimitReached
from orders.service import OrderService
from orders.sql.models import events_table, orders_table, refusals_table
from tests.support.clocks import ManualClock
from tests.support.monitor import LimitMonitor
from tests.support.threads import outcomes_of_race

pytestmark = [pytest.mark.both_apis, pytest.mark.timeout(60)]

TTL_S = 60
WINDOW_S = 3600
RACE_TIMEOUT_S = 30
#: Services over the same stores, the calls of a race taken by each in turn.
SERVICES = 4
PAID = OrderStatus.PAID.value

EC = events_table.c

#: One call of a race: a use case's name, its positional and its keyword arguments.
Call = tuple[str, tuple[Any, ...], dict[str, Any]]


def services_with_a_window(make_service: Callable[..., OrderService]) -> list[OrderService]:
    return [make_service(late_payment_window_s=WINDOW_S) for _ in range(SERVICES)]


def created(service: OrderService, users: list[str], per_user: int) -> list[str]:
    """``per_user`` orders of each user, expiring ``TTL_S`` from now; their ids."""
    return [
        service.create_unpaid_order(user, ttl_s=TTL_S, limit=10).id
        for user in users
        for _ in range(per_user)
    ]


def closed_by_a_sweep(
    service: OrderService, clock: ManualClock, users: list[str], per_user: int
) -> list[str]:
    """:func:`created`, then closed by a sweep at their expiry."""
    ids = created(service, users, per_user)
    clock.advance(s=TTL_S)
    assert service.sweep_expired().closed == len(ids)
    return ids


def rows_by_id(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(orders_table)).all()}


def events_by_order(engine: Engine) -> dict[str, list[Any]]:
    """Every event, by order id, in the order they were written."""
    found: dict[str, list[Any]] = {}
    with engine.connect() as conn:
        for event in conn.execute(select(events_table).order_by(EC.id)).all():
            found.setdefault(event.order_id, []).append(event)
    return found


def refusal_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(refusals_table)).all())


def after(event: threading.Event, call: Callable[[], object]) -> Callable[[], object]:
    """``call`` once ``event`` is set (a race's thread that waits for a moment of another)."""

    def run() -> object:
        assert event.wait(RACE_TIMEOUT_S), "the event a call waited for never came"
        return call()

    return run


def spread(services: list[OrderService], calls: list[Call]) -> list[Callable[[], object]]:
    """Each (use case, args, kwargs) bound to the services in turn."""
    return [
        functools.partial(getattr(services[n % len(services)], name), *args, **kwargs)
        for n, (name, args, kwargs) in enumerate(calls)
    ]


# --- two or more late payments for one order ----------------------------------------------------


@pytest.mark.parametrize("refs", ["one_each", "all_the_same"])
def test_late_payments_racing_for_one_closed_order_pay_it_exactly_once(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock, refs: str
) -> None:
    payers = 8
    services = services_with_a_window(make_service)
    [order_id] = closed_by_a_sweep(services[0], clock, ["u1"], 1)
    clock.advance(s=WINDOW_S // 2)
    sent = [f"bank-{n}" if refs == "one_each" else "bank-0" for n in range(payers)]

    outcomes = outcomes_of_race(
        spread(services, [("mark_paid", (order_id,), {"payment_ref": ref}) for ref in sent])
    )

    row = rows_by_id(engine)[order_id]
    events = events_by_order(engine)[order_id]
    paid = [o for o in outcomes if isinstance(o, Order)]
    assert row.status == PAID
    assert [e.kind for e in events[:3]] == ["created", "closed", "paid"]
    assert events[2].data == {"payment_ref": row.payment_ref, "late": True}
    assert all(o.status is OrderStatus.PAID and o.payment_ref == row.payment_ref for o in paid)
    if refs == "all_the_same":
        assert len(paid) == payers  # the winner, and every retry of it
        assert len(events) == 3
        assert refusal_rows(engine) == []
    else:
        [winner] = paid
        refused = [o for o in outcomes if isinstance(o, OrderAlreadyPaid)]
        assert len(refused) == payers - 1, outcomes
        losers = set(sent) - {winner.payment_ref}
        assert all(o.payment_ref == winner.payment_ref for o in refused)
        # One refund owed per losing reference, each with its event, which its caller was told.
        owed = refusal_rows(engine)
        assert sorted(r.payment_ref for r in owed) == sorted(losers)
        assert {r.reason for r in owed} == {"already_paid"}
        refusal_events = events[3:]
        assert [e.kind for e in refusal_events] == ["payment_refused"] * (payers - 1)
        assert {(e.data["payment_ref"], e.id) for e in refusal_events} == {
            (r.payment_ref, r.event_id) for r in owed
        }
        told = sorted(o.refusal for o in refused if o.refusal is not None)
        assert [event_id for _, event_id in told] == sorted(e.id for e in refusal_events)
    assert services[0].index.members("u1") == {}


# --- late payments racing creates of the same user ----------------------------------------------


def test_late_payments_racing_creates_of_their_user_leave_the_limit_to_the_creates(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: redis.Redis,
    clock: ManualClock,
) -> None:
    user, limit, creators = "u1", 3, 8
    services = services_with_a_window(make_service)
    closed = closed_by_a_sweep(services[0], clock, [user], 2)
    held = services[0].create_unpaid_order(user, ttl_s=10 * TTL_S, limit=limit)
    clock.advance(s=1)
    # Two payments (other references) for each closed order, and creates at the limit.
    pays: list[Call] = [
        ("mark_paid", (oid,), {"payment_ref": f"late-{n}-{oid}"}) for oid in closed for n in (1, 2)
    ]
    create: Call = ("create_unpaid_order", (user,), {"ttl_s": 10 * TTL_S, "limit": limit})

    key = services[0].index.key(user)
    with LimitMonitor(engine, redis_client, key, user, limit=limit, clock=clock) as monitor:
        outcomes = outcomes_of_race(spread(services, pays + [create] * creators))

    paid, creates = outcomes[: len(pays)], outcomes[len(pays) :]
    admitted = [o for o in creates if isinstance(o, Order)]
    refused = [o for o in creates if isinstance(o, UnpaidOrderLimitReached)]
    assert len(admitted) == limit - 1  # the room the held order left, all of it
    assert len(refused) == creators - len(admitted), creates
    rows = rows_by_id(engine)
    unpaid = {oid: row.expires_at_ms for oid, row in rows.items() if row.status == "unpaid"}
    assert set(unpaid) == {held.id} | {o.id for o in admitted}
    assert services[0].index.members(user) == unpaid
    events = events_by_order(engine)
    for n, oid in enumerate(closed):
        pair = paid[2 * n : 2 * n + 2]
        [winner] = [o for o in pair if isinstance(o, Order)]
        [loser] = [o for o in pair if isinstance(o, OrderAlreadyPaid)]
        assert (rows[oid].status, rows[oid].payment_ref) == (PAID, winner.payment_ref)
        assert loser.payment_ref == winner.payment_ref
        kinds = [e.kind for e in events[oid]]
        assert kinds == ["created", "closed", "paid", "payment_refused"]
    assert monitor.samples > 0, "the monitor took no sample"
    assert monitor.violations == [], monitor.violations[:5]
    assert monitor.max_unpaid <= limit
    assert monitor.max_zcard <= limit


# --- late payments racing a second sweep and reconciles ------------------------------------------


def test_late_payments_racing_a_second_sweep_and_reconciles_pay_each_order_once_with_no_member(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock, api: str
) -> None:
    users, per_user, sweepers, reconcilers = 3, 3, 3, 2
    services = services_with_a_window(make_service)
    first = services[0]
    names = [f"u{u}" for u in range(users)]
    # Closed by a first sweep, and (created after it) expired but not swept yet.
    closed = closed_by_a_sweep(first, clock, names, per_user)
    due = created(first, names, per_user)
    clock.advance(s=TTL_S)
    assert first.count_due() == len(due)
    # The payments of the due orders start once a sweep has committed a batch (a sweep asks
    # should_stop before each batch), so at least one of them meets its order closed by
    # this sweep; the rest race the sweeps' later batches.
    first_batch = threading.Event()

    def after_a_batch(asked: list[int]) -> Callable[[], bool]:
        """One sweep's should_stop: it sets ``first_batch`` when asked the second time."""

        def should_stop() -> bool:
            asked.append(1)
            if len(asked) > 1:
                first_batch.set()
            return False

        return should_stop

    sweep_options = [{"batch_size": 1, "should_stop": after_a_batch([])} for _ in range(sweepers)]
    sweeps = spread(services, [("sweep_expired", (), options) for options in sweep_options])
    reconciles = spread(services, [("reconcile", (), {})] * reconcilers)
    # Each payment delivered twice at once (the provider retries), the same reference.
    payments: list[Call] = [
        ("mark_paid", (oid,), {"payment_ref": f"psp-{oid}"}) for oid in closed + due
    ] * 2
    pays = [
        after(first_batch, call) if args[0] in due else call
        for (_, args, _), call in zip(payments, spread(services, payments), strict=True)
    ]

    outcomes = outcomes_of_race(sweeps + reconciles + pays)

    swept = [o for o in outcomes[:sweepers] if isinstance(o, SweepResult)]
    paid = outcomes[sweepers + reconcilers :]
    assert all(
        isinstance(o, Order) and o.status is OrderStatus.PAID and o.payment_ref == f"psp-{o.id}"
        for o in paid
    ), paid
    rows = rows_by_id(engine)
    events = events_by_order(engine)
    for oid in closed + due:
        assert (rows[oid].status, rows[oid].payment_ref) == (PAID, f"psp-{oid}")
        # Closed (by either sweep), then paid late; or paid before the second sweep came.
        late = [e.kind for e in events[oid]] == ["created", "closed", "paid"]
        assert late or (oid in due and [e.kind for e in events[oid]] == ["created", "paid"])
        paid_data = (
            {"payment_ref": f"psp-{oid}", "late": True} if late else {"payment_ref": f"psp-{oid}"}
        )
        assert events[oid][-1].data == paid_data
    closed_late = [oid for oid in due if "closed" in [e.kind for e in events[oid]]]
    assert len(closed_late) >= 1, (swept, {oid: [e.kind for e in events[oid]] for oid in due})
    assert len(swept) == sweepers
    assert sum(s.closed for s in swept) == len(closed_late)  # none closed twice, none paid
    assert refusal_rows(engine) == []
    for name in names:
        assert first.index.members(name) == {}
    assert first.reconcile().fixes == 0
    print(
        f"\n[late payments vs a sweep, {engine.dialect.name}, {api}] of {len(due)} due orders "
        f"{len(closed_late)} were closed by the second sweep before their payment"
    )
