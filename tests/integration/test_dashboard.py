"""The dashboard's readings on real stores: its figures after real use cases, and the user
comparison after the index is damaged on purpose. Time moves with the service's ManualClock.
Its HTTP side is tested in tests/e2e/test_dashboard_http.py."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine

from orders.dashboard.snapshot import compare_user, read_overview
from orders.dashboard.stock import RUNNING_OUT
from orders.errors import InvalidInput, OrderAlreadyPaid, OrderClosed, PaymentMismatch
from orders.index.nodes import RedisClient
from orders.service import OrderService
from orders.sql.models import refusals_table
from orders.sql.refusals import refunds_owed
from tests.support.clocks import ManualClock

TOKEN = "s3cret-dashboard-token"
#: Caller text the page must show as text: the JSON carries it as it came.
HOSTILE_REF = "<img src=x onerror=alert(1)>"
#: A resource id is caller text too (set_capacity accepts it): the JSON carries it as it came.
HOSTILE_ID = "<img src=x onerror=alert(2)>"


def overview_figures(service: OrderService) -> dict[str, Any]:
    sql = read_overview(service)["sql"]
    assert "error" not in sql, sql
    return dict(sql["stats"])


def test_the_figures_follow_creates_payments_cancels_and_the_sweep(
    service: OrderService, clock: ManualClock
) -> None:
    for user in ("a", "b", "c"):
        service.create_unpaid_order(user, ttl_s=60, order_id=f"{user}-1")
        service.create_unpaid_order(user, ttl_s=300, order_id=f"{user}-2")
    service.mark_paid("a-1", payment_ref="p1")
    service.cancel_order("b-1")
    clock.advance(s=61)  # c-1 is due, not closed yet

    stats = overview_figures(service)
    assert stats["by_status"] == {"unpaid": 4, "paid": 1, "cancelled": 1, "closed": 0}
    assert (stats["open_unpaid"], stats["backlog"]) == (3, 1)
    assert sum(count for _, count in stats["upcoming"]) == 3

    clock.advance(s=2)
    assert service.sweep_expired().closed == 1
    overview = read_overview(service)
    stats = overview["sql"]["stats"]
    assert stats["by_status"]["closed"] == 1
    assert stats["backlog"] == 0
    [close] = overview["sql"]["recent_closes"]
    assert (close["order_id"], close["user_id"], close["lag_ms"]) == ("c-1", "c", 3000)
    assert overview["redis"]["servers"] >= 1
    assert overview["redis"]["keys"] >= 3  # the three users' sets at least
    assert overview["scheduling"]["lease_owner"] is None


def test_the_schedulers_come_from_their_beats_and_the_lease(
    service: OrderService, clock: ManualClock
) -> None:
    from orders.scheduler.sweeper import Sweeper  # noqa: PLC0415

    active = Sweeper(service, owner="host-a", lease_ttl_s=5, reconcile_at_start=False)
    standby = Sweeper(service, owner="host-b", lease_ttl_s=5, reconcile_at_start=False)
    active.tick()
    standby.tick()
    scheduling = read_overview(service)["scheduling"]
    assert scheduling["lease_owner"] == "host-a"
    assert 0 < scheduling["lease_ttl_ms"] <= 5_000
    beats = {beat["owner"]: beat for beat in scheduling["schedulers"]}
    assert beats["host-a"]["active"] is True
    assert beats["host-a"]["last_sweep_ms"] == clock()
    assert beats["host-b"]["active"] is False
    active.close()
    standby.close()


def test_the_user_comparison_names_what_reconcile_would_repair(
    service: OrderService, redis_client: RedisClient, clock: ManualClock
) -> None:
    for n in range(3):
        service.create_unpaid_order("u", ttl_s=100 + n, order_id=f"u-{n}")
    service.create_unpaid_order("u2", ttl_s=100, order_id="paid")
    service.mark_paid("paid", payment_ref="p")
    same = compare_user(service, "u")
    assert [row["state"] for row in same["rows"]] == ["same"] * 3
    assert same["differences"] == 0
    assert sorted(row["slot"] for row in same["rows"]) == [1, 2, 3]

    key = service.index.key("u")
    redis_client.zrem(key, "u-0")
    redis_client.zadd(
        key,
        {
            "u-1": clock() + 999_000,
            "ghost": clock() + 5_000,
            "stale": clock() - 1,
            "paid": clock() + 100_000,
        },
    )
    redis_client.hset(service.index.admits_key("u"), "ghost", clock())  # its create runs
    damaged = compare_user(service, "u")
    states = {row["order_id"]: row["state"] for row in damaged["rows"]}
    assert states == {
        "u-0": "missing_in_index",
        "u-1": "index_expiry_differs",
        "u-2": "same",
        "ghost": "no_row",
        "stale": "expired_in_index",
        "paid": "terminal_in_sql",
    }
    assert damaged["differences"] == 5
    assert set(damaged["states"]) >= set(states.values())
    ghost = next(row for row in damaged["rows"] if row["order_id"] == "ghost")
    assert (ghost["sql_expires_at_ms"], ghost["time_left_ms"]) == (None, 5_000)

    # reconcile repairs every difference it promises to; a member with no row whose create
    # may still be running stays
    service.reconcile()
    after = compare_user(service, "u")
    assert {row["order_id"]: row["state"] for row in after["rows"]} == {
        "u-0": "same",
        "u-1": "same",
        "u-2": "same",
        "ghost": "no_row",
    }


def test_an_order_due_in_sql_shows_until_the_sweep_closes_it(
    service: OrderService, clock: ManualClock
) -> None:
    service.create_unpaid_order("u", ttl_s=10, order_id="due")
    clock.advance(s=11)
    [row] = compare_user(service, "u")["rows"]
    assert (row["state"], row["time_left_ms"]) == ("expired_in_sql", 0)
    service.sweep_expired()
    assert compare_user(service, "u")["rows"] == []


def test_a_bad_user_id_is_refused_before_any_read(service: OrderService) -> None:
    with pytest.raises(InvalidInput):
        compare_user(service, " ")


def owed_figures(service: OrderService) -> dict[str, Any]:
    refunds = read_overview(service)["refunds"]
    assert "error" not in refunds, refunds
    return dict(refunds)


def test_the_refunds_owed_are_the_pending_refusals_newest_first(
    service: OrderService, clock: ManualClock
) -> None:
    assert owed_figures(service) == {
        "owed": 0,
        "owed_capped": False,
        "oldest_refused_at_ms": None,
        "oldest_age_ms": None,
        "newest": [],
    }
    service.create_unpaid_order("u1", ttl_s=10, order_id="swept", amount="19.90", currency="EUR")
    service.create_unpaid_order("u2", ttl_s=600, order_id="cancelled")
    service.create_unpaid_order("u3", ttl_s=600, order_id="priced", amount="5.00")
    clock.advance(s=11)
    assert service.sweep_expired().closed == 1
    service.cancel_order("cancelled")

    with pytest.raises(OrderClosed):
        service.mark_paid("swept", payment_ref="psp-1", amount="19.90", currency="EUR")
    clock.advance(s=5)
    with pytest.raises(OrderClosed):
        service.mark_paid("cancelled", payment_ref=HOSTILE_REF)
    oldest_at = clock()
    clock.advance(s=5)
    with pytest.raises(PaymentMismatch):
        service.mark_paid("priced", payment_ref="psp-3", amount="5.01")
    service.mark_paid("priced", payment_ref="psp-4", amount="5")
    clock.advance(s=5)
    with pytest.raises(OrderAlreadyPaid):
        service.mark_paid("priced", payment_ref="psp-5")
    newest_at = clock()
    clock.advance(s=1)
    service.mark_refund_handled("swept", "psp-1", actor="refund-worker")

    owed = owed_figures(service)
    assert (owed["owed"], owed["owed_capped"]) == (3, False)
    assert owed["oldest_refused_at_ms"] == oldest_at
    assert owed["oldest_age_ms"] == clock() - oldest_at == 11_000
    assert [(row["order_id"], row["payment_ref"], row["reason"]) for row in owed["newest"]] == [
        ("priced", "psp-5", "already_paid"),
        ("priced", "psp-3", "amount_mismatch"),
        ("cancelled", HOSTILE_REF, "cancelled"),
    ]
    latest, mismatch, hostile = owed["newest"]
    assert (latest["refused_at_ms"], latest["age_ms"]) == (newest_at, 1_000)
    assert (mismatch["user_id"], mismatch["amount"], mismatch["currency"]) == ("u3", "5.01", None)
    assert (hostile["amount"], hostile["currency"]) == (None, None)

    for ref in ("psp-5", "psp-3", HOSTILE_REF):
        service.mark_refund_handled("cancelled" if ref == HOSTILE_REF else "priced", ref)
    assert owed_figures(service)["owed"] == 0
    assert owed_figures(service)["newest"] == []


def test_the_refunds_owed_count_stops_at_its_cap_and_the_list_at_its_length(
    service: OrderService, clock: ManualClock
) -> None:
    service.create_unpaid_order("u", ttl_s=600, order_id="gone", amount="7.50", currency="EUR")
    service.cancel_order("gone")
    refused_at = []
    for n in range(4):
        refused_at.append(clock())
        with pytest.raises(OrderClosed):
            service.mark_paid("gone", payment_ref=f"psp-{n}", amount="7.50", currency="EUR")
        clock.advance(ms=10)

    owed = refunds_owed(service.engine, cap=3, newest=2)
    assert (owed.count, owed.capped, owed.oldest_refused_at_ms) == (3, True, refused_at[0])
    assert [refusal.payment_ref for refusal in owed.newest] == ["psp-3", "psp-2"]
    [refusal, _] = owed.newest
    assert (refusal.amount, refusal.currency) == (Decimal("7.50"), "EUR")
    exact = refunds_owed(service.engine, cap=4, newest=10)
    assert (exact.count, exact.capped, len(exact.newest)) == (4, True, 4)
    assert refunds_owed(service.engine, cap=5, newest=1).capped is False


def test_the_refunds_part_fails_alone_when_its_table_is_missing(
    service: OrderService, engine: Engine
) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {refusals_table.name}")
    overview = read_overview(service)
    assert "error" in overview["refunds"], overview["refunds"]
    assert "error" not in overview["sql"], overview["sql"]
    assert "error" not in overview["consumers"], overview["consumers"]


def running_out(service: OrderService) -> list[tuple[str, int, int, int, int, bool]]:
    resources = read_overview(service)["resources"]
    assert "error" not in resources, resources
    assert resources["capped"] is False
    return [
        (r["id"], r["capacity"], r["held"], r["sold"], r["free"], r["sold_out"])
        for r in resources["running_out"]
    ]


def test_the_resources_running_out_are_the_least_free_share_first_and_follow_the_orders(
    service: OrderService, clock: ManualClock
) -> None:
    assert running_out(service) == []
    service.set_capacity("sku:plenty", 100)
    service.set_capacity("sku:half", 10)
    service.set_capacity(HOSTILE_ID, 4)
    service.set_capacity("coupon:closed", 0)  # no capacity: never listed
    service.set_capacity("slot:lowered", 5)
    service.create_unpaid_order("a", order_id="a-1", ttl_s=60, holds={"sku:half": 5, HOSTILE_ID: 3})
    service.create_unpaid_order("b", order_id="b-1", holds={HOSTILE_ID: 1, "slot:lowered": 3})
    service.mark_paid("b-1", payment_ref="p")
    service.set_capacity("slot:lowered", 2)  # below what was sold: sold out, nothing taken back

    assert running_out(service) == [
        (HOSTILE_ID, 4, 3, 1, 0, True),  # share 0, its id sorts before slot:lowered's
        ("slot:lowered", 2, 0, 3, 0, True),
        ("sku:half", 10, 5, 0, 5, False),
        ("sku:plenty", 100, 0, 0, 100, False),
    ]

    clock.advance(s=61)
    assert service.sweep_expired().closed == 1  # a-1's holds are released with its close
    assert running_out(service) == [
        ("slot:lowered", 2, 0, 3, 0, True),
        (HOSTILE_ID, 4, 0, 1, 3, False),
        ("sku:half", 10, 0, 0, 10, False),  # a whole share: fewer free units first
        ("sku:plenty", 100, 0, 0, 100, False),
    ]


def test_the_resources_panel_lists_ten_and_ranks_a_bounded_part(service: OrderService) -> None:
    for n in range(RUNNING_OUT + 2):
        service.set_capacity(f"sku:{n:02}", 10 + n)
    service.create_unpaid_order("u", holds={"sku:11": 11})  # the last by id, 10 of 21 free
    listed = read_overview(service)["resources"]["running_out"]
    assert [r["id"] for r in listed] == ["sku:11"] + [f"sku:{n:02}" for n in range(9)]

    # The bound: only the first resources by id are ranked, and the records say more exist.
    records = service.capacities.records
    assert [r.id for r in records.running_out(2, among=3)] == ["sku:00", "sku:01"]
    assert [r.id for r in records.running_out(1, among=RUNNING_OUT + 2)] == ["sku:11"]
    assert records.more_than(RUNNING_OUT + 1) is True
    assert records.more_than(RUNNING_OUT + 2) is False
