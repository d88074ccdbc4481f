"""erase_user (orders.rules.erasure) against a real Redis and SQL server, on both engines.

Each test reads both stores whole at the end: every row of every table that holds a user
id, as text, and every Redis key. Time moves only through ``clock``.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, Engine, Row, select

from orders.config import Settings
from orders.domain import Actor, ActorKind
from orders.errors import InvalidInput, OrderClosed, RefundOwed, UnknownUser
from orders.index.nodes import RedisClient
from orders.service import OrderService
from orders.sql.models import (
    events_table,
    orders_table,
    refusals_table,
    user_limit_history_table,
    user_limits_table,
)
from orders.sql.records import OrderRecords
from tests.support.clocks import ManualClock

KEY = "erasure-key-of-the-tests"
USER = "alice"
#: What the user's rows carry that must go: the id, the metadata, the payment references.
SECRETS = (USER, "alice@example.com", "psp-alice")
TABLES = (orders_table, events_table, refusals_table, user_limits_table, user_limit_history_table)


def expected_pseudonym(user_id: str) -> str:
    digest = hmac.new(KEY.encode(), user_id.encode(), hashlib.sha256).hexdigest()
    return "erased-" + digest[:32]


def sql_dump(engine: Engine) -> dict[str, list[str]]:
    """Every row of the tables that hold user ids, as text."""
    with engine.connect() as conn:
        return {
            table.name: sorted(repr(tuple(row)) for row in conn.execute(select(table)))
            for table in TABLES
        }


def redis_dump(redis_client: RedisClient) -> list[bytes]:
    return sorted(redis_client.keys("*"))


def leaks(engine: Engine, redis_client: RedisClient) -> list[str]:
    """Every row or key that still names the user or its data."""
    found = [row for rows in sql_dump(engine).values() for row in rows]
    found += [key.decode() for key in redis_dump(redis_client)]
    return [text for text in found if any(secret in text for secret in SECRETS)]


def events_of(engine: Engine, kind: str) -> list[Row[Any]]:
    query = select(events_table).where(events_table.c.kind == kind)
    with engine.connect() as conn:
        return list(conn.execute(query.order_by(events_table.c.id)))


@pytest.fixture
def shop(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(unpaid_limit=5, erasure_key=KEY)


def customer_history(shop: OrderService, clock: ManualClock) -> dict[str, str]:
    """The user's orders: paid, unpaid, and closed with a late payment refused and its
    refund handled; an own limit. Another user's unpaid order beside them."""
    card = {"email": "alice@example.com"}
    paid = shop.create_unpaid_order(USER, ttl_s=60, metadata=card)
    shop.mark_paid(paid.id, payment_ref="psp-alice-1")
    closed = shop.create_unpaid_order(USER, ttl_s=60, metadata=card)
    clock.advance(s=61)
    shop.sweep_expired()
    with pytest.raises(OrderClosed):
        shop.mark_paid(closed.id, payment_ref="psp-alice-late")
    shop.mark_refund_handled(closed.id, "psp-alice-late")
    unpaid = shop.create_unpaid_order(USER, ttl_s=600, metadata=card)
    shop.set_user_limit(USER, 4)
    other = shop.create_unpaid_order("bob", ttl_s=600, metadata={"email": "bob@example.com"})
    return {"paid": paid.id, "closed": closed.id, "unpaid": unpaid.id, "other": other.id}


@pytest.mark.both_apis
def test_erasure_leaves_no_trace_of_the_user_in_either_store_and_keeps_paid_orders(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    ids = customer_history(shop, clock)
    bob_keys = sorted(key.encode() for key in (shop.index.key("bob"), shop.index.admits_key("bob")))
    assert leaks(engine, redis_client)  # the dump does see the user before

    done = shop.erase_user(USER)

    alias = expected_pseudonym(USER)
    assert (done.pseudonym, done.already, done.orders, done.cancelled) == (alias, False, 3, 1)
    assert (done.refusals, done.limit_removed) == (1, True)
    assert done.redis_keys == 2  # the admissions hash, the limit copy (the set emptied)
    assert leaks(engine, redis_client) == []
    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(orders_table))}
    assert {rows[i].user_id for i in ids.values()} == {alias, "bob"}
    assert rows[ids["paid"]].status == "paid"
    assert rows[ids["unpaid"]].status == "cancelled"
    assert rows[ids["unpaid"]].close_reason == "erased"
    for name in ("paid", "closed", "unpaid"):
        assert (rows[ids[name]].payment_ref, rows[ids[name]].metadata) == (None, None)
    assert rows[ids["other"]].metadata == {"email": "bob@example.com"}
    assert redis_dump(redis_client) == bob_keys
    assert [e.data["payment_ref"] for e in events_of(engine, "paid")] == [None]
    (erased,) = events_of(engine, "erased")
    assert erased.user_id == alias
    assert erased.order_id == ids["unpaid"]  # the latest order carries it
    assert erased.data == {
        "pseudonym": alias,
        "orders": 3,
        "cancelled": 1,
        "events": done.events,
        "refusals": 1,
        "limit_removed": True,
    }
    assert (erased.actor_kind, erased.actor) == ("application", "erasure")
    (cancel,) = [e for e in events_of(engine, "cancelled") if e.order_id == ids["unpaid"]]
    assert (cancel.actor_kind, cancel.actor) == ("application", "erasure")
    assert shop.list_unpaid("bob")[0].id == ids["other"]


class PaysDuringCancel(OrderRecords):
    """Pays ``order_id`` (by ``payer``) once, just before its cancel's compare-and-set starts
    (a payment that commits between the erasure's read of the orders and its cancel) or,
    with ``after_cancel``, just after it committed (a payment refused, its refund owed,
    between the erasure's first check of refunds and its own transaction)."""

    order_id = ""
    payer: OrderService | None = None
    after_cancel = False
    refused = False

    def transition_or_current(
        self, order_id: str, now_ms: int, attempt: Any, host: Connection | None = None
    ) -> Any:
        if not self.after_cancel:
            self.pay_once(order_id)
        result = super().transition_or_current(order_id, now_ms, attempt, host)
        if self.after_cancel:
            self.pay_once(order_id)
        return result

    def pay_once(self, order_id: str) -> None:
        if order_id == self.order_id and self.payer is not None:
            payer, self.payer = self.payer, None
            try:
                payer.mark_paid(order_id, payment_ref="psp-alice-race")
            except OrderClosed:
                self.refused = True


@pytest.fixture
def racing(
    engine: Engine,
    redis_client: RedisClient,
    redis_options: dict[str, Any],
    database_url: str,
    clock: ManualClock,
) -> tuple[OrderService, PaysDuringCancel]:
    """A service whose records pay an order during the erasure's cancel."""
    settings = Settings(database_url=database_url, erasure_key=KEY, **redis_options)
    records = PaysDuringCancel(engine)
    return OrderService(engine, redis_client, settings, clock=clock, records=records), records


def test_a_payment_that_commits_before_the_cancel_wins_and_the_order_stays_paid(
    racing: tuple[OrderService, PaysDuringCancel], engine: Engine, redis_client: RedisClient
) -> None:
    shop, records = racing
    racing = shop.create_unpaid_order(USER, ttl_s=600, metadata={"email": "alice@example.com"})
    other = shop.create_unpaid_order(USER, ttl_s=600)
    records.order_id, records.payer = racing.id, shop

    done = shop.erase_user(USER, actor=Actor(ActorKind.OPERATOR, "ops@host"))

    assert (records.payer, records.refused) == (None, False)  # the payment ran, and won
    assert (done.orders, done.cancelled) == (2, 1)
    alias = expected_pseudonym(USER)
    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(orders_table))}
    assert (rows[racing.id].status, rows[racing.id].user_id) == ("paid", alias)
    assert (rows[other.id].status, rows[other.id].user_id) == ("cancelled", alias)
    assert [e.order_id for e in events_of(engine, "paid")] == [racing.id]
    assert [e.order_id for e in events_of(engine, "cancelled")] == [other.id]
    assert events_of(engine, "cancelled")[0].actor == "ops@host"
    assert leaks(engine, redis_client) == []
    assert redis_dump(redis_client) == []


def test_erasure_is_refused_while_a_refund_is_owed_and_writes_nothing(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    closed = shop.create_unpaid_order(USER, ttl_s=60)
    clock.advance(s=61)
    shop.sweep_expired()
    with pytest.raises(OrderClosed):
        shop.mark_paid(closed.id, payment_ref="psp-alice-late")
    unpaid = shop.create_unpaid_order(USER, ttl_s=600, metadata={"email": "alice@example.com"})
    before = (sql_dump(engine), redis_dump(redis_client))

    with pytest.raises(RefundOwed) as refused:
        shop.erase_user(USER)

    assert (refused.value.user_id, refused.value.pending) == (USER, 1)
    assert USER not in str(refused.value)
    assert (sql_dump(engine), redis_dump(redis_client)) == before
    assert shop.get_order(unpaid.id).status.value == "unpaid"
    shop.mark_refund_handled(closed.id, "psp-alice-late")
    assert shop.erase_user(USER).orders == 2


def test_erasure_checks_again_in_its_own_transaction_that_no_refund_is_owed(
    racing: tuple[OrderService, PaysDuringCancel], engine: Engine, redis_client: RedisClient
) -> None:
    """Rule: erasure checks again, inside its own transaction, that no refund is owed."""
    shop, records = racing
    records.after_cancel = True
    paid = shop.create_unpaid_order(USER, ttl_s=600, metadata={"email": "alice@example.com"})
    shop.mark_paid(paid.id, payment_ref="psp-alice-1")
    racing = shop.create_unpaid_order(USER, ttl_s=600)
    records.order_id, records.payer = racing.id, shop

    with pytest.raises(RefundOwed) as refused:
        shop.erase_user(USER)

    assert (records.payer, records.refused) == (None, True)  # after the first check
    assert (refused.value.user_id, refused.value.pending) == (USER, 1)
    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(orders_table))}
        owed = list(conn.execute(select(refusals_table)))
    assert {row.user_id for row in rows.values()} == {USER}  # nothing under the pseudonym
    assert (rows[paid.id].status, rows[paid.id].payment_ref) == ("paid", "psp-alice-1")
    assert rows[paid.id].metadata == {"email": "alice@example.com"}
    assert rows[racing.id].status == "cancelled"  # the cancel (step 2) is not undone
    assert [(r.order_id, r.user_id, r.payment_ref) for r in owed] == [
        (racing.id, USER, "psp-alice-race")
    ]
    assert events_of(engine, "erased") == []
    assert redis_client.exists(shop.index.admits_key(USER)) == 1  # step 4 never ran
    shop.mark_refund_handled(racing.id, "psp-alice-race")
    assert shop.erase_user(USER).orders == 2


def test_erasing_again_writes_nothing_returns_the_same_counts_and_finishes_redis(
    shop: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    customer_history(shop, clock)
    first = shop.erase_user(USER)
    after = sql_dump(engine)
    # As if the first call died after its SQL commit, before the Redis keys went.
    redis_client.set(shop.index.limits.key(USER), 4)

    again = shop.erase_user(USER)

    assert again.already is True
    assert (again.pseudonym, again.orders, again.cancelled, again.events) == (
        first.pseudonym,
        first.orders,
        first.cancelled,
        first.events,
    )
    assert (again.refusals, again.limit_removed, again.redis_keys) == (1, True, 1)
    assert sql_dump(engine) == after
    assert leaks(engine, redis_client) == []


def test_a_user_with_only_an_own_limit_loses_it_without_an_event_and_is_then_unknown(
    shop: OrderService, engine: Engine, redis_client: RedisClient
) -> None:
    shop.set_user_limit(USER, 2)

    done = shop.erase_user(USER)

    assert (done.orders, done.limit_removed, done.redis_keys) == (0, True, 1)
    assert events_of(engine, "erased") == []
    assert leaks(engine, redis_client) == []
    with pytest.raises(UnknownUser):
        shop.erase_user(USER)


def test_a_user_whose_limit_was_set_and_cleared_loses_its_limit_history(
    shop: OrderService, engine: Engine, redis_client: RedisClient
) -> None:
    shop.set_user_limit(USER, 2)
    shop.clear_user_limit(USER)
    shop.set_user_limit("bob", 1)

    shop.erase_user(USER)

    assert shop.user_limit_history(USER) == []
    assert [c.limit for c in shop.user_limit_history("bob")] == [1]
    assert leaks(engine, redis_client) == []


@pytest.mark.rotate("database_url", "redis_kind")
@pytest.mark.parametrize("case", ["unknown_user", "no_key", "bad_user_id", "bad_actor"])
def test_bad_erasure_is_a_typed_error_with_nothing_written(
    make_service: Callable[..., OrderService],
    engine: Engine,
    redis_client: RedisClient,
    case: str,
) -> None:
    keyed = make_service(erasure_key=KEY)
    keyed.create_unpaid_order(USER, ttl_s=600, metadata={"email": "alice@example.com"})
    before = (sql_dump(engine), redis_dump(redis_client))
    calls: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
        "unknown_user": (lambda: keyed.erase_user("carol"), UnknownUser, "no order"),
        "no_key": (lambda: make_service().erase_user(USER), InvalidInput, "erasure_key"),
        "bad_user_id": (lambda: keyed.erase_user("a*b"), InvalidInput, "user_id"),
        "bad_actor": (lambda: keyed.erase_user(USER, actor="x" * 300), InvalidInput, "actor"),
    }
    call, error, words = calls[case]

    with pytest.raises(error, match=words) as raised:
        call()

    assert type(raised.value) is error
    assert (sql_dump(engine), redis_dump(redis_client)) == before


def test_a_short_erasure_key_is_refused_when_the_settings_load() -> None:
    with pytest.raises(InvalidInput, match="erasure_key: must be at least 16") as refused:
        Settings(erasure_key="k" * 15)
    assert "k" * 15 not in str(refused.value)
    assert str(Settings(erasure_key=KEY).erasure_key) == "***"
