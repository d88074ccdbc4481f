"""The SQLite file deleted or replaced under a running process (issue 24, fault 3).

Before the check, ``rm orders.db`` left every pooled connection writing into the unlinked
file: creates and payments were acknowledged and lost, and the path then held an empty
database. Now the engine compares the file behind the path with the one it opened at every
checkout (``orders.sql.engine.refuse_replaced_sqlite_file``) and refuses reads and writes
with StoreUnavailable naming the file, before any statement runs, until the process
restarts; it never opens the path again, so it neither creates an empty database there nor
touches a file moved in its place.

1. In process, on the test's SQLite file, sync and async: delete the file, or put another
   database in its place with ``os.replace``; the next create and payment are refused and
   leave nothing in Redis, the other file keeps its bytes, and /readyz reports SQL down.
2. A worker process creating in a loop while the test removes the file: every create that
   starts after the ``rm`` is refused, typed, naming the file.
3. A transaction that checked out before the ``rm`` is refused at its commit.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, make_url

from orders.config import Settings
from orders.errors import StoreUnavailable
from orders.index.nodes import RedisClient
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from tests.support.clocks import now_ms
from tests.support.health import health_of
from tests.support.processes import child_env, run_orders, started

pytestmark = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def database_path(database_url: str) -> Path:
    database = make_url(database_url).database
    assert database
    return Path(database)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def another_database(path: Path) -> Path:
    """A small SQLite database of someone else's (rollback journal: no -wal beside it)."""
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE theirs (n INTEGER)")
        conn.execute("INSERT INTO theirs VALUES (42)")
    conn.close()
    return path


def assert_refused_naming(exc: pytest.ExceptionInfo[StoreUnavailable], path: Path) -> None:
    assert exc.value.store == "sql"
    assert str(path) in str(exc.value)


@pytest.mark.both_apis
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_or_replaced_file_refuses_the_next_create_and_payment_naming_it(
    make_service: Callable[..., OrderService],
    database_url: str,
    redis_client: RedisClient,
    tmp_path: Path,
    how: str,
) -> None:
    service = make_service()
    path = database_path(database_url)
    first = service.create_unpaid_order("u1")
    assert service.get_order(first.id).status.value == "unpaid"

    if how == "deleted":
        path.unlink()  # the -wal and -shm stay, as after `rm orders.db`
        theirs_digest = None
    else:
        theirs = another_database(tmp_path / "theirs.db")
        theirs_digest = digest(theirs)
        os.replace(theirs, path)

    with pytest.raises(StoreUnavailable) as created:
        service.create_unpaid_order("u2")
    assert_refused_naming(created, path)
    with pytest.raises(StoreUnavailable) as paid:
        service.mark_paid(first.id, payment_ref="pay-1")
    assert_refused_naming(paid, path)
    with pytest.raises(StoreUnavailable) as read:
        service.get_order(first.id)  # a read would see a ghost: refused too
    assert_refused_naming(read, path)

    assert redis_client.zcard("UnpaidOrder-u2") == 0  # the refused create left no member
    if theirs_digest is None:
        assert not path.exists()  # no empty database was made in its place
    else:
        assert digest(path) == theirs_digest
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT n FROM theirs").fetchall() == [(42,)]
        conn.close()


def test_readyz_reports_sql_down_once_the_file_is_gone(
    make_service: Callable[..., OrderService], database_url: str
) -> None:
    service = make_service()
    sweeper = Sweeper(service, owner="A", reconcile_at_start=False)
    try:
        health = health_of(sweeper)
        assert health.readyz()[0] == 200
        database_path(database_url).unlink()
        status, body = health.readyz()
    finally:
        sweeper.close()
    assert (status, body["checks"]) == (503, {"sql": "down: StoreUnavailable", "redis": "ok"})


@pytest.mark.timeout(180)
def test_a_worker_creating_in_a_loop_has_every_create_after_the_rm_refused(
    database_url: str, redis_options: dict[str, Any], tmp_path: Path
) -> None:
    path = database_path(database_url)
    config = {"name": "creator", "threads": 3, "refusals": 30, "deadline_s": 40}
    with started(
        [("create", config)],
        database_url=database_url,
        redis_options=redis_options,
        log_dir=tmp_path,
    ) as (worker,):
        worker.go()
        worker.wait_for("CREATED 20", timeout_s=60)  # it has written into the file
        removed_ms = now_ms()
        path.unlink()
        result = worker.result(timeout_s=120)

    # Before the check, the worker created into the deleted file until its deadline.
    assert result["errors"] == 0, result["error_samples"]
    outcomes: list[dict[str, Any]] = result["outcomes"]
    after = [o for o in outcomes if o["start_ms"] > removed_ms]
    # It stops at 30 refusals; those of creates in flight at the rm may be among them.
    assert len(after) >= config["refusals"] - config["threads"]
    assert [o for o in after if o["outcome"] != "refused"] == []
    assert {o["store"] for o in after} == {"sql"}
    assert all(str(path) in o["message"] for o in after)
    # A create in flight at the rm was checked out before it: the check at its commit
    # refuses it unless it committed before the rm (with the rest of the file's rows).
    # The report counts those acknowledged.
    in_flight = [o for o in outcomes if o["start_ms"] <= removed_ms < o["end_ms"]]
    acknowledged = sum(o["outcome"] == "created" for o in in_flight)
    print(
        f"SQLITE-RM-REPORT {len(outcomes) - len(after)} creates began before the rm, "
        f"{len(in_flight)} of them in flight ({acknowledged} acknowledged), "
        f"{len(after)} began after it, all refused"
    )


def test_a_transaction_begun_before_the_rm_is_refused_at_its_commit(
    make_service: Callable[..., OrderService], database_url: str
) -> None:
    service = make_service()
    path = database_path(database_url)
    engine = service.records.tx.engine
    with engine.connect() as conn:
        conn.exec_driver_sql("CREATE TABLE probe (n INTEGER)")
        conn.commit()
        conn.exec_driver_sql("INSERT INTO probe VALUES (1)")
        path.unlink()  # the connection was checked out before: only its commit can tell
        with pytest.raises(StoreUnavailable) as committed:
            conn.commit()
        assert_refused_naming(committed, path)
    assert not path.exists()


def test_a_hosts_own_engine_is_guarded_too(
    database_url: str, redis_client: RedisClient, redis_options: dict[str, Any]
) -> None:
    """Issue 46: a host's ``create_engine("sqlite:///...")``, as the README shows, had no
    guard: 20 of 20 creates after the ``rm`` were acknowledged into the unlinked file."""
    engine = create_engine(database_url)  # plain SQLAlchemy: none of build_engine's events
    service = OrderService(engine, redis_client, Settings(**redis_options))
    path = database_path(database_url)
    try:
        service.create_unpaid_order("u1")  # the engine has opened the file
        path.unlink()
        for n in range(20):
            with pytest.raises(StoreUnavailable) as created:
                service.create_unpaid_order(f"u{n + 2}")
            assert_refused_naming(created, path)
    finally:
        service.close()
    assert [redis_client.zcard(f"UnpaidOrder-u{n + 2}") for n in range(20)] == [0] * 20
    assert not path.exists()


@pytest.mark.parametrize("command", [("create", "u2"), ("db", "current")])
def test_a_fresh_process_finds_the_file_missing_and_creates_nothing(
    make_service: Callable[..., OrderService],
    database_url: str,
    redis_url: str,
    command: tuple[str, ...],
) -> None:
    """Issue 46: a new process (the CLI, a restarted worker) after ``rm orders.db`` made an
    empty file at the path and said "run `orders db upgrade`", while the rows sat in the
    unlinked file a running process still held. Its -wal and -shm, left at the path, tell
    that a database was there: now the new process says so, in one line, and exits 8."""
    service = make_service()  # the running process: it holds the file open
    service.create_unpaid_order("u1")
    path = database_path(database_url)
    path.unlink()  # as `rm orders.db`: the -wal and -shm stay while the file is held
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    fresh = run_orders(*command, env=env)
    assert fresh.returncode == 8, fresh.stderr
    assert fresh.stderr.count("\n") == 1, fresh.stderr
    assert f"the SQLite file {path} is missing" in fresh.stderr
    assert "orders db upgrade" not in fresh.stderr.split("nothing was created")[0]
    assert not path.exists()  # nothing was created in its place


@pytest.mark.parametrize("command", [("create", "u2"), ("db", "current"), ("db", "upgrade")])
def test_a_fresh_process_after_rm_of_the_file_and_its_wal_refuses_and_creates_nothing(
    make_service: Callable[..., OrderService],
    engine: Engine,
    database_url: str,
    redis_url: str,
    command: tuple[str, ...],
) -> None:
    """Issue 46: with every process stopped (SQLite then removes the -wal and -shm), or after
    ``rm orders.db*``, nothing at the path told that a database was there: a new process took
    it for a first use and made an empty one (``orders db upgrade`` a migrated empty one).
    The marker written beside the file when it was first opened now tells it: exit 8, one
    line, nothing created."""
    make_service().create_unpaid_order("u1")
    engine.dispose()  # every process stopped
    path = database_path(database_url)
    for leftover in path.parent.glob(f"{path.name}*"):  # rm orders.db*
        leftover.unlink()
    env = child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url)
    fresh = run_orders(*command, env=env)
    assert fresh.returncode == 8, fresh.stderr
    assert fresh.stderr.count("\n") == 1, fresh.stderr
    assert f"the SQLite file {path} is missing where one was first opened on " in fresh.stderr
    assert "`orders db upgrade --new`" in fresh.stderr
    assert not path.exists()


def test_orders_db_upgrade_new_starts_an_empty_embedded_database_only_when_asked(
    database_url: str, tmp_path: Path
) -> None:
    """The embedded default (ORDERS_HOME, no database URL) migrates its file on first use:
    after ``rm orders.db*`` it refuses like a configured file, and ``--new`` starts over."""
    home = tmp_path / "home"
    env = child_env(ORDERS_HOME=str(home))
    assert run_orders("db", "upgrade", env=env).returncode == 0
    path = home / "orders.db"
    for leftover in home.glob("orders.db*"):
        leftover.unlink()
    for command in (("db", "current"), ("db", "upgrade")):
        refused = run_orders(*command, env=env)
        assert refused.returncode == 8, refused.stderr
        assert "is missing where one was first opened on" in refused.stderr
        assert not path.exists()
    new = run_orders("db", "upgrade", "--new", env=env)
    assert new.returncode == 0, new.stderr
    assert run_orders("db", "current", env=env).returncode == 0
