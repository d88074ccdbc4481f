"""cancel_matching and extend_matching (orders.rules.bulk) against a real Redis and SQL server.

Each test reads both stores at the end: the SQL rows and their events (the record) and
the users' sorted sets in Redis (the admission index). Time moves only through ``clock``.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from orders.domain import Actor, ActorKind, Order
from orders.errors import InvalidInput, OrdersError
from orders.policies import ExpiryPolicy
from orders.rules.bulk import BulkReport, parse_metadata_pairs
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import START_MS, ManualClock

OPERATOR = Actor(ActorKind.OPERATOR, "ops@host")
HOUR_S = 3600


def at(offset_s: float) -> datetime:
    """START_MS plus ``offset_s``, as the aware datetime a filter takes."""
    return datetime.fromtimestamp(START_MS / 1000, UTC) + timedelta(seconds=offset_s)


def rows(engine: Engine) -> dict[str, Any]:
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(orders_table))}


def events(engine: Engine, kind: str | None = None) -> list[Any]:
    query = select(events_table).order_by(events_table.c.id)
    if kind is not None:
        query = query.where(events_table.c.kind == kind)
    with engine.connect() as conn:
        return list(conn.execute(query))


def event_count(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(events_table)).scalar_one())


def redis_state(service: OrderService, users: list[str]) -> dict[str, dict[str, int]]:
    return {user: service.index.members(user) for user in users}


def assert_redis_agrees_with_sql(service: OrderService, engine: Engine, users: list[str]) -> None:
    """Each user's members are exactly its open orders, scored by their expiry."""
    now_ms = service.clock()
    found = rows(engine).values()
    for user in users:
        open_orders = {
            r.id: r.expires_at_ms
            for r in found
            if r.user_id == user and r.status == "unpaid" and r.expires_at_ms > now_ms
        }
        assert service.index.members(user) == open_orders


def run_action(shop: OrderService, action: str, **given: Any) -> BulkReport:
    """The bulk ``action`` ("cancel", or "extend" by 60 s) with ``given``."""
    if action == "cancel":
        return shop.operations.cancel_matching(**given)
    return shop.operations.extend_matching(60, **given)


@pytest.fixture
def shop(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service(unpaid_limit=10)


@pytest.fixture
def placed(shop: OrderService, clock: ManualClock) -> dict[str, Order]:
    """Four unpaid orders of two users (and one paid) the filters tell apart."""
    a = shop.create_unpaid_order("u1", ttl_s=60, metadata={"shop": "eu"})
    paid = shop.create_unpaid_order("u1", ttl_s=60, metadata={"shop": "eu"})
    shop.mark_paid(paid.id, payment_ref="psp-paid")
    clock.advance(s=10)
    b = shop.create_unpaid_order("u1", ttl_s=600, metadata={"shop": "us"})
    c = shop.create_unpaid_order("u2", ttl_s=60, metadata={"shop": "eu", "tier": "gold"})
    clock.advance(s=10)
    d = shop.create_unpaid_order("u2", ttl_s=600)
    return {"a": a, "b": b, "c": c, "d": d, "paid": paid}


FILTERS: list[tuple[str, dict[str, Any], set[str]]] = [
    ("user", {"user_id": "u1"}, {"a", "b"}),
    ("created_before", {"created_before": at(5)}, {"a"}),
    ("expiring_before", {"expiring_before": at(300)}, {"a", "c"}),
    ("metadata", {"metadata": {"shop": "eu"}}, {"a", "c"}),
    ("user_and_metadata", {"user_id": "u2", "metadata": {"shop": "eu"}}, {"c"}),
    (
        "all_four",
        {
            "user_id": "u2",
            "created_before": at(15),
            "expiring_before": at(300),
            "metadata": {"shop": "eu", "tier": "gold"},
        },
        {"c"},
    ),
    ("combination_matching_nothing", {"user_id": "u1", "metadata": {"tier": "gold"}}, set()),
]
each_filter = pytest.mark.parametrize(
    ("wanted", "expected"), [f[1:] for f in FILTERS], ids=[f[0] for f in FILTERS]
)


@each_filter
@pytest.mark.parametrize(("action", "kind"), [("cancel", "cancelled"), ("extend", "extended")])
def test_bulk_action_changes_exactly_the_orders_the_filter_matches(
    shop: OrderService,
    engine: Engine,
    placed: dict[str, Order],
    wanted: dict[str, Any],
    expected: set[str],
    action: str,
    kind: str,
) -> None:
    report = run_action(shop, action, **wanted, actor=OPERATOR, batch_size=1)

    after = rows(engine)
    unpaid = {name: o for name, o in placed.items() if name != "paid"}
    changed = {
        name
        for name, o in unpaid.items()
        if (after[o.id].status, after[o.id].expires_at_ms) != ("unpaid", o.expires_at_ms)
    }
    assert changed == expected
    for name in expected:
        row = after[unpaid[name].id]
        if action == "cancel":
            assert row.status == "cancelled"
        else:
            assert (row.status, row.expires_at_ms) == (
                "unpaid",
                unpaid[name].expires_at_ms + 60_000,
            )
    assert after[placed["paid"].id].status == "paid"
    assert (report.matched, report.changed, report.skipped, report.refused) == (
        len(expected),
        len(expected),
        0,
        0,
    )
    written = events(engine, kind)
    assert sorted(e.order_id for e in written) == sorted(unpaid[n].id for n in expected)
    assert {(e.actor_kind, e.actor) for e in written} <= {("operator", "ops@host")}
    assert_redis_agrees_with_sql(shop, engine, ["u1", "u2"])


def test_bulk_cancel_events_carry_the_reason(
    shop: OrderService, engine: Engine, placed: dict[str, Order]
) -> None:
    shop.operations.cancel_matching(user_id="u2", reason="incident 7", actor=OPERATOR)
    assert [e.data for e in events(engine, "cancelled")] == [{"reason": "incident 7"}] * 2


@pytest.mark.parametrize("action", ["cancel", "extend"])
def test_dry_run_reports_the_matches_and_changes_neither_store(
    shop: OrderService, engine: Engine, placed: dict[str, Order], action: str
) -> None:
    before = (rows(engine), event_count(engine), redis_state(shop, ["u1", "u2"]))
    seen: list[str] = []

    def on_batch(page: Any, report: BulkReport) -> None:
        seen.extend(o.id for o in page)

    wanted: dict[str, Any] = {"metadata": {"shop": "eu"}, "dry_run": True, "on_batch": on_batch}
    report = run_action(shop, action, **wanted, actor=OPERATOR)

    assert sorted(seen) == sorted([placed["a"].id, placed["c"].id])
    assert (report.dry_run, report.matched, report.changed) == (True, 2, 0)
    assert (rows(engine), event_count(engine), redis_state(shop, ["u1", "u2"])) == before


def test_more_orders_than_the_batch_size_are_each_extended_exactly_once(
    shop: OrderService, engine: Engine, clock: ManualClock
) -> None:
    users = [f"u{n}" for n in range(5)]
    made = [shop.create_unpaid_order(u, ttl_s=60 + n) for n in range(5) for u in users]
    report = shop.operations.extend_matching(
        600, expiring_before=at(HOUR_S), actor=OPERATOR, batch_size=4
    )

    after = rows(engine)
    assert (report.matched, report.changed, report.batches) == (25, 25, 7)
    for order in made:
        assert after[order.id].expires_at_ms == order.expires_at_ms + 600_000
        assert after[order.id].extensions == 1
    assert len(events(engine, "extended")) == 25
    assert_redis_agrees_with_sql(shop, engine, users)


def test_more_orders_than_the_batch_size_are_each_cancelled_exactly_once(
    shop: OrderService, engine: Engine
) -> None:
    users = [f"u{n}" for n in range(5)]
    for _round in range(5):
        for user in users:
            shop.create_unpaid_order(user, ttl_s=60, metadata={"batch": "x"})
    report = shop.operations.cancel_matching(metadata={"batch": "x"}, actor=OPERATOR, batch_size=3)

    assert (report.matched, report.changed) == (25, 25)
    assert {r.status for r in rows(engine).values()} == {"cancelled"}
    assert sorted(e.order_id for e in events(engine, "cancelled")) == sorted(rows(engine))
    assert_redis_agrees_with_sql(shop, engine, users)


def test_extension_keeps_to_each_orders_policy_and_counts_the_refusals(
    make_service: Callable[..., OrderService], engine: Engine
) -> None:
    shop = make_service(
        unpaid_limit=10,
        policies={
            "card": ExpiryPolicy(ttl_s=600, max_lifetime_s=2 * HOUR_S),
            "admin": ExpiryPolicy(expires=False),
        },
    )
    plain = shop.create_unpaid_order("u1", ttl_s=600)
    card = shop.create_unpaid_order("u1", policy="card")
    admin = shop.create_unpaid_order("u1", policy="admin")

    report = shop.operations.extend_matching(3 * HOUR_S, user_id="u1", actor=OPERATOR)

    after = rows(engine)
    assert (report.matched, report.changed, report.refused, report.skipped) == (3, 1, 2, 0)
    assert after[plain.id].expires_at_ms == plain.expires_at_ms + 3 * HOUR_S * 1000
    assert after[card.id].expires_at_ms == card.expires_at_ms
    assert after[admin.id].expires_at_ms == admin.expires_at_ms
    assert [e.order_id for e in events(engine, "extended")] == [plain.id]
    assert_redis_agrees_with_sql(shop, engine, ["u1"])


def test_payment_racing_the_bulk_cancel_wins_or_loses_whole_and_redis_follows_sql(
    shop: OrderService, engine: Engine
) -> None:
    users = [f"u{n}" for n in range(6)]
    made = [shop.create_unpaid_order(u, ttl_s=600) for _ in range(6) for u in users]
    to_pay = [o.id for o in made]
    random.Random(7).shuffle(to_pay)
    start = threading.Barrier(3)
    reports: list[BulkReport] = []

    def cancel_all() -> None:
        start.wait(timeout=30)
        reports.append(
            shop.operations.cancel_matching(
                expiring_before=at(HOUR_S), actor=OPERATOR, batch_size=5
            )
        )

    def pay(ids: list[str]) -> None:
        start.wait(timeout=30)
        for oid in ids:
            # Cancelled first: the payment is refused (its refund recorded).
            with contextlib.suppress(OrdersError):
                shop.mark_paid(oid, payment_ref=f"psp-{oid}")

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [
            pool.submit(cancel_all),
            pool.submit(pay, to_pay[::2]),
            pool.submit(pay, to_pay[1::2]),
        ]
        for future in futures:
            future.result(timeout=120)

    after = rows(engine)
    paid = {oid for oid, r in after.items() if r.status == "paid"}
    cancelled = {oid for oid, r in after.items() if r.status == "cancelled"}
    assert paid | cancelled == set(after)
    assert not paid & cancelled
    cancel_events = {e.order_id for e in events(engine, "cancelled")}
    paid_events = {e.order_id for e in events(engine, "paid")}
    assert cancel_events == cancelled
    assert paid_events == paid
    (report,) = reports
    assert report.changed == len(cancelled)
    assert report.matched == report.changed + report.skipped
    assert report.skipped <= len(paid)
    assert_redis_agrees_with_sql(shop, engine, users)


def test_a_filter_matching_nothing_is_a_no_op(shop: OrderService, engine: Engine) -> None:
    shop.create_unpaid_order("u1", ttl_s=60)
    before = (rows(engine), event_count(engine))
    report = shop.operations.cancel_matching(user_id="nobody", actor=OPERATOR)
    assert (report.matched, report.changed, report.batches) == (0, 0, 0)
    assert (rows(engine), event_count(engine)) == before


BAD_INPUT: list[tuple[str, dict[str, Any], str]] = [
    ("no_filter", {}, "filter"),
    ("empty_metadata_only", {"metadata": {}}, "filter"),
    ("naive_created_before", {"created_before": datetime(2027, 1, 1)}, "created_before"),
    ("expiring_before_not_a_time", {"expiring_before": "2027-01-01"}, "expiring_before"),
    ("metadata_value_not_text", {"user_id": "u1", "metadata": {"shop": 5}}, "metadata"),
    ("batch_size_zero", {"user_id": "u1", "batch_size": 0}, "batch_size"),
    ("batch_size_too_large", {"user_id": "u1", "batch_size": 10_001}, "batch_size"),
]


@pytest.mark.rotate("database_url")  # CI time: each case on one engine (both: --full)
@pytest.mark.parametrize(
    ("given", "field"), [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT]
)
@pytest.mark.parametrize("action", ["cancel", "extend"])
def test_bad_input_is_refused_before_anything_is_written(
    shop: OrderService, engine: Engine, given: dict[str, Any], field: str, action: str
) -> None:
    shop.create_unpaid_order("u1", ttl_s=60)
    before = (rows(engine), event_count(engine), redis_state(shop, ["u1"]))
    with pytest.raises(InvalidInput) as refused:
        run_action(shop, action, **given, actor=OPERATOR)
    assert refused.value.field == field
    assert (rows(engine), event_count(engine), redis_state(shop, ["u1"])) == before


@pytest.mark.parametrize("pair", ["shop", "=eu", "shop=", ""])
def test_malformed_metadata_pair_is_refused(pair: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_metadata_pairs([pair])
    assert refused.value.field == "metadata"


def test_metadata_pairs_parse_to_the_filter() -> None:
    assert parse_metadata_pairs(["shop=eu", "note=a=b"]) == {"shop": "eu", "note": "a=b"}


def test_metadata_filter_matches_a_string_or_an_integer_by_its_text_on_both_engines(
    shop: OrderService, engine: Engine
) -> None:
    word = shop.create_unpaid_order("u1", ttl_s=60, metadata={"n": "5"})
    number = shop.create_unpaid_order("u1", ttl_s=60, metadata={"n": 5})
    shop.create_unpaid_order("u1", ttl_s=60, metadata={"n": 50, "m": "5"})
    report = shop.operations.cancel_matching(metadata={"n": "5"}, actor=OPERATOR)
    assert report.changed == 2
    cancelled = {oid for oid, r in rows(engine).items() if r.status == "cancelled"}
    assert cancelled == {word.id, number.id}
