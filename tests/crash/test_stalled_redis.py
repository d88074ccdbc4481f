"""A Redis that stalls (``DEBUG SLEEP``) while creates run: the admissions they sent wait in
the server and run when it wakes, after the creates have failed with StoreUnavailable.

1. The create's compensation (``abandon.lua``) waits in the server too, so whichever of the
   two runs first, no member without a row stays, and the user can create again at once.
2. A leftover that no compensation reached (the admission ran, nothing undid it) names its
   create's start: reconcile keeps it while the create may be in flight, and removes it
   once it is :data:`SUSPECT_AFTER_MS` old and SQL has no row of it and no transaction
   that could still write one (a transaction still open keeps it for the admission window:
   ``tests/integration/test_reconcile.py``).
3. The two scripts in either order, and a concurrent twin or a retry of the same order id.
4. Another process, with no abandon of its own to send, admits the user once the failed
   create's admission is :data:`SUSPECT_AFTER_MS` old: its refusal names the member, SQL
   has no row of it and no transaction holding it, and the member goes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, func, select

from orders import StoreUnavailable, UnpaidOrderLimitReached
from orders.bootstrap import build_redis
from orders.config import Settings
from orders.index.admissions import SUSPECT_AFTER_MS, Admission, AdmitRequest
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.clocks import ManualClock
from tests.support.redis_server import RedisServer, debug_command_args, own_server
from tests.support.threads import errors_of_threads

pytestmark = pytest.mark.every_server

STALL_S = 3


@pytest.fixture
def stallable_redis(redis_binary: Path | None) -> Iterator[RedisServer]:
    """A redis-server of this test's own that accepts DEBUG from local clients."""
    with own_server(redis_binary, *debug_command_args(redis_binary)) as server:
        yield server


@pytest.fixture
def stalled_service(
    stallable_redis: RedisServer, engine: Engine, clock: ManualClock
) -> Iterator[OrderService]:
    settings = Settings(redis_url=stallable_redis.url, unpaid_limit=1, redis_socket_timeout_s=0.5)
    service = OrderService(engine, build_redis(settings), settings, clock=clock)
    try:
        yield service
    finally:
        service.index.client.close()


def admin(server: RedisServer, timeout_s: float) -> redis.Redis:
    """A client that reports a timeout at once (redis-py's default would retry it)."""
    return redis.Redis(
        unix_socket_path=str(server.socket),
        socket_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def stall(server: RedisServer, seconds: int) -> Callable[[], None]:
    """``DEBUG SLEEP seconds`` sent from a thread; returns once the server stopped
    answering, with a function that waits for it to answer again."""
    sleeper = admin(server, seconds + 30)
    thread = threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", seconds))
    thread.start()
    with admin(server, 0.1) as probe:
        deadline = time.monotonic() + 10
        while True:  # until a PING goes unanswered: the server is asleep
            try:
                probe.ping()
            except redis.TimeoutError:
                break
            assert time.monotonic() < deadline, "the server never went to sleep"

    def woken() -> None:
        thread.join(seconds + 30)
        sleeper.close()
        with admin(server, 5) as probe:
            # The queued scripts came in before this PING: once it is answered, they ran.
            probe.ping()

    return woken


def rows_of(engine: Engine, user_id: str) -> int:
    with engine.connect() as conn:
        query = select(func.count()).select_from(orders_table)
        return int(conn.scalar(query.where(orders_table.c.user_id == user_id)) or 0)


@pytest.mark.timeout(120)
def test_a_create_timed_out_by_a_stalled_redis_leaves_no_member_once_it_wakes(
    stallable_redis: RedisServer, stalled_service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    service = stalled_service
    service.create_unpaid_order("warm")  # connected
    woken = stall(stallable_redis, STALL_S)

    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        service.create_unpaid_order("u1", order_id="stalled-1")
    failed_after_s = time.monotonic() - started
    woken()

    assert info.value.store == "redis"
    assert failed_after_s < STALL_S  # the create failed while Redis slept
    assert rows_of(engine, "u1") == 0
    # The user is not held: its next create is refused by the late admission, sends the
    # abandon, which frees the one slot, and is admitted in it.
    clock.advance(ms=1)
    fresh = service.create_unpaid_order("u1")
    assert service.index.members("u1") == {fresh.id: fresh.expires_at_ms}
    assert rows_of(engine, "u1") == 1
    assert service.admitter.abandoner.unsent == deque()


@pytest.mark.timeout(120)
def test_a_retry_after_a_stall_completes_the_order_with_its_own_expiry(
    stallable_redis: RedisServer, stalled_service: OrderService, engine: Engine, clock: ManualClock
) -> None:
    service = stalled_service
    service.create_unpaid_order("warm")
    woken = stall(stallable_redis, STALL_S)
    with pytest.raises(StoreUnavailable):
        service.create_unpaid_order("u1", order_id="stalled-1", ttl_s=60)
    woken()

    clock.advance(ms=1)  # a retry starts after the attempt it retries
    retried = service.create_unpaid_order("u1", order_id="stalled-1", ttl_s=120)

    # Not the abandoned attempt's member (found as "exists"), but a fresh admission.
    assert retried.expires_at_ms == clock() + 120_000
    assert service.index.members("u1") == {"stalled-1": retried.expires_at_ms}
    assert rows_of(engine, "u1") == 1


@pytest.mark.timeout(120)
def test_creates_of_several_users_during_a_stall_leave_the_stores_agreeing(
    stallable_redis: RedisServer, stalled_service: OrderService, engine: Engine
) -> None:
    service = stalled_service
    service.create_unpaid_order("warm")
    users = [f"s{i}" for i in range(4)]
    woken = stall(stallable_redis, STALL_S)
    failures = errors_of_threads(service.create_unpaid_order, [(user,) for user in users])
    woken()

    assert len(failures) == len(users)
    assert all(isinstance(failed, StoreUnavailable) for failed in failures), failures
    service.create_unpaid_order("other")  # the process's next create sends what was left
    for user in users:
        assert service.index.members(user) == {}
        assert rows_of(engine, user) == 0
        service.create_unpaid_order(user)  # not held


@pytest.mark.timeout(120)
def test_another_process_admits_the_user_once_a_create_failed_in_a_stall_is_seconds_old(
    stallable_redis: RedisServer,
    stalled_service: OrderService,
    engine: Engine,
    clock: ManualClock,
) -> None:
    service = stalled_service
    # Another instance (a worker behind the same load balancer): nothing pending of its own.
    other_clock = ManualClock(clock())
    other = OrderService(engine, build_redis(service.settings), service.settings, clock=other_clock)
    service.create_unpaid_order("warm")
    woken = stall(stallable_redis, STALL_S)
    with pytest.raises(StoreUnavailable):
        service.create_unpaid_order("u1", order_id="stalled-1")
    woken()
    started_ms = clock()
    # The admission ran when Redis woke; its abandon waits for this process's next one.
    assert set(other.index.members("u1")) == {"stalled-1"}
    assert rows_of(engine, "u1") == 0

    try:
        other_clock.set(started_ms + SUSPECT_AFTER_MS - 1)  # may still be in flight
        with pytest.raises(UnpaidOrderLimitReached):
            other.create_unpaid_order("u1")
        assert set(other.index.members("u1")) == {"stalled-1"}

        other_clock.set(started_ms + SUSPECT_AFTER_MS)
        fresh = other.create_unpaid_order("u1")
        assert other.index.members("u1") == {fresh.id: fresh.expires_at_ms}
        assert rows_of(engine, "u1") == 1
        # The failed process's abandon, sent later, finds its attempt over and removes nothing.
        clock.advance(ms=1)
        service.create_unpaid_order("w2")
        assert other.index.members("u1") == {fresh.id: fresh.expires_at_ms}
    finally:
        other.index.client.close()


def test_a_leftover_no_compensation_reached_goes_at_reconcile_once_seconds_old(
    stalled_service: OrderService, clock: ManualClock, engine: Engine
) -> None:
    service = stalled_service
    # What a stalled create leaves when its compensation never reached Redis: the admission
    # ran (late), with the create's start, and nothing undid it. No SQL row.
    started_ms = clock()
    service.index.admit(
        AdmitRequest(
            "u1", "left-1", expires_at_ms=started_ms + 1_800_000, now_ms=started_ms, limit=1
        )
    )

    clock.advance(ms=SUSPECT_AFTER_MS - 1)  # the create might still be between its two steps
    report = service.reconcile()
    assert (report.kept_in_flight, report.removed_abandoned) == (1, 0)
    assert set(service.index.members("u1")) == {"left-1"}

    clock.advance(ms=1)  # no row, and no transaction that could still write one: over
    dry = service.reconcile(dry_run=True)
    assert (dry.kept_in_flight, dry.removed_abandoned) == (0, 1)
    assert set(service.index.members("u1")) == {"left-1"}
    report = service.reconcile()
    assert (report.kept_in_flight, report.removed_abandoned) == (0, 1)
    assert service.index.members("u1") == {}
    assert service.create_unpaid_order("u1").user_id == "u1"
    assert rows_of(engine, "u1") == 1


def test_a_member_with_no_row_and_no_admission_on_record_goes_at_reconcile(
    stalled_service: OrderService, clock: ManualClock
) -> None:
    # Every admission keeps its record at least the window: a member without one (its hash
    # expired with it, or written by a create of an older version) is over.
    service = stalled_service
    service.index.client.zadd(service.index.key("u1"), {"bare-1": clock() + 600_000})

    report = service.reconcile()

    assert (report.kept_in_flight, report.removed_abandoned) == (0, 1)
    assert service.index.members("u1") == {}


def test_an_abandon_that_runs_first_makes_the_late_admission_add_nothing(
    stalled_service: OrderService, clock: ManualClock
) -> None:
    index, started_ms = stalled_service.index, clock()
    expiry = started_ms + 600_000

    index.abandon("u1", "o1", started_ms=started_ms)
    late = index.admit(AdmitRequest("u1", "o1", expires_at_ms=expiry, now_ms=started_ms, limit=1))
    older = index.admit(
        AdmitRequest("u1", "o1", expires_at_ms=expiry, now_ms=started_ms - 5, limit=1)
    )

    assert late.outcome is older.outcome is Admission.ABANDONED
    assert index.members("u1") == {}
    # A genuine retry starts later: it proceeds.
    retry = index.admit(
        AdmitRequest("u1", "o1", expires_at_ms=expiry + 1, now_ms=started_ms + 1, limit=1)
    )
    assert retry.outcome is Admission.ADMITTED
    assert index.members("u1") == {"o1": expiry + 1}


def test_an_abandon_that_runs_second_removes_only_the_member_of_its_own_attempt(
    stalled_service: OrderService, clock: ManualClock
) -> None:
    index, started_ms = stalled_service.index, clock()
    expiry = started_ms + 600_000

    index.admit(AdmitRequest("u1", "mine", expires_at_ms=expiry, now_ms=started_ms, limit=2))
    index.admit(AdmitRequest("u1", "twin", expires_at_ms=expiry, now_ms=started_ms + 3, limit=2))
    assert index.abandon("u1", "mine", started_ms=started_ms) is True
    # A concurrent twin of the same id admitted it with a start of its own: not ours.
    assert index.abandon("u1", "twin", started_ms=started_ms) is False

    assert index.members("u1") == {"twin": expiry}


def test_a_create_that_times_out_keeps_a_concurrent_twins_open_order(
    stalled_service: OrderService, clock: ManualClock, engine: Engine
) -> None:
    # The twin committed the same id for the same user: the abandon sees the open row in
    # SQL and leaves the member, even when the attempts started at the same millisecond.
    service = stalled_service
    twin = service.create_unpaid_order("u1", order_id="same-1")

    service.admitter.abandoner.abandon("u1", "same-1", twin.created_at_ms)

    assert set(service.index.members("u1")) == {"same-1"}
    assert rows_of(engine, "u1") == 1


#: The single path's bound (two socket timeouts of 0.5 s: the read and its one retry), and
#: the most a combined create may take beside it: 0.6 s for 32 threads scheduled on two
#: loaded cores. A follower that waited out the call in flight and then its own round trip
#: takes twice the bound (2.2 to 2.3 s measured), which this catches.
SINGLE_PATH_BOUND_S = 1.0
COMBINED_MARGIN_S = 0.6


@pytest.mark.timeout(120)
def test_combined_creates_in_a_stall_end_within_the_single_paths_bound(
    stallable_redis: RedisServer, engine: Engine
) -> None:
    """32 threads create in a loop through a stall with ``combine_creates``: a follower does
    not ask Redis again once the call it waited for found Redis silent, so every create
    ends (its order, or StoreUnavailable) within the bound a create alone keeps."""
    settings = Settings(redis_url=stallable_redis.url, combine_creates=True)
    service = OrderService(engine, build_redis(settings), settings)
    assert settings.redis_socket_timeout_s * 2 == SINGLE_PATH_BOUND_S
    durations: list[tuple[float, object]] = []
    stop = threading.Event()

    def create_until_stopped(thread: int) -> None:
        for n in range(10_000):
            if stop.is_set():
                return
            started = time.monotonic()
            try:
                outcome: object = service.create_unpaid_order(f"c{thread}-{n}")
            except StoreUnavailable as failed:
                outcome = failed
            durations.append((time.monotonic() - started, outcome))

    # A connection per thread before the stall, as in a process that was serving: one
    # opened during it waits for its handshake too, on either path.
    pool = service.index.client.connection_pool
    for connection in [pool.get_connection() for _ in range(32)]:  # each one connected
        pool.release(connection)
    try:
        service.create_unpaid_order("warm")
        woken = stall(stallable_redis, STALL_S)
        threads = [threading.Thread(target=create_until_stopped, args=(t,)) for t in range(32)]
        for thread in threads:
            thread.start()
        woken()
        stop.set()
        for thread in threads:
            thread.join(30)
    finally:
        stop.set()
        service.index.client.close()
    failed = [outcome for _, outcome in durations if isinstance(outcome, StoreUnavailable)]
    assert failed, "no create met the stall"
    assert service.combiner is not None
    assert service.combiner.stats.combined, "no create was combined"
    slowest_s, outcome = max(durations, key=lambda pair: pair[0])
    assert slowest_s < SINGLE_PATH_BOUND_S + COMBINED_MARGIN_S, (slowest_s, outcome)
