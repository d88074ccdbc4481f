"""The service on a Redis that wants a password, through an ACL user that may touch only
the service's keys with only the commands the service sends.

The commands, found in ``orders/index/unpaid.py`` and ``orders/index/lua/*.lua``:

* redis-py ``Script`` objects send EVALSHA, and SCRIPT LOAD when the server answers
  NOSCRIPT; never EVAL;
* inside the scripts: ZREMRANGEBYSCORE, ZSCORE, ZCOUNT, ZRANGE, ZADD, PERSIST (admit,
  reconcile), HGET, HGETALL, HSET, HDEL, PEXPIRE, ZREM (admit
  and abandon: the admissions hash), SET, GET, PEXPIRE, DEL (lease, lease_release), HSET,
  HGETALL, HDEL, PEXPIRE (heartbeat);
* outside them: ZREM (release), ZADD XX (extend_order, resume), ZREMRANGEBYSCORE
  pipelines (sweep), ZRANGE (members,
  reconcile), GET/SET (index epoch, lease owner), INFO (the server's run id, which the
  index epoch names: reconcile and the scheduler's check), SCAN (reconcile), HGETALL
  (reading the heartbeats), HDEL (a stopping scheduler's beat), HGET (reconcile: when a
  create started);
* PING, which redis-py sends as its health check on a connection idle for 30 s.

Not granted, and shown to be unnecessary: CONFIG GET (the startup warnings give up
quietly), CLIENT SETINFO (redis-py ignores the refusal), SELECT (db 0 is never selected),
EVAL, and every key outside ``UnpaidOrder-*``. The default user is switched off. Without
INFO the service still works, but a Redis rewound to older data goes unnoticed until the
scheduled rebuild (said once in a warning).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import socket
import tempfile
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import Engine

from orders import OrderStatus, StoreUnavailable
from orders.bootstrap import build_redis, build_service
from orders.cli import main
from orders.config import Settings
from orders.index.admissions import Admission, AdmitRequest
from orders.index.epoch import IndexEpoch
from orders.index.unpaid import UnpaidIndex
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from tests.support.acl import ORDERS_ACL, PREFIX, SERVICE_COMMANDS
from tests.support.clocks import ManualClock
from tests.support.redis_server import RedisServer
from tests.support.reports import record_texts

pytestmark = pytest.mark.every_server

#: Characters that must be percent-encoded in a URL, so the test also shows that the
#: password survives the trip through ``redis_url``.
PASSWORD = "pw@:/%-" + secrets.token_hex(12)
ADMIN_PASSWORD = "admin-" + secrets.token_hex(12)

#: Refusals the service meets and survives: CONFIG GET (startup warnings) and CLIENT
#: SETINFO (redis-py on connect). Any other refusal means the ACL is missing a grant.
EXPECTED_REFUSALS = {"config", "client"}


@dataclass
class AclRedis:
    server: RedisServer
    #: The test's own connection: over TCP, so that MONITOR tells it from the service's
    #: connections, which use the unix socket.
    admin: redis.Redis

    @property
    def socket(self) -> str:
        return str(self.server.socket)

    def url(self, *, user: str = "orders", password: str = PASSWORD) -> str:
        """The ``unix://user:password@/path?db=0`` form, the password percent-encoded."""
        return f"unix://{quote(user, safe='')}:{quote(password, safe='')}@{self.socket}?db=0"

    def query_url(self, *, user: str = "orders", password: str = PASSWORD) -> str:
        """The ``unix:///path?db=0&username=...&password=...`` form."""
        return (
            f"unix://{self.socket}?db=0&username={quote(user, safe='')}"
            f"&password={quote(password, safe='')}"
        )


@pytest.fixture(scope="module")
def acl_redis(redis_binary: Path | None) -> Iterator[AclRedis]:
    """A redis-server with an ACL file: ``orders`` (restricted), ``admin`` (for the test's
    own checks), and ``default``, switched off once the server is up.

    ``RedisServer.start()`` waits with an unauthenticated PING, so the file lets the default
    user PING and nothing else; the fixture then turns the default user off. The server also
    listens on a loopback port, for the admin connection only.
    """
    folder = Path(tempfile.mkdtemp(prefix="oacl", dir="/tmp"))
    acl_file = folder / "users.acl"
    acl_file.write_text(
        "user default on nopass resetchannels -@all +ping\n"
        f"user admin on >{ADMIN_PASSWORD} ~* &* +@all\n"
        f"user orders {ORDERS_ACL} >{PASSWORD}\n"
    )
    server = RedisServer(
        folder, "--aclfile", str(acl_file), binary=redis_binary, tcp_port=free_tcp_port()
    )
    admin = None
    try:
        server.start()
        admin = admin_client(server)
        admin.execute_command("ACL", "SETUSER", "default", "off")
        yield AclRedis(server, admin)
    finally:
        if admin is not None:
            admin.close()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def admin_client(server: RedisServer, *, socket_timeout_s: float = 5) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=server.tcp_port,
        username="admin",
        password=ADMIN_PASSWORD,
        socket_timeout=socket_timeout_s,
    )


@pytest.fixture
def admin(acl_redis: AclRedis) -> redis.Redis:
    """The admin connection, on an empty server with no scripts and no ACL log."""
    client = acl_redis.admin
    client.flushall()
    client.script_flush()
    client.acl_log_reset()
    return client


def secrets_in(text: str) -> list[str]:
    """The forms of the password found in ``text`` (raw, percent-encoded, its tail)."""
    forms = {PASSWORD, quote(PASSWORD, safe=""), PASSWORD[-24:]}
    return [form for form in forms if form in text]


def all_log_text(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(record_texts(caplog.records))


def refused_commands(admin: redis.Redis) -> dict[str, set[str]]:
    """ACL LOG as {reason: {command}} (``client|setinfo`` counts as ``client``)."""
    found: dict[str, set[str]] = {}
    for entry in admin.acl_log(count=100):
        reason, thing = str(entry["reason"]), str(entry["object"])
        found.setdefault(reason, set()).add(thing.split("|", maxsplit=1)[0].lower())
    return found


#: Commands whose first argument names a subcommand, which ACLs grant one by one.
CONTAINER_COMMANDS = {"script", "client", "config", "acl"}


@contextlib.contextmanager
def service_commands(acl_redis: AclRedis) -> Iterator[set[str]]:
    """The commands the service's own connections ran inside the block, scripts' included.

    MONITOR, not server-wide statistics: those count the admin's checks too, so a grant the
    service never uses would look used whenever the test itself sends that command. The
    admin talks over TCP and the service over the unix socket, so the address tells them
    apart; commands run by a script (``lua``) are the service's, as the admin runs none.
    The set is complete when the block ends: a marker the admin sends last closes it.
    """
    used: set[str] = set()
    errors: list[BaseException] = []
    marker = "end-of-service-commands-" + secrets.token_hex(8)
    watcher = admin_client(acl_redis.server, socket_timeout_s=60)
    with watcher.monitor() as monitor:

        def read() -> None:
            try:
                for entry in monitor.listen():
                    words = [w.lower() for w in entry["command"].split()]
                    if entry["client_type"] == "tcp":
                        if words == ["echo", marker]:
                            return
                        assert words[0] not in {"eval", "evalsha", "fcall"}, words
                    elif words[0] in CONTAINER_COMMANDS:
                        used.add(f"{words[0]}|{words[1]}")
                    else:
                        used.add(words[0])
            except BaseException as exc:
                errors.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            yield used
        finally:
            acl_redis.admin.echo(marker)
            reader.join(30)
    watcher.close()
    assert not reader.is_alive(), "MONITOR never showed the end marker"
    if errors:
        raise errors[0]


def granted_but_unused(used: set[str]) -> list[str]:
    return [c for c in SERVICE_COMMANDS if c not in used]


# --- the service through the restricted user --------------------------------------------


def test_every_use_case_works_through_the_restricted_user_and_needs_every_grant(
    acl_redis: AclRedis,
    admin: redis.Redis,
    database_url: str,
    logs: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock()
    settings = Settings(database_url=database_url, redis_url=acl_redis.url())
    with service_commands(acl_redis) as used:
        service = build_service(settings, clock=clock)
        try:
            # The startup warnings need CONFIG GET, which this user may not run: none, quietly.
            assert service.index.server_warnings() == []
            admin_view = UnpaidIndex(admin, key_prefix=PREFIX)
            assert any("persistence" in w for w in admin_view.server_warnings())

            paid = service.create_unpaid_order("u1", ttl_s=60)
            cancelled = service.create_unpaid_order("u1", ttl_s=60)
            expiring = service.create_unpaid_order("u1", ttl_s=10)
            kept = service.create_unpaid_order("u2", ttl_s=600)
            assert admin.zcard(f"{PREFIX}u1") == 3

            assert service.mark_paid(paid.id, payment_ref="psp-1").status is OrderStatus.PAID
            assert admin.zscore(f"{PREFIX}u1", paid.id) is None
            assert service.cancel_order(cancelled.id).status is OrderStatus.CANCELLED
            assert admin.zscore(f"{PREFIX}u1", cancelled.id) is None

            clock.advance(s=11)
            swept = service.sweep_expired()
            assert (swept.closed, swept.redis_errors) == (1, 0)
            assert service.get_order(expiring.id).status is OrderStatus.CLOSED
            assert admin.zscore(f"{PREFIX}u1", expiring.id) is None

            # Redis loses a member; reconcile (one user, then everyone) puts it back.
            admin.zrem(f"{PREFIX}u2", kept.id)
            assert service.reconcile(user_id="u2").added == 1
            assert admin.zscore(f"{PREFIX}u2", kept.id) == kept.expires_at_ms
            admin.delete(f"{PREFIX}u2")
            assert service.reconcile().added == 1
            run_id = admin.info("server")["run_id"]
            assert admin.get(f"{PREFIX}[index-epoch]") == f"{clock()}:{run_id}".encode()
            extended = service.extend_order(kept.id, 60)
            assert admin.zscore(f"{PREFIX}u2", kept.id) == extended.expires_at_ms

            # The sweeper: take the lease (and rebuild at startup), renew it, give it up.
            sweeper = Sweeper(service, owner="acl-sweeper", lease_ttl_s=5)
            sweeper.tick()
            assert sweeper.holds_lease
            assert admin.get(f"{PREFIX}[sweeper-lease]") == b"acl-sweeper"
            sweeper.tick()
            assert 0 < admin.pttl(f"{PREFIX}[sweeper-lease]") <= 5000
            # Its heartbeat (written at each tick, read by the dashboard) is allowed too.
            assert [b.owner for b in sweeper.status.heartbeats.read(clock())] == ["acl-sweeper"]
            sweeper.close()
            assert admin.exists(f"{PREFIX}[sweeper-lease]") == 0
            assert admin.hkeys(f"{PREFIX}[schedulers]") == []

            # What redis-py sends as its health check after 30 s of idleness.
            assert service.index.client.ping()
        finally:
            service.engine.dispose()
            service.index.client.close()

    # Nothing failed quietly: no refusal but the two expected ones, no warning logged...
    refusals = refused_commands(admin)
    assert set(refusals) <= {"command"}, f"refused keys or channels: {refusals}"
    assert refusals.get("command", set()) <= EXPECTED_REFUSALS
    warnings = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
    assert warnings == []
    # ...and every command granted was used by the service itself; the service's
    # connections ran nothing else but the login (HELLO or AUTH: no grant needed).
    assert granted_but_unused(used) == []
    assert used - set(SERVICE_COMMANDS) <= {"hello", "auth"}, used
    # The password went nowhere.
    assert secrets_in(all_log_text(logs)) == []
    assert secrets_in(repr(settings)) == []


def test_without_the_info_grant_a_lost_index_is_still_noticed_and_the_gap_warned_once(
    acl_redis: AclRedis, admin: redis.Redis, database_url: str, logs: pytest.LogCaptureFixture
) -> None:
    grants = ORDERS_ACL.replace(" +info", "").split()
    admin.execute_command("ACL", "SETUSER", "no-info", "reset", *grants, f">{PASSWORD}")
    settings = Settings(database_url=database_url, redis_url=acl_redis.url(user="no-info"))
    service = build_service(settings, clock=ManualClock())
    try:
        service.reconcile()
        assert service.index.epoch.check() is IndexEpoch.INTACT
        assert service.index.epoch.check() is IndexEpoch.INTACT
        admin.delete(f"{PREFIX}[index-epoch]")
        assert service.index.epoch.check() is IndexEpoch.LOST
    finally:
        service.engine.dispose()
        service.index.client.close()
        admin.execute_command("ACL", "DELUSER", "no-info")
    warnings = [r.getMessage() for r in logs.records if r.levelno >= logging.WARNING]
    assert warnings == [
        "redis refused INFO: a Redis restarted or failed over from an older snapshot is not "
        "noticed until the scheduled rebuild (grant +info)"
    ]


@pytest.mark.parametrize("form", ["userinfo", "query"])
def test_unix_socket_urls_carry_the_user_and_password_either_way(
    acl_redis: AclRedis, admin: redis.Redis, form: str, logs: pytest.LogCaptureFixture
) -> None:
    url = acl_redis.url() if form == "userinfo" else acl_redis.query_url()
    settings = Settings(redis_url=url)
    client = build_redis(settings)
    try:
        index = UnpaidIndex(client, key_prefix=PREFIX)
        now = ManualClock()()
        admitted = index.admit(
            AdmitRequest("u1", "o1", expires_at_ms=now + 60_000, now_ms=now, limit=3)
        )
        assert admitted.outcome is Admission.ADMITTED
        assert admin.zscore(f"{PREFIX}u1", "o1") == now + 60_000
    finally:
        client.close()
    for shown in (repr(settings), str(settings), str(settings.describe())):
        assert secrets_in(shown) == []
    assert secrets_in(all_log_text(logs)) == []


def test_the_restricted_user_can_touch_nothing_else(
    acl_redis: AclRedis, admin: redis.Redis
) -> None:
    client = build_redis(Settings(redis_url=acl_redis.url()))
    admin.set("other", "untouched")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.set("other", 1)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.get("other")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.zadd("Other-u1", {"o1": 1})
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.flushall()
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.keys("*")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("save")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.eval("return 1", 0)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.publish("channel", "message")
        # SCRIPT LOAD is granted, but a loaded script is held to the same key pattern:
        # neither through its declared keys...
        setter = client.script_load("return redis.call('SET', KEYS[1], '1')")
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.evalsha(setter, 1, "other")
        # ...nor through a key it names itself.
        sneaky = client.script_load("return redis.call('SET', 'other', '1')")
        with pytest.raises(redis.exceptions.ResponseError):
            client.evalsha(sneaky, 0)
        # And a command the service does not send stays refused even on its own keys.
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.lpush(f"{PREFIX}u1", "value")
    finally:
        client.close()
    assert admin.get("other") == b"untouched"
    assert admin.exists(f"{PREFIX}u1") == 0

    # The default user is off: a client without credentials gets nothing at all.
    anonymous = redis.Redis(unix_socket_path=acl_redis.socket, socket_timeout=1)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.ping()
    finally:
        anonymous.close()


@pytest.mark.parametrize("credentials", ["wrong-password", "unknown-user", "none"])
def test_bad_credentials_are_store_unavailable_and_the_password_shows_nowhere(
    acl_redis: AclRedis,
    admin: redis.Redis,
    database_url: str,
    engine: Engine,
    logs: pytest.LogCaptureFixture,
    credentials: str,
) -> None:
    url = {
        "wrong-password": acl_redis.url(password=PASSWORD + "x"),
        "unknown-user": acl_redis.url(user="intruder"),
        "none": f"unix://{acl_redis.socket}?db=0",
    }[credentials]
    settings = Settings(database_url=database_url, redis_url=url)
    service = build_service(settings, clock=ManualClock())
    try:
        with pytest.raises(StoreUnavailable) as info:
            service.create_unpaid_order("u1")
        assert info.value.store == "redis"
        assert secrets_in(str(info.value)) == []
        assert secrets_in("".join(traceback.format_exception(info.value))) == []
        # A payment never depends on Redis: it commits, the cleanup waits for reconcile.
        with build_redis(Settings(redis_url=acl_redis.url())) as good_client:
            order = OrderService(engine, good_client, settings).create_unpaid_order("u2")
        assert service.mark_paid(order.id).status is OrderStatus.PAID
    finally:
        service.engine.dispose()
        service.index.client.close()
    assert secrets_in(all_log_text(logs)) == []
    assert secrets_in(repr(settings)) == []
    assert admin.exists(f"{PREFIX}u1") == 0

    # The command says the same on one line of stderr.
    result = CliRunner().invoke(
        main, ["create", "u1"], env={"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": url}
    )
    assert result.exit_code == 8, result.output
    assert result.stderr.startswith("error: redis unavailable")
    assert result.stderr.count("\n") == 1
    assert secrets_in(result.output) == []


# --- TLS --------------------------------------------------------------------------------


def test_rediss_urls_build_a_tls_client_without_connecting(
    logs: pytest.LogCaptureFixture,
) -> None:
    for url, password in [
        ("rediss://u:pw@localhost:6390/0", "pw"),
        (f"rediss://orders:{quote(PASSWORD, safe='')}@localhost:6390/0", PASSWORD),
    ]:
        settings = Settings(redis_url=url)
        client = build_redis(settings)  # nothing listens on 6390: building must not connect
        try:
            pool = client.connection_pool
            assert issubclass(pool.connection_class, redis.connection.SSLConnection)
            kwargs = pool.connection_kwargs
            assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("localhost", 6390, 0)
            assert kwargs["password"] == password
            assert kwargs["socket_timeout"] == settings.redis_socket_timeout_s
            assert secrets_in(repr(client)) == []
        finally:
            client.close()
        assert secrets_in(repr(settings)) == []
    assert secrets_in(all_log_text(logs)) == []
