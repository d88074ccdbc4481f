"""The Redis index of holds beside SQL (issue 43): a sold-out cart is refused by Redis in one
round trip with no SQL statement; after Redis loses a resource (FLUSHALL, one key evicted)
SQL decides alone and the resource is rebuilt from it; the index follows payments, cancels,
the sweep and extensions; reconcile finds and repairs what drifted. On one Redis server and
on a cluster, both engines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine

from orders import HoldRefused, OrderService, UnpaidOrderLimitReached
from tests.support.clocks import ManualClock

pytestmark = pytest.mark.cluster_too


def refusal(service: OrderService, user_id: str, holds: dict[str, int]) -> HoldRefused:
    with pytest.raises(HoldRefused) as caught:
        service.create_unpaid_order(user_id, holds=holds)
    return caught.value


def state(service: OrderService, resource_id: str) -> tuple[int, int, int] | None:
    snap = service.resource_index.snapshot(resource_id, service.clock())
    return None if snap is None else (snap.cap, snap.sold, snap.held)


def test_a_sold_out_cart_is_refused_by_redis_without_any_sql(
    make_service: Callable[..., OrderService], engine: Engine, sql_statements: Any
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("sku:1", 2)
    assert state(service, "sku:1") is None  # set_capacity writes only a known resource
    service.create_unpaid_order("u1", holds={"sku:1": 2})  # SQL decides, then the rebuild
    before = sql_statements.count

    refused = refusal(service, "u2", {"sku:1": 1})

    assert (refused.source, refused.reason, refused.free) == ("redis", "sold_out", 0)
    assert state(service, "sku:1") == (2, 0, 2)  # rebuilt after the first create
    assert sql_statements.count == before
    assert service.index.members("u2") == {}


def test_after_redis_loses_a_resource_sql_refuses_the_oversell_and_the_index_is_rebuilt(
    make_service: Callable[..., OrderService], engine: Engine, redis_client: Any
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("seats", 3)
    service.create_unpaid_order("u1", holds={"seats": 2})
    assert state(service, "seats") == (3, 0, 2)
    redis_client.flushall()

    service.create_unpaid_order("u2", holds={"seats": 1})  # decided by SQL: one was free
    refused = refusal(service, "u3", {"seats": 1})

    assert refused.source == "redis"  # the create before rebuilt it from SQL
    assert state(service, "seats") == (3, 0, 3)
    # One key lost (the holds set evicted): unknown again, never guessed.
    service.resource_index.forget("seats")
    sql_refused = refusal(service, "u3", {"seats": 1})
    assert (sql_refused.source, sql_refused.reason) == ("sql", "sold_out")


def test_the_index_follows_payment_cancel_extension_and_the_sweep(
    make_service: Callable[..., OrderService], engine: Engine, clock: ManualClock
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 10)
    service.create_unpaid_order("warm", holds={"a": 1})  # builds the index from SQL
    paid = service.create_unpaid_order("u1", holds={"a": 2})
    cancelled = service.create_unpaid_order("u2", holds={"a": 3})
    extended = service.create_unpaid_order("u3", ttl_s=60, holds={"a": 1})
    assert state(service, "a") == (10, 0, 7)

    service.mark_paid(paid.id)
    service.cancel_order(cancelled.id)
    moved = service.extend_order(extended.id, extra_s=600)

    snap = service.resource_index.snapshot("a", clock())
    assert snap is not None
    assert (snap.sold, snap.held) == (2, 2)
    assert snap.members[extended.id] == (1, moved.expires_at_ms)
    clock.advance(s=3600)
    service.sweep_expired()
    assert state(service, "a") == (10, 2, 0)
    assert service.resource_index.snapshot("a", clock()) is not None


def test_reconcile_rebuilds_missing_and_stale_resources_and_removes_unknown_ones(
    make_service: Callable[..., OrderService], engine: Engine, redis_client: Any
) -> None:
    service = make_service(unpaid_limit=10)
    for rid in ("r1", "r2", "r3"):
        service.set_capacity(rid, 5)
    service.create_unpaid_order("u1", holds={"r1": 1, "r2": 1, "r3": 1})
    service.create_unpaid_order("u2", holds={"r1": 1, "r2": 1, "r3": 1})
    service.resource_index.forget("r1")  # missing
    service.resource_index.rebuild("r2", 5, 0, [], service.clock())  # stale: holds lost
    service.resource_index.rebuild("gone", 1, 0, [], service.clock())  # SQL has none

    dry = service.reconcile(dry_run=True)
    assert (dry.resources, dry.resources_missing, dry.resources_stale) == (3, 1, 1)
    assert dry.resources_removed == 1
    assert state(service, "r1") is None

    done = service.reconcile()
    assert (done.resources_missing, done.resources_stale, done.resources_removed) == (1, 1, 1)
    assert state(service, "r1") == state(service, "r2") == state(service, "r3") == (5, 0, 2)
    assert state(service, "gone") is None
    again = service.reconcile()
    assert (again.resources_missing, again.resources_stale, again.resources_removed) == (0, 0, 0)


def test_a_create_refused_at_the_user_limit_gives_its_reserved_units_back(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service(unpaid_limit=1)
    service.set_capacity("a", 5)
    service.create_unpaid_order("warm", holds={"a": 1})  # builds the index
    service.create_unpaid_order("u1", holds={"a": 1})

    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", holds={"a": 3})  # reserved in Redis, then refused

    assert state(service, "a") == (5, 0, 2)


def test_a_rebuild_releases_the_members_of_holds_released_while_it_ran(
    make_service: Callable[..., OrderService], monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(unpaid_limit=10)
    service.set_capacity("a", 5)
    kept = service.create_unpaid_order("u1", holds={"a": 1})
    gone = service.create_unpaid_order("u2", holds={"a": 2})
    read = service.holding.records.for_rebuild

    def read_then_cancel(resource_id: str) -> Any:
        state = read(resource_id)
        service.resource_index.forget(resource_id)  # the cancel's release finds no keys
        service.cancel_order(gone.id)  # committed after SQL was read, before the swap
        return state

    monkeypatch.setattr(service.holding.records, "for_rebuild", read_then_cancel)
    service.holding.rebuild("a", service.clock())

    snap = service.resource_index.snapshot("a", service.clock())
    assert snap is not None
    assert set(snap.members) == {kept.id}
    assert snap.held == 1
