"""The embedded default heals itself: real processes whose redis-server is killed with -9.

A host app (the module-level API in a child python) and ``orders scheduler`` keep running
while the embedded redis-server of their home dies; their next call that needs Redis starts
it again (under the home's lock, so one home keeps one server), from its append-only file.
Every test kills the server by the pid it reports, stops its children by their PIDs and the
embedded server at the end with ``stop_redis``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import Engine, func, select

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.embedded.server import redis_status, stop_redis
from orders.index.lease import SweeperLease
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.processes import REPO, child_env, servers_under, stop_process

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/cwd").exists(), reason="finds servers through /proc (Linux)"
)

LIMIT = 4
USERS = 5

#: A host app: creates orders in a loop through the module-level API, cancelling a user's
#: oldest order when it is refused at the limit, and logs every outcome with its time
#: (CLOCK_MONOTONIC, the same for every process on the machine) to a file; an acknowledged
#: create with the time it was called and the time it returned.
HOST_APP = """
import sys, time
from pathlib import Path
import orders
from orders.errors import OrdersError, UnpaidOrderLimitReached

log_path, stop, prefix, limit = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
users = int(sys.argv[5])
with log_path.open("a", buffering=1) as log:
    i = 0
    while not stop.exists():
        user = f"{prefix}{i % users}"
        i += 1
        started = time.monotonic()
        try:
            order = orders.create_unpaid_order(user, ttl_s=600, limit=limit)
        except UnpaidOrderLimitReached:
            try:
                oldest = orders.list_unpaid(user)[0]
                orders.cancel_order(oldest.id)
            except OrdersError as exc:
                log.write(f"err {type(exc).__name__} {time.monotonic()} {exc} {exc.__cause__!r}\\n")
            else:
                log.write(f"cancel {oldest.id} {time.monotonic()}\\n")
            continue
        except OrdersError as exc:
            log.write(f"err {type(exc).__name__} {time.monotonic()} {exc} {exc.__cause__!r}\\n")
            time.sleep(0.01)
            continue
        log.write(f"ok {order.id} {started} {time.monotonic()}\\n")
"""


@dataclass
class HostLog:
    """What a host app wrote: its acknowledged creates and its failures, with their times."""

    created: list[tuple[str, float, float]]  # id, called at, returned at
    cancelled: list[str]
    errors: list[tuple[str, float, str]]  # error type, when, what it says

    @classmethod
    def read(cls, path: Path) -> HostLog:
        created, cancelled, errors = [], [], []
        text = path.read_text() if path.exists() else ""
        for line in text.split("\n")[:-1]:  # not a last line still being written
            kind, what, *times = line.split(" ", 3)
            if kind == "ok":
                created.append((what, float(times[0]), float(times[1])))
            elif kind == "cancel":
                cancelled.append(what)
            else:
                errors.append((what, float(times[0]), times[1]))
        return cls(created, cancelled, errors)

    @property
    def redis_errors(self) -> list[tuple[str, float, str]]:
        """The failures Redis caused. (A rare SQLite "database is locked" under two busy
        processes is not what these tests are about, and is left visible in ``errors``.)"""
        return [e for e in self.errors if e[2].startswith("redis unavailable")]

    def created_after(self, at: float) -> list[float]:
        """When each create called after ``at`` returned."""
        return [returned for _, called, returned in self.created if called > at]


# --- helpers --------------------------------------------------------------------------------


def wait_for(what: str, condition: object, timeout_s: float, *procs: subprocess.Popen[str]) -> None:
    """Poll ``condition()`` until true; fail after ``timeout_s`` or if a child has exited."""
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                stderr = proc.communicate()[1]
                pytest.fail(f"a child exited ({proc.returncode}) before: {what}\n{stderr}")
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.02)


def kill_server(home: Path) -> tuple[int, float]:
    """SIGKILL the embedded redis-server of ``home``: its pid and the monotonic time."""
    running = redis_status(home)
    assert running is not None
    os.kill(running.pid, signal.SIGKILL)
    return running.pid, time.monotonic()


def new_server(home: Path, old_pid: int) -> bool:
    running = redis_status(home)  # read-only: PINGs, never starts one
    return running is not None and running.pid != old_pid


def plain_client(home: Path) -> redis.Redis:
    """A client on the embedded socket that never starts a server (no healing)."""
    return redis.Redis(
        unix_socket_path=str(home / "redis.sock"),
        socket_timeout=2,
        socket_connect_timeout=2,
        retry=Retry(NoBackoff(), 1),
    )


def sql_orders(engine: Engine) -> dict[str, tuple[str, str]]:
    """Every order in SQL: id -> (user, status)."""
    query = select(orders_table.c.id, orders_table.c.user_id, orders_table.c.status)
    with engine.connect() as conn:
        return {row.id: (row.user_id, row.status) for row in conn.execute(query)}


def start_host_app(home: Path, log: Path, stop: Path, prefix: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOST_APP, str(log), str(stop), prefix, str(LIMIT), str(USERS)],
        env=child_env(ORDERS_HOME=str(home)),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def stop_children(stop: Path, procs: list[subprocess.Popen[str]]) -> list[str]:
    """Ask the host apps to stop (then SIGKILL by PID); their stderr."""
    stop.touch()
    stderrs = []
    for proc in procs:
        deadline = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        stop_process(proc, signum=signal.SIGKILL)
        stderrs.append(proc.communicate()[1])
    return stderrs


def assert_stores_agree(home: Path, logs: list[HostLog], prefixes: list[str]) -> None:
    """Every acknowledged create is in SQL; the limit holds in SQL; after a reconcile the
    Redis members are exactly the SQL open orders."""
    settings = Settings(home=home)
    engine = build_engine(settings)
    client = plain_client(home)
    try:
        rows = sql_orders(engine)
        for log in logs:
            assert {oid for oid, _, _ in log.created} <= set(rows)
            for oid in log.cancelled:
                assert rows[oid][1] == "cancelled"
        users = [f"{p}{i}" for p in prefixes for i in range(USERS)]
        service = OrderService(engine, client, settings)
        service.reconcile()
        for user in users:
            open_ids = {
                oid for oid, (u, status) in rows.items() if u == user and status == "unpaid"
            }
            assert len(open_ids) <= LIMIT, (user, len(open_ids))
            assert set(service.index.members(user)) == open_ids, user
    finally:
        client.close()
        engine.dispose()


@pytest.fixture
def home(embedded_binary: None) -> Iterator[Path]:
    """A short home under /tmp; its server is stopped after, and nothing may be left."""
    path = Path(tempfile.mkdtemp(prefix="oe", dir="/tmp")).resolve()
    try:
        yield path
    finally:
        problems = []
        try:
            stop_redis(path, timeout_s=10)
        except Exception as exc:
            problems.append(f"stop_redis: {exc}")
        for pid in servers_under(path):
            problems.append(f"redis-server pid {pid} still running: SIGKILLed")
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        assert not problems, problems


# --- tests ----------------------------------------------------------------------------------


def test_a_host_app_restarts_its_dead_server_and_loses_nothing(home: Path) -> None:
    log_path, stop = home / "host.log", home / "stop"
    proc = start_host_app(home, log_path, stop, "u")
    try:
        wait_for("20 creates", lambda: len(HostLog.read(log_path).created) >= 20, 60, proc)
        old_pid, killed_at = kill_server(home)
        wait_for(
            "20 creates after the kill",
            lambda: len(HostLog.read(log_path).created_after(killed_at)) >= 20,
            30,
            proc,
        )
    finally:
        (stderr,) = stop_children(stop, [proc])
    log = HostLog.read(log_path)
    gap_s = min(log.created_after(killed_at)) - killed_at
    print(f"\nthe first create called after the kill returned {gap_s * 1000:.1f} ms after it")
    # A liveness bound on the mechanism, not a speed figure (that is reported above).
    assert gap_s < 5
    # Not even the first call after the death failed.
    assert log.redis_errors == [], (log.errors, stderr)
    running = redis_status(home)
    assert running is not None
    assert running.pid != old_pid
    assert f"{running.program} pid {running.pid} serves it now" in stderr
    assert log.cancelled, "the limit was never reached: the test proves less than it says"
    assert_stores_agree(home, [log], ["u"])


def test_the_scheduler_restarts_its_dead_server_within_its_next_ticks(home: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", "scheduler", "--interval", "0.5"],
        env=child_env(ORDERS_HOME=str(home)),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    settings = Settings(home=home)
    engine = build_engine(settings)
    client = plain_client(home)
    try:
        wait_for(
            "the scheduler starts the server", lambda: redis_status(home) is not None, 60, proc
        )
        service = OrderService(engine, client, settings)
        # It has started (not still starting the server) once it holds the sweep lease.
        lease = SweeperLease(client, key_prefix=service.index.key_prefix)
        wait_for("the scheduler's first tick", lambda: lease.owner() is not None, 60, proc)
        before = service.create_unpaid_order("u1", ttl_s=2)  # expires after the kill
        old_pid, killed_at = kill_server(home)

        wait_for("a new server", lambda: new_server(home, old_pid), 20, proc)
        back_s = time.monotonic() - killed_at
        print(f"\nthe scheduler's new server answered {back_s:.2f} s after the kill")
        assert client.ping() is True  # the new server answers on the socket
        after = service.create_unpaid_order("u2", ttl_s=0.5)
        wait_for(
            "both orders closed",
            lambda: {sql_orders(engine)[o.id][1] for o in (before, after)} == {"closed"},
            30,
            proc,
        )
        # The scheduler released the member of the order it closed on the new server.
        wait_for("u2's member released", lambda: service.index.members("u2") == {}, 10, proc)
    finally:
        stop_process(proc, signum=signal.SIGTERM, timeout_s=15)
        stderr = proc.communicate()[1]
    try:
        assert proc.returncode == 0, stderr
        running = redis_status(home)
        assert running is not None
        assert running.pid != old_pid
        assert f"{running.program} pid {running.pid} serves it now" in stderr
        with engine.connect() as conn:
            closes = conn.execute(
                select(events_table.c.order_id, func.count())
                .where(events_table.c.kind == "closed")
                .group_by(events_table.c.order_id)
            ).all()
        assert sorted(closes) == sorted([(before.id, 1), (after.id, 1)])
        service.reconcile()
        assert service.index.members("u1") == service.index.members("u2") == {}
    finally:
        client.close()
        engine.dispose()


def test_two_processes_that_find_it_dead_at_once_start_one_server(home: Path) -> None:
    stop = home / "stop"
    logs = [home / "a.log", home / "b.log"]
    procs = [start_host_app(home, log, stop, p) for log, p in zip(logs, "ab", strict=True)]
    try:
        wait_for(
            "20 creates in each",
            lambda: min(len(HostLog.read(log).created) for log in logs) >= 20,
            60,
            *procs,
        )
        old_pid, killed_at = kill_server(home)
        wait_for(
            "20 creates after the kill in each",
            lambda: min(len(HostLog.read(log).created_after(killed_at)) for log in logs) >= 20,
            30,
            *procs,
        )
        running = redis_status(home)
        assert running is not None
        assert running.pid != old_pid
        assert int((home / "redis.pid").read_text()) == running.pid
        assert servers_under(home) == [running.pid]  # no second server left running
    finally:
        stderrs = stop_children(stop, procs)
    # Each process that noticed either started it or found the one the other started.
    named = {int(pid) for e in stderrs for pid in re.findall(r"pid (\d+) serves it now", e)}
    assert named == {running.pid}, stderrs
    read = [HostLog.read(log) for log in logs]
    assert [r.redis_errors for r in read] == [[], []], ([r.errors for r in read], stderrs)
    assert_stores_agree(home, read, ["a", "b"])
