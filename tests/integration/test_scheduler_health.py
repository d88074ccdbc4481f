"""What a scheduler tells the outside, on the test's stores with the manual clock: its
gauges, its heartbeat, its job failures and its health probes' answers (asked in-process
here; tests/e2e/test_scheduler_health.py asks the real ``orders scheduler --ops-port``).

The gauges live in the process's default registry, shared by every sweeper of the test, so
each assertion reads the value right after the tick that set it."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import REGISTRY

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import SweepResult
from orders.events.admin import ParkedAction, act_on_parked, list_parked
from orders.events.consumer import OrderEvent
from orders.index.heartbeat import Heartbeats, SchedulerBeat
from orders.scheduler.event_jobs import consumer_name
from orders.scheduler.health import SchedulerHealth
from orders.scheduler.jobs import EVENTS_JOB_ID, JOB_ID, build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.health import health_of
from tests.support.stores import create_orders

MISSING_SOCKET_URL = "unix:///tmp/orders-test-no-such-redis.sock"

pytestmark = [
    pytest.mark.every_server,
    pytest.mark.parametrize("database_url", ["sqlite"], indirect=True),
]


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} is not exported"
    return value


def slow_sweeps(service: OrderService, clock: ManualClock, s: float) -> None:
    """Each sweep of ``service`` takes ``s`` seconds of the manual clock (after its cutoff)."""
    real = service.sweep_expired

    def slow(**kwargs: Any) -> SweepResult:
        result = real(**kwargs)
        clock.advance(s=s)
        return result

    service.sweep_expired = slow  # type: ignore[method-assign]


def test_the_active_and_standby_gauges_beats_and_lease_expiry_follow_the_lease(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    active = Sweeper(service, owner="A", lease_ttl_s=5, reconcile_at_start=False)
    standby = Sweeper(service, owner="B", lease_ttl_s=5, reconcile_at_start=False)
    started_ms = clock()

    active.tick()
    assert sample("orders_scheduler_active") == 1
    standby.tick()
    assert sample("orders_scheduler_active") == 0
    assert active.lease_expires_ms == started_ms + 5000
    assert standby.lease_expires_ms is None
    assert (active.last_sweep_ms, standby.last_sweep_ms) == (started_ms, None)
    assert Heartbeats(service.index.client, key_prefix="UnpaidOrder-").read(clock()) == [
        SchedulerBeat("A", True, started_ms, started_ms + 5000, started_ms),
        SchedulerBeat("B", False, None, None, started_ms),
    ]

    # A stops: its lease and its beat go at once; B takes over at its next tick.
    active.close()
    assert sample("orders_scheduler_active") == 0
    assert active.lease_expires_ms is None
    clock.advance(s=1)
    standby.tick()
    assert sample("orders_scheduler_active") == 1
    assert standby.lease_expires_ms == clock() + 5000
    beats = standby.status.heartbeats.read(clock())
    assert [(b.owner, b.active, b.last_sweep_ms) for b in beats] == [("B", True, clock())]
    standby.close()


def test_the_last_sweep_and_the_oldest_overdue_order_are_the_active_ones_and_reset_when_it_loses(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    start_ms = clock()
    first, second = create_orders(service, [1, 3], users=["u1", "u2"])
    clock.advance(s=2)  # first is due, second is not yet
    slow_sweeps(service, clock, 5)  # ...but is 4 s overdue when the sweep ends
    sweeper = Sweeper(service, owner="A", lease_ttl_s=5, reconcile_at_start=False)

    sweeper.tick()
    assert sample("orders_oldest_overdue_unpaid_seconds") == 4.0
    assert second.expires_at_ms == start_ms + 3000
    assert sweeper.last_sweep_ms == start_ms + 7000
    assert sample("orders_last_successful_sweep_timestamp_seconds") == (start_ms + 7000) / 1000
    assert service.get_order(first.id).status == "closed"

    # A standby's ticks sweep nothing and leave them as they are.
    Sweeper(service, owner="B", lease_ttl_s=5).tick()
    assert sample("orders_oldest_overdue_unpaid_seconds") == 4.0

    # The active one closes the rest: nothing overdue is left.
    sweeper.tick()
    assert sample("orders_oldest_overdue_unpaid_seconds") == 0
    create_orders(service, [1])
    clock.advance(s=10)
    sweeper.status.swept(clock() - 2500, clock(), whole=False)  # as a sweep cut short does
    assert sample("orders_oldest_overdue_unpaid_seconds") == 2.5
    assert sample("orders_last_successful_sweep_timestamp_seconds") == (start_ms + 12_000) / 1000
    assert sweeper.last_sweep_ms == start_ms + 12_000

    # Another process takes the lease: this one stops judging the backlog.
    sweeper.lease.release("A")
    assert sweeper.lease.acquire("C", 60_000)
    sweeper.tick()
    assert sample("orders_scheduler_active") == 0
    assert sample("orders_oldest_overdue_unpaid_seconds") == 0
    assert sample("orders_backlog") == 0
    assert sweeper.last_sweep_ms == start_ms + 12_000  # kept: it was this one's last sweep


def test_a_beat_that_cannot_be_published_is_warned_about_once_and_never_fails_the_tick(
    make_service: Callable[..., OrderService], clock: ManualClock, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service()
    sweeper = Sweeper(service, owner="A", reconcile_at_start=False)
    real = sweeper.status.heartbeats
    sweeper.status.heartbeats = Heartbeats(
        build_redis(Settings(redis_url=MISSING_SOCKET_URL)), key_prefix="UnpaidOrder-"
    )
    caplog.set_level(logging.INFO, logger="orders.sweeper")

    for _ in range(3):
        assert sweeper.tick() > 0
    assert sweeper.holds_lease
    sweeper.status.heartbeats = real
    sweeper.tick()
    sweeper.tick()

    events = [json.loads(r.getMessage())["event"] for r in caplog.records]
    assert [e for e in events if e.startswith("heartbeat")] == [
        "heartbeat_failed",
        "heartbeat_back",
    ]
    assert [b.owner for b in real.read(clock())] == ["A"]
    sweeper.close()


def test_parked_events_per_consumer_go_up_and_back_to_zero(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service(event_max_attempts=1)

    def refuse(event: OrderEvent) -> None:
        raise RuntimeError("the mail server is down")

    service.on_closed(refuse)
    name = consumer_name(refuse)
    sweeper = Sweeper(service, owner="A", reconcile_at_start=False)
    events_job = build_scheduler(sweeper, blocking=False).get_job(EVENTS_JOB_ID).func

    events_job()  # a standby runs nothing and shows 0 for the consumers it knows
    assert sample("orders_parked_events", consumer=name) == 0
    create_orders(service, [1, 1], users=["u1", "u2"])
    clock.advance(s=2)
    sweeper.tick()
    events_job()
    parked = list_parked(service.engine)
    assert [entry.consumer for entry in parked] == [name, name]
    assert sample("orders_parked_events", consumer=name) == 2

    for entry in parked:
        act_on_parked(service.engine, ParkedAction.DISCARD, name, entry.event_id)
    events_job()
    assert sample("orders_parked_events", consumer=name) == 0
    sweeper.close()


def test_a_job_that_raises_is_counted_once_per_failed_run(
    make_service: Callable[..., OrderService],
) -> None:
    sweeper = Sweeper(make_service(), owner="A", reconcile_at_start=False)
    real_tick = sweeper.tick
    failed = threading.Event()

    def tick_once_broken() -> float:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("a bug in the tick")
        return real_tick()

    sweeper.tick = tick_once_broken  # type: ignore[method-assign]
    scheduler = build_scheduler(sweeper, blocking=False)
    # The job's series exists from the start (at its count so far), for increase().
    before = REGISTRY.get_sample_value("orders_job_failures_total", {"scheduler_job": JOB_ID})
    assert before is not None
    scheduler.start()
    try:
        deadline = time.monotonic() + 10
        while (
            REGISTRY.get_sample_value("orders_job_failures_total", {"scheduler_job": JOB_ID})
            != before + 1
        ):
            assert time.monotonic() < deadline, "the failed run was not counted"
            time.sleep(0.01)
        # The job goes on: the next ticks run, and are not failures.
        deadline = time.monotonic() + 10
        while sweeper.last_sweep_ms is None:
            assert time.monotonic() < deadline, "the sweep job did not run again"
            time.sleep(0.01)
    finally:
        scheduler.shutdown(wait=True)
        sweeper.close()
    assert sample("orders_job_failures_total", scheduler_job=JOB_ID) == before + 1


# --- the health probes ---------------------------------------------------------------------


def test_a_standby_is_healthy_and_ready_and_says_it_is_a_standby(
    make_service: Callable[..., OrderService],
) -> None:
    service = make_service()
    sweeper = Sweeper(service, owner="B", reconcile_at_start=False)
    assert sweeper.lease.acquire("A", 60_000)  # another process is active
    scheduler = build_scheduler(sweeper, blocking=False)
    health = SchedulerHealth()
    try:
        starting = (503, {"status": "failing", "checks": {"scheduler": "starting"}})
        assert health.healthz() == health.readyz() == starting
        health.attach(sweeper, scheduler)
        scheduler.start()
        status, body = health.healthz()
        assert status == 200, body
        assert {k: v for k, v in body.items() if k != "checks"} == {
            "status": "ok",
            "role": "standby",
            "owner": "B",
            "last_successful_sweep": None,
            "last_successful_sweep_ms": None,
            "lease_expires": None,
            "lease_expires_ms": None,
        }
        assert body["checks"]["scheduler"] == "running"
        assert body["checks"]["sweep_job"] == "ok"
        status, body = health.readyz()
        assert (status, body["checks"]) == (200, {"sql": "ok", "redis": "ok"})

        scheduler.shutdown(wait=True)
        status, body = health.healthz()
        assert (status, body["checks"]["scheduler"]) == (503, "stopping")
    finally:
        if scheduler.running:
            scheduler.shutdown(wait=True)
        sweeper.close()


def test_the_active_one_shows_its_last_sweep_and_lease_in_iso_and_in_ms(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    clock.set(1_800_000_000_123)
    sweeper = Sweeper(make_service(), owner="A", lease_ttl_s=5, reconcile_at_start=False)
    sweeper.tick()
    try:
        status, body = health_of(sweeper).readyz()
    finally:
        sweeper.close()
    assert status == 200
    assert (body["role"], body["owner"]) == ("active", "A")
    assert body["last_successful_sweep_ms"] == 1_800_000_000_123
    assert body["last_successful_sweep"] == "2027-01-15T08:00:00.123+00:00"
    assert body["lease_expires_ms"] == 1_800_000_005_123
    assert body["lease_expires"] == "2027-01-15T08:00:05.123+00:00"


def test_readyz_names_the_store_that_does_not_answer(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    settings = Settings(redis_url=MISSING_SOCKET_URL)
    no_redis = OrderService(service.engine, build_redis(settings), settings, clock=clock)
    sweeper = Sweeper(no_redis, owner="A")
    status, body = health_of(sweeper).readyz()
    assert (status, body["status"]) == (503, "failing")
    assert body["checks"] == {"sql": "ok", "redis": "down: ConnectionError"}
    assert "unix://" not in json.dumps(body)


def test_healthz_fails_while_the_sweep_job_is_wedged_and_recovers(
    make_service: Callable[..., OrderService],
) -> None:
    sweeper = Sweeper(make_service(), interval_s=0.02, lease_ttl_s=0.04, reconcile_at_start=False)
    real_tick = sweeper.tick
    wedge, release = threading.Event(), threading.Event()

    def tick() -> float:
        if wedge.is_set():
            release.wait(10)  # a tick stuck in a call that never returns
        return real_tick()

    sweeper.tick = tick  # type: ignore[method-assign]
    scheduler = build_scheduler(sweeper, blocking=False)
    health = SchedulerHealth()
    health.attach(sweeper, scheduler)
    scheduler.start()

    def status_until(wanted: int) -> dict[str, Any]:
        deadline = time.monotonic() + 10
        while True:
            status, body = health.healthz()
            if status == wanted:
                return body
            assert time.monotonic() < deadline, f"/healthz never answered {wanted}: {body}"
            time.sleep(0.01)

    try:
        assert status_until(200)["checks"]["sweep_job"] == "ok"
        wedge.set()
        body = status_until(503)
        assert body["checks"]["sweep_job"] == "wedged"
        # Over max(3 cadences, the lease TTL) = 0.06 s, which the answer rounds to 3 places:
        # 0.0604 s is "wedged" and reads 0.06.
        assert body["checks"]["sweep_job_silent_s"] >= 0.06
        wedge.clear()
        release.set()
        assert status_until(200)["checks"]["scheduler"] == "running"
    finally:
        release.set()
        scheduler.shutdown(wait=True)
        sweeper.close()


def test_a_sweep_cut_short_is_not_a_successful_sweep(
    make_service: Callable[..., OrderService], clock: ManualClock
) -> None:
    service = make_service()
    sweeper = Sweeper(service, owner="A", reconcile_at_start=False)
    real = service.sweep_expired

    def stopped_midway(**kwargs: Any) -> SweepResult:
        result = real(**kwargs)
        sweeper.request_stop()  # SIGTERM during the sweep: it ends after the batch in hand
        return result

    service.sweep_expired = stopped_midway  # type: ignore[method-assign]
    create_orders(service, [1])
    clock.advance(s=1)
    sweeper.tick()
    assert sweeper.last_sweep_ms is None
    sweeper.close()
