"""A Redis that comes back with older data than it had: restarted from a saved RDB, or a
replica promoted that had not seen the last writes: the users' index and the resources'
(issue 43) alike.

The index epoch marker is part of Redis's data, so an older copy of the data brings back an
older, intact-looking marker. What tells a rewind from the outside is the server's run id
(new at every start; a promoted replica has its own), which the marker names: within a tick
or two of the scheduler's rebuild check, the index equals SQL again. A restart in the
middle of a rebuild is the same case: the marker names the run read before the rebuild
began, so the next check rebuilds again. The tests drive the sweeper's ``tick`` and
``reconcile_if_due`` themselves, on a manual clock; nothing sleeps.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import Engine

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.domain import Order
from orders.errors import UnpaidOrderLimitReached
from orders.scheduler.sweeper import LOGGER_NAME, Sweeper
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.redis_server import RedisServer

LIMIT = 2


@dataclass(frozen=True)
class Place:
    """Where the test's own redis-servers live, and which binary they run."""

    #: A short private folder (unix socket paths are limited to about 100 bytes).
    folder: Path
    binary: Path | None


@pytest.fixture
def place(redis_binary: Path | None) -> Iterator[Place]:
    path = Path(tempfile.mkdtemp(prefix="orw", dir="/tmp"))
    try:
        yield Place(path, redis_binary)
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_scenario(engine: Engine, database_url: str) -> Callable[[str], Scenario]:
    return lambda redis_url: Scenario(engine, database_url, redis_url)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def replicated(server: RedisServer) -> None:
    """Return once the one replica of ``server`` has every write so far."""
    with redis.Redis(unix_socket_path=str(server.socket), socket_timeout=30) as admin:
        assert admin.execute_command("WAIT", 1, 20_000) == 1, "the replica did not catch up"


def rebuild_reasons(caplog: pytest.LogCaptureFixture) -> list[str]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    return [line["reason"] for line in lines if line["event"] == "reconcile"]


def open_members(service: OrderService, users: list[str]) -> dict[str, dict[str, int]]:
    return {user: service.index.members(user) for user in users}


def expected(orders: list[Order]) -> dict[str, int]:
    return {order.id: order.expires_at_ms for order in orders}


class Scenario:
    """A service and an active sweeper on ``redis_url``; orders that the rewind undoes."""

    def __init__(self, engine: Engine, database_url: str, redis_url: str) -> None:
        settings = Settings(database_url=database_url, redis_url=redis_url, unpaid_limit=LIMIT)
        self.client = build_redis(settings)
        self.service = OrderService(engine, self.client, settings, clock=ManualClock())
        self.sweeper = Sweeper(self.service)

    def start(self) -> None:
        """The sweeper takes the lease and runs its startup rebuild (the marker is written);
        then two users' orders."""
        self.sweeper.tick()
        self.sweeper.reconcile_if_due()
        assert self.service.index.epoch.get() is not None
        # Each of payer's orders holds a unit of a resource of LIMIT units (issue 43).
        self.service.set_capacity("sku", LIMIT)
        self.payer = [
            self.service.create_unpaid_order("payer", ttl_s=600, holds={"sku": 1})
            for _ in range(LIMIT)
        ]
        self.keeper = self.service.create_unpaid_order("keeper", ttl_s=600)

    def change_after_the_copy(self) -> None:
        """What the older copy will not have: both of payer's orders paid (their members
        removed), and a new user's order."""
        for order in self.payer:
            self.service.mark_paid(order.id)
        self.service.set_capacity("sku", 2 * LIMIT)  # restocked: LIMIT free again
        self.newcomer = self.service.create_unpaid_order("newcomer", ttl_s=600)

    def assert_rewound(self) -> None:
        assert open_members(self.service, ["payer", "newcomer"]) == {
            "payer": expected(self.payer),  # paid in SQL, still holding both slots
            "newcomer": {},
        }
        # The resource as it was: both units held, none free, the restock unseen.
        assert self.resource() == (LIMIT, 0, LIMIT)

    def assert_healed_within_two_ticks(self, caplog: pytest.LogCaptureFixture) -> None:
        caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
        caplog.clear()
        for _ in range(2):
            self.sweeper.tick()
            self.sweeper.reconcile_if_due()
        assert open_members(self.service, ["payer", "keeper", "newcomer"]) == {
            "payer": {},
            "keeper": expected([self.keeper]),
            "newcomer": expected([self.newcomer]),
        }
        assert rebuild_reasons(caplog) == ["index_rewound"]
        assert self.resource() == (2 * LIMIT, LIMIT, 0)  # as SQL has it: sold, restocked
        again = [self.service.create_unpaid_order("payer", ttl_s=600) for _ in range(LIMIT)]
        assert open_members(self.service, ["payer"]) == {"payer": expected(again)}
        with pytest.raises(UnpaidOrderLimitReached):
            self.service.create_unpaid_order("payer", ttl_s=600)

    def resource(self) -> tuple[int, int, int] | None:
        """The index's (capacity, sold, held) of the test's resource."""
        snap = self.service.resource_index.snapshot("sku", self.service.clock())
        return None if snap is None else (snap.cap, snap.sold, snap.held)

    def close(self) -> None:
        self.sweeper.close()
        self.client.close()


@pytest.mark.timeout(60)
def test_redis_restarted_from_an_older_rdb_is_noticed_and_rebuilt_within_a_tick(
    make_scenario: Callable[[str], Scenario], place: Place, caplog: pytest.LogCaptureFixture
) -> None:
    folder = place.folder
    server = RedisServer(folder, binary=place.binary).start()
    scenario = make_scenario(server.url)
    try:
        scenario.start()
        scenario.client.save()  # the snapshot: the marker, payer's two open orders
        saved = folder / "saved.rdb"
        shutil.copyfile(folder / "dump.rdb", saved)
        scenario.change_after_the_copy()

        server.stop()  # SIGTERM by its PID (no save points: nothing saved at exit)
        shutil.copyfile(saved, folder / "dump.rdb")
        server.start()  # the same socket, the saved data
        scenario.assert_rewound()

        scenario.assert_healed_within_two_ticks(caplog)
    finally:
        scenario.close()
        server.stop()


@pytest.mark.timeout(60)
def test_a_promoted_replica_that_missed_the_last_writes_is_noticed_and_rebuilt_within_a_tick(
    make_scenario: Callable[[str], Scenario], place: Place, caplog: pytest.LogCaptureFixture
) -> None:
    folder, port = place.folder, free_port()
    (folder / "a").mkdir()
    (folder / "b").mkdir()
    primary = RedisServer(folder / "a", binary=place.binary, tcp_port=port).start()
    replica = RedisServer(
        folder / "b", "--replicaof", "127.0.0.1", str(port), binary=place.binary
    ).start()
    current = folder / "current.sock"  # the service's address: a link moved at the failover
    current.symlink_to(primary.socket)
    scenario = make_scenario(f"unix://{current}")
    try:
        scenario.start()
        replicated(primary)  # the replica has it all
        replica_client = build_redis(Settings(redis_url=replica.url))
        try:
            replica_client.execute_command("REPLICAOF", "NO", "ONE")  # promoted, the copy kept
        finally:
            replica_client.close()
        scenario.change_after_the_copy()  # lands on the old primary only

        primary.stop()
        link = folder / "next.sock"
        link.symlink_to(replica.socket)
        os.replace(link, current)  # the failover: the address now reaches the replica
        scenario.assert_rewound()

        scenario.assert_healed_within_two_ticks(caplog)
    finally:
        scenario.close()
        primary.stop()
        replica.stop()


@pytest.mark.timeout(60)
def test_a_redis_restarted_during_a_rebuild_is_rebuilt_again_at_the_next_check(
    make_scenario: Callable[[str], Scenario], place: Place, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisServer(place.folder, binary=place.binary).start()
    scenario = make_scenario(server.url)
    service = scenario.service
    users = ["keeper", "payer"]
    restarts: list[int] = []

    def restart_after_the_first_page(users_done: int) -> None:
        # Called after each page, the next page's scripts in flight (nobody is counted in
        # the SCAN pass: every key has an open order). The restart loses the first page's
        # user; the page in flight is answered by the old run or sent again to the new one.
        if users_done and not restarts:
            server.stop()
            server.start()
            restarts.append(users_done)

    try:
        scenario.start()
        service.reconcile(chunk_size=2, on_progress=restart_after_the_first_page)
        assert restarts == [1]
        assert service.index.members("keeper") == {}  # written before the restart, lost

        caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
        caplog.clear()
        scenario.sweeper.reconcile_if_due()
        assert rebuild_reasons(caplog) == ["index_rewound"]
        assert scenario.resource() == (LIMIT, 0, LIMIT)  # as SQL has it: both held
        in_sql = {user: expected(service.list_unpaid(user)) for user in users}
        assert in_sql == {"keeper": expected([scenario.keeper]), "payer": expected(scenario.payer)}
        assert open_members(service, users) == in_sql
    finally:
        scenario.close()
        server.stop()
