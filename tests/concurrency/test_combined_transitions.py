"""Concurrent transitions combined (``Settings.combine_transitions``, SQLite only;
``orders.rules.transition``): payments, cancels and extensions that arrive while another
is in flight share one write transaction and one commit.

A gate holds one payment inside its transaction until every other call has queued behind
it, so the others run as one batch (the queue's counters say so), and then:

* each caller gets its own result: its payment, its cancel, its extension, or its own
  refusal (a second payment of one order under another reference, recorded as a refund
  owed; a cancel that lost to a payment in the same batch);
* SQL holds one event per transition that won, and Redis no member of an order that is
  no longer unpaid (and the moved score of the one extended);
* a batch whose transaction fails leaves each call to run alone, with the same results;
* a leader cut off just after the shared commit still hands each follower its outcome
  (none runs twice: an extension would move twice); cut off before it, each runs alone;
  should the commit not be known, each makes Redis follow its row before it runs alone
  (the leader too, when it goes on after an ordinary error);
* on PostgreSQL the setting changes nothing: each transition stays one autocommit statement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, Row

from orders.config import Settings
from orders.domain import Order, OrderStatus
from orders.errors import OrderAlreadyPaid, OrderClosed, StoreUnavailable
from orders.service import OrderService
from orders.sql.records import BatchCommit, OrderRecords
from tests.support.clocks import ManualClock
from tests.support.stores import events_of, orders_of
from tests.support.threads import outcomes_of_race

Attempt = Callable[[Connection], Row[Any] | None]


class GatedRecords(OrderRecords):
    """The real records; a transition of the order ``gate`` waits inside its transaction
    until ``opened`` is set. ``alone``: the orders whose transition ran in a transaction of
    its own (not in a batch's)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.gate = ""
        self.held = threading.Event()
        self.opened = threading.Event()
        self.alone: list[str] = []

    def transition_or_current(
        self, order_id: str, now_ms: int, attempt: Attempt, host: Connection | None = None
    ) -> tuple[Order, bool]:
        self.alone.append(order_id)

        def held_attempt(conn: Connection) -> Row[Any] | None:
            if order_id == self.gate:
                self.held.set()
                assert self.opened.wait(30), "the gate was never opened"
            return attempt(conn)

        return super().transition_or_current(order_id, now_ms, held_attempt, host)


@pytest.fixture
def combined(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
) -> OrderService:
    if engine.dialect.name != "sqlite":
        pytest.skip("transitions are combined on SQLite only")
    settings = Settings(database_url=database_url, combine_transitions=True, **redis_options)
    return OrderService(engine, redis_client, settings, clock=clock, records=GatedRecords(engine))


def gated_batch(service: OrderService, calls: list[Callable[[], object]]) -> list[object]:
    """``calls`` at once, all queued behind a payment of a ``gate`` order held in its
    transaction: they run as one batch. What each returned or raised, in order."""
    records = service.records
    queue = service.transitions.queue
    assert isinstance(records, GatedRecords)
    assert queue is not None, "combine_transitions=True built no queue"
    records.gate = service.create_unpaid_order("gate", ttl_s=60).id
    gate = threading.Thread(target=service.mark_paid, args=(records.gate,))
    gate.start()
    racing: list[object] = []
    runner = threading.Thread(target=lambda: racing.extend(outcomes_of_race(calls)))
    try:
        assert records.held.wait(30), "the gate's payment did not start"
        runner.start()
        deadline = time.monotonic() + 30
        while queue.queued < len(calls):
            assert time.monotonic() < deadline, f"only {queue.queued} transitions queued"
            time.sleep(0.001)
    finally:
        records.opened.set()
        gate.join(30)
        runner.join(60)
    assert len(racing) == len(calls)
    return racing


def batch_sizes() -> tuple[float, float]:
    """The transition queue's batch-size histogram: (runs observed, calls in them)."""
    labels = {"kind": "transition"}
    count = REGISTRY.get_sample_value("orders_combined_batch_size_count", labels)
    total = REGISTRY.get_sample_value("orders_combined_batch_size_sum", labels)
    return (count or 0.0, total or 0.0)


def refs_paid(engine: Engine, user: str) -> dict[str, str | None]:
    return {oid: row.payment_ref for oid, row in orders_of(engine, user).items()}


@pytest.mark.timeout(120)
def test_payments_cancels_and_extensions_in_one_batch_each_get_their_own_result(
    combined: OrderService, engine: Engine
) -> None:
    service = combined
    service.create_unpaid_order("warm-up", ttl_s=60)  # first connects, outside the race
    paid = [service.create_unpaid_order(f"payer-{n}", ttl_s=60) for n in range(8)]
    twice = service.create_unpaid_order("twice", ttl_s=60)
    contested = service.create_unpaid_order("contested", ttl_s=60)
    cancelled = service.create_unpaid_order("canceller", ttl_s=60)
    extended = service.create_unpaid_order("extender", ttl_s=60)
    calls: list[Callable[[], object]] = [
        *[lambda o=o: service.mark_paid(o.id, payment_ref=f"psp-{o.id}") for o in paid],
        lambda: service.mark_paid(twice.id, payment_ref="first"),
        lambda: service.mark_paid(twice.id, payment_ref="second"),
        lambda: service.mark_paid(contested.id, payment_ref="pay"),
        lambda: service.cancel_order(contested.id, reason="changed my mind"),
        lambda: service.cancel_order(cancelled.id, reason="changed my mind"),
        lambda: service.extend_order(extended.id, 600),
    ]
    stats = service.transitions.queue.stats  # type: ignore[union-attr]
    runs, calls_in_runs = batch_sizes()
    outcomes = gated_batch(service, calls)
    assert (stats.batches, stats.largest) == (1, len(calls)), stats
    # What an operator sees: the gate's payment alone (1), then the batch.
    assert batch_sizes() == (runs + 2, calls_in_runs + 1 + len(calls))
    records = service.records
    assert isinstance(records, GatedRecords)
    assert records.alone == [records.gate], "a transition of the batch ran alone"

    for order, outcome in zip(paid, outcomes[:8], strict=True):
        assert isinstance(outcome, Order), outcome
        assert outcome.status is OrderStatus.PAID
        assert (outcome.id, outcome.payment_ref) == (order.id, f"psp-{order.id}")
        assert refs_paid(engine, order.user_id) == {order.id: f"psp-{order.id}"}
        assert events_of(engine, order.user_id) == {order.id: ["created", "paid"]}
        assert service.index.members(order.user_id) == {}
    # One order, two references in one batch: one pays it, the other is a refund owed.
    first, second = outcomes[8:10]
    won = [o for o in (first, second) if isinstance(o, Order)]
    lost = [o for o in (first, second) if isinstance(o, OrderAlreadyPaid)]
    assert (len(won), len(lost)) == (1, 1), (first, second)
    assert refs_paid(engine, "twice") == {twice.id: won[0].payment_ref}
    assert events_of(engine, "twice") == {twice.id: ["created", "paid"]}
    refunds = service.refused_payments(pending_only=True)
    [refund] = [r for r in refunds if r.order_id == twice.id]
    assert {refund.payment_ref, won[0].payment_ref} == {"first", "second"}
    # A payment and a cancel of one order: exactly one wins, the other is told so.
    pay, cancel = outcomes[10:12]
    if isinstance(pay, Order):
        assert pay.status is OrderStatus.PAID
        assert isinstance(cancel, OrderAlreadyPaid), cancel
        assert events_of(engine, "contested") == {contested.id: ["created", "paid"]}
    else:
        assert isinstance(pay, OrderClosed), pay
        assert isinstance(cancel, Order), cancel
        assert events_of(engine, "contested") == {contested.id: ["created", "cancelled"]}
    assert service.index.members("contested") == {}
    cancel_alone = outcomes[12]
    assert isinstance(cancel_alone, Order), cancel_alone
    assert cancel_alone.status is OrderStatus.CANCELLED
    assert service.index.members("canceller") == {}
    longer = outcomes[13]
    assert isinstance(longer, Order), longer
    assert longer.expires_at_ms == extended.expires_at_ms + 600_000
    assert orders_of(engine, "extender")[extended.id].expires_at_ms == longer.expires_at_ms
    assert events_of(engine, "extender") == {extended.id: ["created", "extended"]}
    assert service.index.members("extender") == {extended.id: longer.expires_at_ms}


@pytest.mark.timeout(120)
def test_a_batch_whose_transaction_fails_leaves_each_transition_to_run_alone(
    combined: OrderService, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = combined
    orders = [service.create_unpaid_order(f"payer-{n}", ttl_s=60) for n in range(6)]
    tried: list[int] = []

    def failing(*_args: object) -> None:
        tried.append(1)
        raise StoreUnavailable("sql", "the shared transaction failed")

    monkeypatch.setattr(service.records, "transition_all", failing)
    calls = [lambda o=o: service.mark_paid(o.id, payment_ref=f"psp-{o.id}") for o in orders]
    outcomes = gated_batch(service, calls)
    assert tried == [1]  # the batch was tried once, then each went alone
    records = service.records
    assert isinstance(records, GatedRecords)
    assert sorted(records.alone) == sorted([records.gate, *(o.id for o in orders)])
    for order, outcome in zip(orders, outcomes, strict=True):
        assert isinstance(outcome, Order), outcome
        assert outcome.status is OrderStatus.PAID
        assert events_of(engine, order.user_id) == {order.id: ["created", "paid"]}
        assert service.index.members(order.user_id) == {}


def cut_off_in_commit(
    service: OrderService, monkeypatch: pytest.MonkeyPatch, *, committed: bool
) -> None:
    """The batch's leader gets a KeyboardInterrupt in its commit: just after the driver's
    commit returns (``committed``), or just before it is called."""
    commit_all = service.records.transition_all
    commit = Connection.commit

    def interrupted_commit(conn: Connection) -> None:
        if committed:
            commit(conn)
        raise KeyboardInterrupt

    def batch(*args: Any) -> None:
        with monkeypatch.context() as patched:  # the leader's commit only
            patched.setattr(Connection, "commit", interrupted_commit)
            commit_all(*args)

    monkeypatch.setattr(service.records, "transition_all", batch)


def payments_and_extensions(
    service: OrderService,
) -> tuple[list[Order], list[Order], list[Callable[[], object]]]:
    """Four orders to pay and two to extend by 600 s (two, so that one at least follows
    whichever call leads); each call returns what it raised (a KeyboardInterrupt: in
    whichever thread led the batch) instead of raising it."""
    payers = [service.create_unpaid_order(f"payer-{n}", ttl_s=60) for n in range(4)]
    extended = [service.create_unpaid_order(f"extender-{n}", ttl_s=60) for n in range(2)]

    def caught(call: Callable[[], Order]) -> object:
        try:
            return call()
        except KeyboardInterrupt as stop:
            return stop

    calls: list[Callable[[], object]] = [
        *[
            lambda o=o: caught(lambda: service.mark_paid(o.id, payment_ref=f"psp-{o.id}"))
            for o in payers
        ],
        *[lambda o=o: caught(lambda: service.extend_order(o.id, 600)) for o in extended],
    ]
    return payers, extended, calls


def assert_each_applied_once(
    service: OrderService,
    engine: Engine,
    orders: tuple[list[Order], list[Order]],
    outcomes: list[object],
    *,
    leader_committed: bool,
) -> None:
    """Exactly one call was cut off (the leader); every other got its own result. In
    both stores each transition is there once (the leader's only if its batch committed),
    and Redis holds no member of a paid order."""
    payers, extended = orders
    cut = [n for n, outcome in enumerate(outcomes) if isinstance(outcome, KeyboardInterrupt)]
    assert len(cut) == 1, outcomes
    for n, order in enumerate(payers):
        made = n not in cut or leader_committed
        expected_ref = {order.id: f"psp-{order.id}" if made else None}
        assert refs_paid(engine, order.user_id) == expected_ref
        kinds = ["created", "paid"] if made else ["created"]
        assert events_of(engine, order.user_id) == {order.id: kinds}
        members = service.index.members(order.user_id)
        assert (members == {}) is made, members
        if n not in cut:
            paid = outcomes[n]
            assert isinstance(paid, Order), paid
            assert paid.status is OrderStatus.PAID
    for n, order in enumerate(extended, start=len(payers)):
        made = n not in cut or leader_committed
        expiry = order.expires_at_ms + (600_000 if made else 0)
        assert orders_of(engine, order.user_id)[order.id].expires_at_ms == expiry, "moved twice"
        kinds = ["created", "extended"] if made else ["created"]
        assert events_of(engine, order.user_id) == {order.id: kinds}
        assert service.index.members(order.user_id) == {order.id: expiry}
        if n not in cut:
            longer = outcomes[n]
            assert isinstance(longer, Order), longer
            assert longer.expires_at_ms == expiry


@pytest.mark.timeout(120)
@pytest.mark.parametrize("committed", [True, False], ids=["after-commit", "before-commit"])
def test_a_leader_cut_off_in_its_commit_leaves_each_transition_made_once(
    combined: OrderService, engine: Engine, monkeypatch: pytest.MonkeyPatch, committed: bool
) -> None:
    """The interrupt lands when the driver's commit returns, before anyone learnt the
    outcomes: they stand, so no follower runs its transition again (an extension run
    twice would move the expiry twice). Or just before the commit: nothing was made, and
    each follower runs alone."""
    service = combined
    payers, extended, calls = payments_and_extensions(service)
    cut_off_in_commit(service, monkeypatch, committed=committed)
    outcomes = gated_batch(service, calls)
    assert service.transitions.queue.stats.batches == 1  # type: ignore[union-attr]
    records = service.records
    assert isinstance(records, GatedRecords)
    if committed:
        assert records.alone == [records.gate], "a follower ran its transition again"
    else:  # the gate's and the five followers'
        assert len(records.alone) == len(calls), records.alone
    orders = (payers, extended)
    assert_each_applied_once(service, engine, orders, outcomes, leader_committed=committed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("leader", ["cut-off", "goes-on"])
def test_a_batch_whose_commit_is_not_known_leaves_no_member_behind(
    combined: OrderService, engine: Engine, monkeypatch: pytest.MonkeyPatch, leader: str
) -> None:
    """Should the driver not tell whether the batch committed, each follower makes Redis
    follow its row, then runs alone (its payment is found already made under its own
    reference: the same order back). So does the leader when it goes on after an ordinary
    error; cut off by an interrupt, it settles its own order on the way out."""
    service = combined
    orders = [service.create_unpaid_order(f"payer-{n}", ttl_s=60) for n in range(5)]
    commit_all = service.records.transition_all
    stop = KeyboardInterrupt() if leader == "cut-off" else StoreUnavailable("sql", "not known")

    def not_known(attempts: Any, into: BatchCommit) -> None:
        commit_all(attempts, into)
        into.committed = None
        raise stop

    monkeypatch.setattr(service.records, "transition_all", not_known)

    def pay(order: Order) -> object:
        try:
            return service.mark_paid(order.id, payment_ref=f"psp-{order.id}")
        except KeyboardInterrupt as cut_off:  # in whichever thread led the batch
            return cut_off

    outcomes = gated_batch(service, [lambda o=o: pay(o) for o in orders])
    assert service.transitions.queue.stats.batches == 1  # type: ignore[union-attr]
    cut = sum(isinstance(o, KeyboardInterrupt) for o in outcomes)
    assert cut == (1 if leader == "cut-off" else 0), outcomes
    records = service.records
    assert isinstance(records, GatedRecords)
    # The gate's, and each member's that went on alone: the followers, and the leader's
    # unless it was cut off.
    assert len(records.alone) == 1 + len(orders) - cut, records.alone
    for order, outcome in zip(orders, outcomes, strict=True):
        assert refs_paid(engine, order.user_id) == {order.id: f"psp-{order.id}"}
        assert events_of(engine, order.user_id) == {order.id: ["created", "paid"]}
        assert service.index.members(order.user_id) == {}, "a paid order kept its member"
        if not isinstance(outcome, KeyboardInterrupt):
            assert isinstance(outcome, Order), outcome
            assert outcome.status is OrderStatus.PAID


def test_postgresql_keeps_one_autocommit_statement_per_transition(
    engine: Engine, redis_client: redis.Redis, database_url: str, redis_options: dict[str, Any]
) -> None:
    settings = Settings(database_url=database_url, combine_transitions=True, **redis_options)
    service = OrderService(engine, redis_client, settings)
    combining = service.transitions.queue is not None
    assert combining == (engine.dialect.name == "sqlite")
