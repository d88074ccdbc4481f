"""A committed create is confirmed off its caller's thread (orders.rules.confirming), so
the common refusal, a user at the limit with orders a minute old, asks no SQL.

A create whose confirmation never came (its process died first) is still asked about:
tests/integration/test_create.py, the refusal that asks SQL once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import redis

from orders import OrderService, UnpaidOrderLimitReached
from orders.rules.confirming import CONFIRM_THREAD
from tests.support.clocks import ManualClock
from tests.support.stores import DriverStatements, RoundTripCounter

pytestmark = [pytest.mark.every_server, pytest.mark.cluster_too]


def test_a_refusal_of_orders_a_minute_old_costs_one_round_trip_once_they_are_confirmed(
    service: OrderService,
    clock: ManualClock,
    redis_client: redis.Redis,
    sql_statements: DriverStatements,
    redis_round_trips: RoundTripCounter,
) -> None:
    held = {service.create_unpaid_order("u1", ttl_s=600, limit=2).id for _ in range(2)}
    service.create_unpaid_order("u2", ttl_s=600)  # another user's, in the same send

    assert service.admitter.confirmations.send() == 3
    assert not redis_client.exists(service.index.admits_key("u1"))
    assert not redis_client.exists(service.index.admits_key("u2"))
    clock.advance(ms=60_000)  # a minute old: suspects, had they not been confirmed
    statements_before, trips_before = sql_statements.count, redis_round_trips.count

    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", limit=2)

    assert sql_statements.count == statements_before
    assert redis_round_trips.count - trips_before == 1
    assert set(service.index.members("u1")) == held


def confirm_threads() -> int:
    return sum(thread.name == CONFIRM_THREAD for thread in threading.enumerate())


def test_the_thread_sends_by_itself_and_stops_at_close(
    make_service: Callable[..., OrderService], redis_client: redis.Redis
) -> None:
    service = make_service()
    confirmations = service.admitter.confirmations
    confirmations.every_s = 0.01
    threads_before = confirm_threads()

    order = service.create_unpaid_order("u1")

    assert confirm_threads() == threads_before + 1
    deadline = time.monotonic() + 30  # a thread's progress, not an expiry: bounded, not timed
    while redis_client.exists(service.index.admits_key("u1")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not redis_client.exists(service.index.admits_key("u1"))
    assert service.index.members("u1") == {order.id: order.expires_at_ms}
    confirmations.close()
    assert confirm_threads() == threads_before
