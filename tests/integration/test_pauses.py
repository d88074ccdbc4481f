"""The incident pause (``service.operations.pause`` / ``resume``): while it lasts nothing
is closed or reminded by expiry, by the sweep or by a create reusing a slot; at resume every
unpaid order gets back the part of the pause it lived through, in SQL and in Redis, once.

Outcomes are read from both stores; time moves only through ``clock``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, func, select

from orders.domain import Actor, ActorKind, OrderStatus
from orders.errors import InvalidInput, UnpaidOrderLimitReached
from orders.index.nodes import RedisClient
from orders.policies import NEVER_EXPIRES_MS
from orders.rules.pausing import Pausing
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import events_table, pauses_table
from tests.support.clocks import ManualClock
from tests.support.stores import sql_rows

pytestmark = [pytest.mark.cluster_too]

S = 1000  # ms
OPERATOR = Actor(ActorKind.OPERATOR, "test")


def score(redis_client: RedisClient, user_id: str, order_id: str) -> float | None:
    return redis_client.zscore(f"UnpaidOrder-{user_id}", order_id)


def resume_events(engine: Engine) -> dict[str, list[dict[str, object]]]:
    query = select(events_table).where(events_table.c.kind == "extended")
    found: dict[str, list[dict[str, object]]] = {}
    with engine.connect() as conn:
        for row in conn.execute(query):
            if row.data and row.data.get("trigger") == "resume":
                found.setdefault(row.order_id, []).append(dict(row._mapping))
    return found


def pause_rows(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(select(func.count()).select_from(pauses_table)) or 0)


def tick_once(service: OrderService) -> None:
    """One round of a freshly started scheduler's sweeper (as after a restart)."""
    sweeper = Sweeper(service, reconcile_at_start=False)
    try:
        sweeper.tick()
    finally:
        sweeper.close()


@pytest.fixture
def shop(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(unpaid_limit=1, remind_before_s=60)


@pytest.mark.both_apis
def test_while_paused_nothing_closes_or_is_reminded_and_payments_go_on(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    first = shop.create_unpaid_order("u1", ttl_s=600)
    other = shop.create_unpaid_order("u2", ttl_s=600)
    pause = shop.operations.pause("psp outage", actor="oncall")
    assert (pause.reason, str(pause.actor), pause.is_open) == (
        "psp outage",
        "application:oncall",
        True,
    )
    assert shop.operations.current_pause() == pause

    clock.set(first.expires_at_ms + 3600 * S)
    result = shop.sweep_expired()
    assert (result.closed, result.reminded) == (0, 0)
    # A create for the same user may not take the expired order's slot by closing it.
    with pytest.raises(UnpaidOrderLimitReached):
        shop.create_unpaid_order("u1", ttl_s=600)
    rows = sql_rows(engine)
    assert (rows[first.id].status, rows[first.id].reminded_at_ms) == ("unpaid", None)
    assert shop.mark_paid(first.id, payment_ref="late-but-paused").status is OrderStatus.PAID
    assert shop.cancel_order(other.id).status is OrderStatus.CANCELLED
    with pytest.raises(InvalidInput, match="open already"):
        shop.operations.pause("again")
    assert pause_rows(engine) == 1


def test_resume_gives_each_unpaid_order_the_part_of_the_pause_it_lived_through(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: RedisClient,
    clock: ManualClock,
) -> None:
    shop = make_service(unpaid_limit=5, remind_before_s=60, policies={"admin": {"expires": False}})
    before = shop.create_unpaid_order("u1", ttl_s=600)  # lives through the whole pause
    overdue = shop.create_unpaid_order("u2", ttl_s=5)  # due before the pause: not moved
    never = shop.create_unpaid_order("u3", policy="admin")  # does not expire: not moved
    paid = shop.create_unpaid_order("u4", ttl_s=600)
    clock.advance(ms=10 * S)
    started = clock()
    shop.operations.pause("psp outage")
    clock.advance(ms=300 * S)
    during = shop.create_unpaid_order("u5", ttl_s=600)  # 700 s of the pause were its own
    shop.mark_paid(paid.id)
    clock.advance(ms=700 * S)
    resumed = clock()

    done = shop.operations.resume(actor="oncall", batch_size=1)

    assert (done.is_open, done.shifted, done.resumed_at_ms) == (False, 2, resumed)
    assert shop.operations.current_pause() is None
    rows = sql_rows(engine)
    whole = resumed - started
    assert rows[before.id].expires_at_ms == before.expires_at_ms + whole
    assert rows[before.id].remind_at_ms == before.remind_at_ms + whole
    assert rows[during.id].expires_at_ms == during.expires_at_ms + 700 * S
    assert rows[overdue.id].expires_at_ms == overdue.expires_at_ms
    assert rows[never.id].expires_at_ms == NEVER_EXPIRES_MS
    assert rows[paid.id].expires_at_ms == paid.expires_at_ms
    for order_id, user_id in ((before.id, "u1"), (during.id, "u5")):
        assert score(redis_client, user_id, order_id) == rows[order_id].expires_at_ms
    events = resume_events(engine)
    assert set(events) == {before.id, during.id}
    (moved,) = events[before.id]
    assert moved["data"] == {"trigger": "resume", "pause_id": done.id, "extra_ms": whole}
    assert (moved["actor_kind"], moved["actor"], moved["at_ms"]) == (
        "application",
        "oncall",
        resumed,
    )

    # The sweep runs again: the order due before the pause closes, the others do not.
    assert shop.sweep_expired().closed == 1
    assert sql_rows(engine)[overdue.id].status == "closed"
    with pytest.raises(InvalidInput, match="nothing is paused"):
        shop.operations.resume()


def test_a_resume_shifts_only_the_orders_whose_expiry_came_after_the_pause_began(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: RedisClient,
    clock: ManualClock,
) -> None:
    """Rule: a resume shifts only the orders whose expiry came after the pause began; one
    due at the pause's first millisecond was due before it (the sweep was late, not the
    shopper). One user each, so no admission drops another's member."""
    shop = make_service(unpaid_limit=1)
    due: dict[str, int] = {}
    for user_id in ("before", "at_start", "just_after"):  # due 1 ms apart
        due[user_id] = shop.create_unpaid_order(user_id, ttl_s=60).id
        clock.advance(ms=1)
    clock.set(sql_rows(engine)[due["at_start"]].expires_at_ms)
    pause = shop.operations.pause("psp outage")
    assert pause.started_at_ms == clock()
    clock.advance(ms=300 * S)

    done = shop.operations.resume()

    rows = sql_rows(engine)
    expiries = {user_id: rows[order_id].expires_at_ms for user_id, order_id in due.items()}
    assert expiries == {
        "before": pause.started_at_ms - 1,
        "at_start": pause.started_at_ms,
        "just_after": pause.started_at_ms + 1 + 300 * S,
    }
    scores = {user_id: score(redis_client, user_id, order_id) for user_id, order_id in due.items()}
    assert scores == expiries
    assert done.shifted == 1
    assert set(resume_events(engine)) == {due["just_after"]}


def test_a_resume_cut_short_is_finished_by_the_next_and_moves_no_order_twice(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    shop = make_service(unpaid_limit=10)
    orders = [shop.create_unpaid_order(f"u{i}", ttl_s=600) for i in range(7)]
    shop.operations.pause("db failover")
    clock.advance(ms=120 * S)
    pauses = shop.pausing.pauses
    begun = pauses.begin_resume(clock(), OPERATOR)
    assert pauses.shift_batch(begun, clock(), 3, OPERATOR) is not None  # then "the crash"
    assert shop.operations.current_pause() is not None  # still held: the sweep waits for the rest
    clock.advance(ms=50 * S)  # the second resume keeps the first one's end

    done = shop.operations.resume(batch_size=2)

    assert done.shifted == 7
    rows = sql_rows(engine)
    assert all(rows[o.id].expires_at_ms == o.expires_at_ms + 120 * S for o in orders)
    assert all(len(found) == 1 for found in resume_events(engine).values())
    assert len(resume_events(engine)) == 7


def test_payments_racing_a_resume_leave_each_order_paid_or_moved_and_redis_agreeing(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: RedisClient,
    clock: ManualClock,
) -> None:
    shop = make_service(unpaid_limit=200)
    orders = [shop.create_unpaid_order("u1", ttl_s=600) for _ in range(120)]
    shop.operations.pause("incident")
    clock.advance(ms=60 * S)
    start = threading.Barrier(2)

    def pay() -> None:
        start.wait()
        for order in orders[::2]:
            shop.mark_paid(order.id, payment_ref=f"p-{order.id}")

    payer = threading.Thread(target=pay)
    payer.start()
    start.wait()
    shop.operations.resume(batch_size=7)
    payer.join(60)

    rows = sql_rows(engine)
    members = {
        m.decode(): s for m, s in redis_client.zrange("UnpaidOrder-u1", 0, -1, withscores=True)
    }
    moved = resume_events(engine)
    for n, order in enumerate(orders):
        row = rows[order.id]
        if n % 2 == 0:
            assert row.status == "paid"
            assert order.id not in members
            # Moved before its payment committed, or not at all: once either way.
            assert len(moved.get(order.id, [])) <= 1
        else:
            assert row.status == "unpaid"
            assert row.expires_at_ms == order.expires_at_ms + 60 * S
            assert members[order.id] == row.expires_at_ms
            assert len(moved[order.id]) == 1


def test_the_sweeper_holds_while_paused_across_a_restart_and_reports_the_pause(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    order = shop.create_unpaid_order("u1", ttl_s=60)
    pause = shop.operations.pause("maintenance")
    clock.set(order.expires_at_ms + 10 * S)
    for _ in range(2):  # a scheduler restarted during the pause stays paused
        tick_once(shop)
        assert sql_rows(engine)[order.id].status == "unpaid"
        gauge = REGISTRY.get_sample_value("orders_pause_started_timestamp_seconds")
        assert gauge == pause.started_at_ms / 1000
    shop.operations.resume()
    tick_once(shop)
    # Moved by the 10 s the pause held it past its expiry... and more: still open now.
    assert sql_rows(engine)[order.id].status == "unpaid"
    assert REGISTRY.get_sample_value("orders_pause_started_timestamp_seconds") == 0
    clock.advance(ms=(sql_rows(engine)[order.id].expires_at_ms - clock()) + 1)
    tick_once(shop)
    assert sql_rows(engine)[order.id].status == "closed"


@pytest.mark.rotate("database_url", "redis_kind")
@pytest.mark.parametrize("reason", ["", "   ", None, 7, "x" * 300])
def test_a_pause_needs_a_reason_and_nothing_is_written_without_one(
    shop: OrderService, engine: Engine, reason: object
) -> None:
    with pytest.raises(InvalidInput, match="reason"):
        shop.operations.pause(reason)  # type: ignore[arg-type]
    assert pause_rows(engine) == 0


def members(redis_client: RedisClient, user_id: str) -> dict[str, float]:
    pairs = redis_client.zrange(f"UnpaidOrder-{user_id}", 0, -1, withscores=True)
    return {member.decode(): member_score for member, member_score in pairs}


def test_orders_due_during_a_pause_keep_their_members_through_the_resume(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: RedisClient,
    clock: ManualClock,
) -> None:
    """The admissions run during a pause (each user's script drops its members whose score
    has passed) must not leave the index without the orders the pause keeps open: after the
    resume every open order has its member, with its shifted expiry, and a user at the limit
    is refused by Redis alone."""
    shop = make_service(unpaid_limit=2)
    full = [shop.create_unpaid_order("full", ttl_s=60) for _ in range(2)]
    half = shop.create_unpaid_order("half", ttl_s=60)
    clock.advance(ms=10 * S)
    shop.operations.pause("psp outage")
    clock.advance(ms=120 * S)  # all three fall due during the pause
    with pytest.raises(UnpaidOrderLimitReached):
        shop.create_unpaid_order("full", ttl_s=60)  # its admission runs (SQL holds both)
    later = shop.create_unpaid_order("half", ttl_s=600)  # admitted beside the held one
    shop.create_unpaid_order("other", ttl_s=600)
    clock.advance(ms=30 * S)

    shop.operations.resume()

    rows = sql_rows(engine)
    open_rows = {order_id: row for order_id, row in rows.items() if row.status == "unpaid"}
    assert set(open_rows) >= {o.id for o in (*full, half, later)}
    for order_id, row in open_rows.items():
        assert members(redis_client, row.user_id).get(order_id) == row.expires_at_ms
    with pytest.raises(UnpaidOrderLimitReached) as refused:
        shop.create_unpaid_order("half", ttl_s=60)
    assert refused.value.source == "redis"


def test_a_close_committed_before_the_pause_takes_hold_is_not_during_it(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    """Rule: a pause's recorded start is when it takes hold, not when it was asked: a close
    that commits while the pause is on its way (here, right after the pause read the clock
    first) is recorded before the start, never during the pause."""
    shop = make_service(unpaid_limit=1)
    order = shop.create_unpaid_order("u1", ttl_s=60)
    clock.set(order.expires_at_ms)
    closed_before: list[int] = []

    def closing_clock() -> int:
        now_ms = clock()
        if not closed_before:  # the sweep commits its close while the pause is on its way
            closed_before.append(shop.sweep_expired().closed)
            clock.advance(ms=1)
        return now_ms

    pausing = Pausing(shop.pausing.pauses, shop.pausing.followups, closing_clock)
    pause = pausing.pause("psp outage", OPERATOR)

    assert closed_before == [1]
    query = select(events_table.c.at_ms).where(
        events_table.c.order_id == order.id, events_table.c.kind == "closed"
    )
    with engine.connect() as conn:
        closed_at_ms = conn.execute(query).scalar_one()
    assert closed_at_ms < pause.started_at_ms
    assert shop.operations.current_pause() == pause


class PaidBeforeTheRestore:
    """The resume's Redis writes, with a payment of ``order_id`` committed (and its member
    removed) between a batch's commit and the restore of that batch's members."""

    def __init__(self, shop: OrderService, order_id: str) -> None:
        self.shop = shop
        self.order_id = order_id
        self.index = shop.index

    def rescore(self, wanted: dict[str, dict[str, int]], now_ms: int) -> None:
        assert self.order_id in wanted["u1"]  # the batch moved it while still unpaid
        self.shop.mark_paid(self.order_id)
        self.shop.admitter.followups.rescore(wanted, now_ms)


def test_an_order_paid_after_its_resume_batch_does_not_get_its_member_back(
    make_service: Callable[..., OrderService], redis_client: RedisClient, clock: ManualClock
) -> None:
    """Rule: the resume puts back the members of the orders it moved, and an order paid
    between its batch's commit and that write loses it again (else it would hold a slot)."""
    shop = make_service(unpaid_limit=5)
    paid, kept = (shop.create_unpaid_order("u1", ttl_s=600) for _ in range(2))
    shop.operations.pause("psp outage")
    clock.advance(ms=60 * S)
    pausing = Pausing(shop.pausing.pauses, PaidBeforeTheRestore(shop, paid.id), clock)  # type: ignore[arg-type]

    pausing.resume(OPERATOR)

    assert members(redis_client, "u1") == {kept.id: kept.expires_at_ms + 60 * S}
