"""Managed Redis over TLS: ``rediss://`` on the synchronous service, the asyncio API, the
scheduler's sweep, the CLI and a Redis Cluster, against real redis-servers speaking TLS
only (their plain port is off), with the certificates made by ``openssl`` for the session.

The bad settings (a CA file missing or not a certificate, an unknown ``ssl_*`` option, TLS
options on a plain URL) are InvalidInput before anything connects; a server certificate
that does not verify (an unrelated CA, a name it was not made for) is StoreUnavailable
saying so, with nothing written. No message carries the password.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from click.testing import CliRunner
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry
from sqlalchemy import func, select

from orders import InvalidInput, OrderStatus, StoreUnavailable
from orders.aio import AsyncOrderService
from orders.aio.clients import sync_redis
from orders.aio.default import async_redis, build_async_service
from orders.bootstrap import build_async_engine, build_engine, build_service
from orders.cli import main
from orders.config import Settings
from orders.embedded.binary import find_redis_server
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.acl import ORDERS_ACL
from tests.support.clocks import ManualClock
from tests.support.tls import (
    HOST,
    WRONG_NAME_HOST,
    Certificates,
    TlsCluster,
    TlsServer,
    make_certificates,
    tls_folder,
    tls_options,
    tls_supported,
)

PREFIX = "UnpaidOrder-"
PASSWORD = "tls:pw@/%-d41d8cd98f00b204e9800998ecf8427e"
#: What the service's ACL user needs beyond ORDERS_ACL on a cluster, and all it needs
#: (measured: without either the cluster client does not start): redis-py's cluster
#: client reads the slot map (CLUSTER SLOTS) and the command table (COMMAND).
CLUSTER_GRANTS = " +cluster|slots +command"


@pytest.fixture(scope="session")
def tls_binary() -> Path:
    """The embedded default's server if it speaks TLS, else a redis-server on PATH."""
    candidates = [find_redis_server(), shutil.which("redis-server"), "/usr/bin/redis-server"]
    for candidate in filter(None, candidates):
        if Path(candidate).is_file() and tls_supported(Path(candidate)):
            return Path(candidate)
    pytest.skip(f"no redis-server that speaks TLS ({find_redis_server()} does not)")


@pytest.fixture(scope="session")
def tls_dir(tls_binary: Path) -> Iterator[Path]:
    with tls_folder() as folder:
        yield folder


@pytest.fixture(scope="session")
def certs(tls_dir: Path) -> Certificates:
    folder = tls_dir / "certs"
    folder.mkdir()
    return make_certificates(folder)


@pytest.fixture(scope="session")
def tls_server(tls_binary: Path, certs: Certificates, tls_dir: Path) -> Iterator[TlsServer]:
    """Client certificates optional; an ACL user ``orders`` limited to the service's keys."""
    server = TlsServer(tls_binary, certs, tls_dir / "server").start()
    try:
        server.add_user("orders", PASSWORD, ORDERS_ACL)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def strict_server(tls_binary: Path, certs: Certificates, tls_dir: Path) -> Iterator[TlsServer]:
    """``tls-auth-clients yes``: no client certificate, no connection."""
    server = TlsServer(tls_binary, certs, tls_dir / "strict", auth_clients="yes").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tls_cluster(tls_binary: Path, certs: Certificates, tls_dir: Path) -> Iterator[TlsCluster]:
    cluster = TlsCluster(tls_binary, certs, tls_dir / "cluster").start()
    try:
        cluster.add_user("orders", PASSWORD, ORDERS_ACL + CLUSTER_GRANTS)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def sqlite_url(sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "orders.db"
    shutil.copyfile(sqlite_template, path)
    return f"sqlite:///{path}"


@pytest.fixture
def admin(tls_server: TlsServer) -> Iterator[redis.Redis]:
    with tls_server.admin() as client:
        client.flushall()
        yield client


def user_url(server: TlsServer, **more: str) -> str:
    return server.url(user="orders", password=PASSWORD, **more)


def no_secret(text: str) -> bool:
    return PASSWORD not in text and PASSWORD.split("@")[1] not in text


def open_orders(database_url: str) -> int:
    engine = build_engine(Settings(database_url=database_url))
    try:
        with engine.connect() as conn:
            return int(conn.execute(select(func.count()).select_from(orders_table)).scalar_one())
    finally:
        engine.dispose()


# --- the synchronous service ------------------------------------------------------------


def test_sync_service_and_sweeper_over_tls_through_the_acl_user(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str
) -> None:
    clock = ManualClock()
    settings = Settings(database_url=sqlite_url, redis_url=user_url(tls_server))
    service = build_service(settings, clock=clock)
    try:
        paid = service.create_unpaid_order("u1", ttl_s=60)
        expiring = service.create_unpaid_order("u1", ttl_s=10)
        assert admin.zcard(f"{PREFIX}u1") == 2
        assert service.mark_paid(paid.id).status is OrderStatus.PAID
        assert admin.zscore(f"{PREFIX}u1", paid.id) is None

        # The scheduler's sweeper: lease, sweep, heartbeat, all over TLS.
        clock.advance(s=11)
        sweeper = Sweeper(service, owner="tls-sweeper", lease_ttl_s=5)
        sweeper.tick()
        assert sweeper.holds_lease
        assert admin.get(f"{PREFIX}[sweeper-lease]") == b"tls-sweeper"
        assert service.get_order(expiring.id).status is OrderStatus.CLOSED
        assert admin.exists(f"{PREFIX}u1") == 0
        sweeper.close()
        # The service's connections are the ACL user's, over TLS (the server has no other).
        users = {c["user"] for c in admin.client_list() if c["cmd"] != "client|list"}
        assert users == {"orders"}, users
    finally:
        service.close()


def test_a_host_client_is_used_as_it_is(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str
) -> None:
    """Its own pool, health checks, retry and TLS context: the very object, not a copy."""
    retry = Retry(NoBackoff(), 4)
    client = redis.Redis(
        host=HOST,
        port=tls_server.port,
        health_check_interval=7,
        retry=retry,
        client_name="host-pool",
        **tls_options(tls_server.certs),
    )
    engine = build_engine(Settings(database_url=sqlite_url))
    settings = Settings(database_url=sqlite_url)
    service = OrderService(engine, client, settings)
    try:
        assert service.index.client is client
        order = service.create_unpaid_order("u1")
        assert admin.zscore(f"{PREFIX}u1", order.id) is not None
        # The server sees the host's connection, by the name the host gave it.
        assert [c["name"] for c in admin.client_list()].count("host-pool") == 1
        # The connection the service's index got (pooled: the one the create used).
        used = service.index.client
        connection = used.connection_pool.get_connection()
        try:
            # redis-py gives each connection a copy of the client's Retry: the host's
            # policy (4 tries), not the service's (1).
            assert connection.retry == retry
            assert connection.retry.get_retries() == 4
            assert connection.health_check_interval == 7
            assert isinstance(connection, redis.SSLConnection)
            assert connection.ca_certs == str(tls_server.certs.ca)
        finally:
            used.connection_pool.release(connection)
    finally:
        engine.dispose()
        client.close()


# --- the asyncio API ---------------------------------------------------------------------


def test_async_service_over_tls_through_the_acl_user(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str
) -> None:
    settings = Settings(database_url=sqlite_url, redis_url=user_url(tls_server))

    async def scenario() -> None:
        host_client = await async_redis(settings)  # the host's own redis.asyncio client
        engine = build_async_engine(settings)
        async with AsyncOrderService(engine, host_client, settings) as service:
            order = await service.create_unpaid_order("u1", ttl_s=60)
            cancelled = await service.create_unpaid_order("u1", ttl_s=60)
            assert admin.zcard(f"{PREFIX}u1") == 2
            assert (await service.mark_paid(order.id)).status is OrderStatus.PAID
            assert (await service.cancel_order(cancelled.id)).status is OrderStatus.CANCELLED
            assert admin.exists(f"{PREFIX}u1") == 0
            core = await service.core()
            connection_class = core.index.client.connection_pool.connection_class
            assert issubclass(connection_class, redis.SSLConnection)

    asyncio.run(scenario())


def test_the_twin_client_carries_every_option_of_the_hosts_async_client(
    tls_server: TlsServer, admin: redis.Redis
) -> None:
    host = redis.asyncio.Redis(
        host=HOST,
        port=tls_server.port,
        username="default",
        client_name="host-async",
        socket_timeout=1.25,
        socket_connect_timeout=0.75,
        health_check_interval=9,
        ssl=True,
        ssl_ca_certs=str(tls_server.certs.ca),
        ssl_certfile=str(tls_server.certs.client_cert),
        ssl_keyfile=str(tls_server.certs.client_key),
        ssl_check_hostname=True,
    )

    client = sync_redis(host)
    try:
        kwargs = client.connection_pool.connection_kwargs
        carried = {
            name: kwargs[name]
            for name in ("username", "client_name", "socket_timeout", "socket_connect_timeout",
                         "health_check_interval", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile",
                         "ssl_check_hostname")
        }  # fmt: skip
        assert carried == {
            "username": "default",
            "client_name": "host-async",
            "socket_timeout": 1.25,
            "socket_connect_timeout": 0.75,
            "health_check_interval": 9,
            "ssl_ca_certs": str(tls_server.certs.ca),
            "ssl_certfile": str(tls_server.certs.client_cert),
            "ssl_keyfile": str(tls_server.certs.client_key),
            "ssl_check_hostname": True,
        }
        assert client.connection_pool.connection_class is redis.SSLConnection
        assert client.ping()
        assert [c["name"] for c in admin.client_list()].count("host-async") == 1
    finally:
        client.connection_pool.disconnect()
        asyncio.run(host.aclose())


# --- the CLI -----------------------------------------------------------------------------


def test_cli_create_and_list_over_tls(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str, tmp_path: Path
) -> None:
    env = {"ORDERS_HOME": str(tmp_path / "home"), "ORDERS_DATABASE_URL": sqlite_url}
    url = user_url(tls_server)
    created = CliRunner().invoke(main, ["--redis-url", url, "create", "u1", "--json"], env=env)
    assert created.exit_code == 0, created.output
    assert admin.zcard(f"{PREFIX}u1") == 1
    listed = CliRunner().invoke(
        main, ["user", "u1", "--json"], env={**env, "ORDERS_REDIS_URL": url}
    )
    assert listed.exit_code == 0, listed.output
    assert created.stdout.split('"id": ')[1][:40] in listed.stdout
    swept = CliRunner().invoke(main, ["--redis-url", url, "sweep"], env=env)
    assert swept.exit_code == 0, swept.output


# --- a Redis Cluster over TLS ------------------------------------------------------------


def test_sync_service_on_a_tls_cluster(tls_cluster: TlsCluster, sqlite_url: str) -> None:
    tls_cluster.flush()
    clock = ManualClock()
    url = tls_cluster.url(user="orders", password=PASSWORD)
    settings = Settings(database_url=sqlite_url, redis_url=url, redis_cluster=True)
    service = build_service(settings, clock=clock)
    try:
        users = [f"user-{n}" for n in range(12)]  # spread over the three primaries
        orders = [service.create_unpaid_order(user, ttl_s=10) for user in users]
        assert service.mark_paid(orders[0].id).status is OrderStatus.PAID
        clock.advance(s=11)
        assert service.sweep_expired().closed == len(users) - 1
        assert service.reconcile().added == 0
    finally:
        service.close()


def users_keys(client: redis.Redis) -> list[bytes]:
    return list(client.scan_iter(f"{PREFIX}user-*"))


def test_async_service_on_a_tls_cluster(tls_cluster: TlsCluster, sqlite_url: str) -> None:
    tls_cluster.flush()
    url = tls_cluster.url(user="orders", password=PASSWORD)
    settings = Settings(database_url=sqlite_url, redis_url=url, redis_cluster=True)

    async def scenario() -> None:
        host_client = await async_redis(settings)  # the host's own redis.asyncio client
        engine = build_async_engine(settings)
        async with AsyncOrderService(engine, host_client, settings) as service:
            assert isinstance(service.redis_client, AsyncRedisCluster)
            orders = [await service.create_unpaid_order(f"user-{n}") for n in range(12)]
            for order in orders:
                assert (await service.cancel_order(order.id)).status is OrderStatus.CANCELLED
            core = await service.core()
            primaries = core.index.client.get_primaries()  # type: ignore[union-attr]
            assert len(primaries) == 3
            for node in primaries:
                pool = node.redis_connection.connection_pool
                assert issubclass(pool.connection_class, redis.SSLConnection)
                assert await service.calls.call(users_keys, node.redis_connection) == []

    asyncio.run(scenario())


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_tls_cluster_whose_certificate_does_not_verify_says_so(
    tls_cluster: TlsCluster, sqlite_url: str, api: str
) -> None:
    url = tls_cluster.url(ssl_ca_certs=str(tls_cluster.certs.other_ca))
    settings = Settings(database_url=sqlite_url, redis_url=url, redis_cluster=True)

    def build() -> None:
        if api == "sync":
            build_service(settings).close()
            return

        async def scenario() -> None:
            service = await build_async_service(settings)
            await service.aclose()

        asyncio.run(scenario())

    with pytest.raises(StoreUnavailable) as info:
        build()
    assert "the server's TLS certificate did not verify (" in str(info.value), str(info.value)
    assert open_orders(sqlite_url) == 0


# --- bad input ----------------------------------------------------------------------------


def bad_urls(server: TlsServer, certs: Certificates) -> dict[str, tuple[str, str]]:
    """name -> (URL, what the one line says)."""
    url = user_url(server)
    return {
        "missing CA file": (
            user_url(server, ssl_ca_certs=str(certs.folder / "gone.crt")),
            "ssl_ca_certs file does not exist",
        ),
        "CA file not a certificate": (
            user_url(server, ssl_ca_certs=str(certs.not_a_cert)),
            "ssl_ca_certs file holds no PEM certificate",
        ),
        "unknown ssl option": (url + "&ssl_verify=yes", "unknown TLS option ssl_verify"),
        "bad ssl_cert_reqs": (
            url.replace("ssl_cert_reqs=required", "ssl_cert_reqs=maybe"),
            "ssl_cert_reqs must be none, optional or required",
        ),
        "TLS options on redis://": (
            url.replace("rediss://", "redis://"),
            "has TLS options (ssl_*) but does not start rediss://",
        ),
        "client key not a key": (
            user_url(server, ssl_keyfile=str(certs.not_a_cert)),
            "hold no certificate and its key",
        ),
    }


BAD_SETTINGS = [
    "missing CA file",
    "CA file not a certificate",
    "unknown ssl option",
    "bad ssl_cert_reqs",
    "TLS options on redis://",
    "client key not a key",
]


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_tls_settings_are_invalid_input_before_anything_connects(
    tls_server: TlsServer, sqlite_url: str, tmp_path: Path, case: str
) -> None:
    url, said = bad_urls(tls_server, tls_server.certs)[case]
    with pytest.raises(InvalidInput) as info:
        Settings(database_url=sqlite_url, redis_url=url)
    assert said in str(info.value)
    assert no_secret(str(info.value))
    result = CliRunner().invoke(
        main,
        ["create", "u1"],
        env={
            "ORDERS_HOME": str(tmp_path / "home"),
            "ORDERS_DATABASE_URL": sqlite_url,
            "ORDERS_REDIS_URL": url,
        },
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert said in result.stderr
    assert no_secret(result.output)
    assert open_orders(sqlite_url) == 0


def handshake_cases(server: TlsServer) -> dict[str, tuple[str, str]]:
    """name -> (URL, what the error says)."""
    certs = server.certs
    return {
        "wrong CA": (
            user_url(server, ssl_ca_certs=str(certs.other_ca)),
            "the server's TLS certificate did not verify (",
        ),
        "name mismatch": (
            user_url(server).replace(HOST, WRONG_NAME_HOST),
            "the server's TLS certificate did not verify (IP address mismatch",
        ),
    }


@pytest.mark.parametrize("case", ["wrong CA", "name mismatch"])
@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_certificate_that_does_not_verify_is_store_unavailable_saying_so(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str, tmp_path: Path, case: str, api: str
) -> None:
    url, said = handshake_cases(tls_server)[case]
    settings = Settings(database_url=sqlite_url, redis_url=url)
    if api == "sync":
        service = build_service(settings, startup_warnings=False)
        try:
            with pytest.raises(StoreUnavailable) as info:
                service.create_unpaid_order("u1")
        finally:
            service.close()
    else:

        async def scenario() -> StoreUnavailable:
            service = AsyncOrderService(
                build_async_engine(settings), redis.asyncio.Redis.from_url(url), settings
            )
            try:
                with pytest.raises(StoreUnavailable) as caught:
                    await service.create_unpaid_order("u1")
                return caught.value
            finally:
                await service.aclose()

        error = asyncio.run(scenario())
        info = pytest.ExceptionInfo.from_exc_info((type(error), error, error.__traceback__))
    assert info.value.store == "redis"
    assert said in str(info.value), str(info.value)
    assert no_secret(str(info.value))
    assert open_orders(sqlite_url) == 0
    assert admin.exists(f"{PREFIX}u1") == 0
    if api == "sync":
        env = {"ORDERS_HOME": str(tmp_path / "home"), "ORDERS_DATABASE_URL": sqlite_url}
        result = CliRunner().invoke(main, ["--redis-url", url, "create", "u1"], env=env)
        assert result.exit_code == 8, result.output
        assert result.stderr.count("\n") == 1, result.stderr
        assert said in result.stderr
        assert no_secret(result.output)


def create_one(api: str, database_url: str, redis_url: str, **more: Any) -> Any:
    """One order for ``u1`` through a service built from these settings, on ``api``."""
    settings = Settings(database_url=database_url, redis_url=redis_url, **more)
    if api == "sync":
        service = build_service(settings, startup_warnings=False)
        try:
            return service.create_unpaid_order("u1")
        finally:
            service.close()

    async def scenario() -> Any:
        async with await build_async_service(settings, startup_warnings=False) as service:
            return await service.create_unpaid_order("u1")

    return asyncio.run(scenario())


@pytest.mark.parametrize("api", ["sync", "async"])
def test_the_name_check_can_be_turned_off_in_the_url(
    tls_server: TlsServer, admin: redis.Redis, sqlite_url: str, api: str
) -> None:
    """The control of the mismatch case: the same wrong name, the check off, it works."""
    url = user_url(tls_server, ssl_check_hostname="false").replace(HOST, WRONG_NAME_HOST)
    order = create_one(api, sqlite_url, url)
    assert admin.zscore(f"{PREFIX}u1", order.id) is not None


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_server_that_requires_client_certificates(
    strict_server: TlsServer, sqlite_url: str, api: str
) -> None:
    with pytest.raises(StoreUnavailable) as info:
        create_one(api, sqlite_url, strict_server.url(client_cert=False))
    assert info.value.store == "redis"
    assert open_orders(sqlite_url) == 0
    assert create_one(api, sqlite_url, strict_server.url()).user_id == "u1"


@pytest.mark.parametrize("api", ["sync", "async"])
def test_a_tls_server_that_stops_answering_fails_within_the_socket_timeout(
    tls_binary: Path, certs: Certificates, tls_dir: Path, sqlite_url: str, api: str
) -> None:
    """Frozen (SIGSTOP) before the first call: the kernel still accepts the connection,
    the TLS handshake gets no answer, and the connect timeout ends it."""
    server = TlsServer(tls_binary, certs, tls_dir / f"frozen-{api}").start()
    try:
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            create_one(api, sqlite_url, server.url(), redis_socket_timeout_s=0.3)
        took_s = time.monotonic() - started
        assert info.value.store == "redis"
        assert took_s < 2.0, took_s
        assert open_orders(sqlite_url) == 0
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()
