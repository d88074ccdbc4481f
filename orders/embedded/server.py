"""The embedded default stores: a local redis-server and a SQLite file under one home folder.

When the user sets no ``ORDERS_REDIS_URL``, the service runs its own persistent redis-server
for its home folder and talks to it over a unix socket only (never TCP)::

    <home>/redis.sock   the unix socket (mode 0700), the only thing the server listens on
    <home>/redis.pid    written by the daemonised server, removed on a clean shutdown
    <home>/redis.lock   flock()ed around check-and-start and stop, so one home has one server
    <home>/redis.log    the server's log
    <home>/redis/       its working dir: appendonly file (fsync every second) and RDB snapshots
    <home>/orders.db    the SQLite file (see :func:`sqlite_url`)

The server daemonises, so it outlives the process that started it; :func:`stop_redis` ends it.
A long-lived process's client (:mod:`orders.embedded.client`) starts it again if it dies.

Which server is "the one for this home" is decided by the socket: a server that answers PING
on ``<home>/redis.sock`` is it, and its pid is the one it reports (``INFO server``). The
pidfile is only a hint, used to wait for a server that is alive but not answering yet (starting
or loading its data) and to signal one that does not take ``SHUTDOWN``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from orders.config import Settings
from orders.embedded.binary import HOW_TO_FIX, server_argv, usable_redis_server
from orders.embedded.locks import (
    POLL_S,
    as_text,
    file_lock,
    file_size,
    pid_alive,
    read_from,
    read_pid,
    tail,
    wait_gone,
    works_in,
)
from orders.errors import StoreUnavailable

logger = logging.getLogger("orders.embedded")  # its name before the move to a subpackage

SOCKET_NAME = "redis.sock"
PIDFILE_NAME = "redis.pid"
LOCKFILE_NAME = "redis.lock"
LOGFILE_NAME = "redis.log"
DATA_DIR_NAME = "redis"
SQLITE_NAME = "orders.db"

#: Longest unix socket path the kernel takes (``sizeof(sun_path) - 1``).
MAX_SOCKET_PATH_BYTES = 103 if sys.platform == "darwin" or "bsd" in sys.platform else 107

_PING_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class EmbeddedRedis:
    """A running embedded server: its home, its unix socket, its pid and its program
    (``redis-server`` or ``valkey-server``, as the server's INFO names its executable)."""

    home: Path
    socket_path: Path
    pid: int
    program: str

    @property
    def url(self) -> str:
        """``unix:///abs/path/redis.sock``, for ``redis.Redis.from_url``."""
        return "unix://" + quote(str(self.socket_path))


@dataclass(frozen=True, slots=True)
class _HomePaths:
    home: Path
    socket: Path
    pidfile: Path
    lockfile: Path
    logfile: Path
    data_dir: Path

    @classmethod
    def of(cls, home: Path) -> _HomePaths:
        home = Path(home).expanduser().resolve()
        return cls(
            home=home,
            socket=home / SOCKET_NAME,
            pidfile=home / PIDFILE_NAME,
            lockfile=home / LOCKFILE_NAME,
            logfile=home / LOGFILE_NAME,
            data_dir=home / DATA_DIR_NAME,
        )

    def running(self, pid: int, program: str) -> EmbeddedRedis:
        return EmbeddedRedis(home=self.home, socket_path=self.socket, pid=pid, program=program)


def database_url(settings: Settings) -> str:
    """The configured URL (revealed: for the driver), or the embedded SQLite file."""
    if settings.database_url is not None:
        return settings.database_url.reveal()
    settings.home.mkdir(parents=True, exist_ok=True)
    return sqlite_url(settings.home)


def sqlite_url(home: Path) -> str:
    """``sqlite:///<abs home>/orders.db``: the embedded SQL database (creates nothing).

    The path is percent-quoted (SQLAlchemy unquotes it), so a home with spaces, ``?``, ``#``
    or ``%`` in its name still works; an ordinary path comes out unchanged.
    """
    return "sqlite:///" + quote(str(_HomePaths.of(home).home / SQLITE_NAME))


def redis_status(home: Path) -> EmbeddedRedis | None:
    """The redis-server running for ``home``, or None. Read-only: starts or cleans nothing."""
    paths = _HomePaths.of(home)
    answer = _ping(paths.socket)
    return None if answer is None else paths.running(*answer)


def check_can_start(home: Path) -> Path | None:
    """Raise unless a server answers for ``home`` or one can be started: the binary to start
    (None when one answers). Writes nothing, so a command can fail on it before it creates
    anything: :class:`~orders.errors.RedisServerMissing` when there is no binary,
    :class:`~orders.errors.RedisServerTooOld` when it is older than the oldest supported."""
    if _ping(_HomePaths.of(home).socket) is not None:
        return None
    return usable_redis_server()


def ensure_redis(home: Path, *, timeout_s: float = 10.0) -> EmbeddedRedis:
    """The redis-server for ``home``, started (daemonised, persistent) if none is running.

    Safe to call from several processes at once: they end up sharing one server. Waits up
    to ``timeout_s`` for the lock (another process starting or stopping the server), then up
    to ``timeout_s`` for the server to answer. Raises :class:`StoreUnavailable` saying what
    to do if it cannot; with no usable binary (:func:`check_can_start`), before it creates
    the home.
    """
    paths = _HomePaths.of(home)
    _check_socket_path(paths)
    binary = check_can_start(paths.home)
    _make_home(paths)
    with _home_lock(paths, timeout_s):
        deadline = time.monotonic() + timeout_s
        found = _existing_server(paths, deadline, timeout_s)
        if found is not None:
            return found
        return _start_server(paths, binary or usable_redis_server(), deadline, timeout_s)


def stop_redis(home: Path, *, timeout_s: float = 10.0) -> bool:
    """Stop the redis-server for ``home`` (saving its data). True if one was running.

    Sends ``SHUTDOWN SAVE``; if that fails, SIGTERM to its pid. Waits up to ``timeout_s``
    for the process to be gone and raises :class:`StoreUnavailable` if it is not (it is
    never killed with SIGKILL, which could lose the last second of writes).
    """
    paths = _HomePaths.of(home)
    if not paths.home.is_dir():
        return False
    with _home_lock(paths, timeout_s):
        deadline = time.monotonic() + timeout_s
        answer = _ping(paths.socket)
        pid, program = answer or (_our_live_pid(paths), "server")
        if pid is None:
            _remove_leftovers(paths)
            return False
        if not _shutdown(paths.socket, timeout_s):
            logger.warning("SHUTDOWN failed; sending SIGTERM to %s pid %d", program, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not wait_gone(pid, deadline):
            raise StoreUnavailable(
                "redis",
                f"{program} pid {pid} for {paths.home} did not stop within {timeout_s:g} s; "
                f"see {paths.logfile}; as a last resort `kill -9 {pid}` "
                "(it may lose up to a second of writes)",
            )
        _remove_leftovers(paths)
        logger.info("stopped %s pid %d for %s", program, pid, paths.home)
        return True


# --- the parts ------------------------------------------------------------------------------


def _check_socket_path(paths: _HomePaths) -> None:
    size = len(os.fsencode(paths.socket))
    if size > MAX_SOCKET_PATH_BYTES:
        raise StoreUnavailable(
            "redis",
            f"the embedded Redis socket path {paths.socket} is {size} bytes, longer than the "
            f"{MAX_SOCKET_PATH_BYTES} bytes a unix socket path may have: set ORDERS_HOME to "
            "a shorter directory, or set ORDERS_REDIS_URL to use a Redis server you run yourself",
        )


def _make_home(paths: _HomePaths) -> None:
    try:
        paths.home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreUnavailable(
            "redis", f"cannot create the home folder {paths.home}: {exc.strerror or exc}"
        ) from exc


@contextlib.contextmanager
def _home_lock(paths: _HomePaths, timeout_s: float) -> Iterator[None]:
    """An exclusive flock on ``<home>/redis.lock``, waited for at most ``timeout_s``."""
    with file_lock(paths.lockfile, store="redis", timeout_s=timeout_s):
        yield


def _client(socket_path: Path, timeout_s: float) -> redis.Redis:
    return redis.Redis(
        unix_socket_path=str(socket_path),
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )


def _ping(socket_path: Path) -> tuple[int, str] | None:
    """The pid and program name of the server answering PING on ``socket_path``, or None if
    none answers."""
    if not socket_path.exists():
        return None
    try:
        with _client(socket_path, _PING_TIMEOUT_S) as client:
            if client.ping() is not True:
                return None
            info = client.info("server")
            return int(info["process_id"]), Path(info.get("executable", "redis-server")).name
    except (RedisError, OSError, KeyError, TypeError, ValueError):
        return None


def _shutdown(socket_path: Path, timeout_s: float) -> bool:
    """Send ``SHUTDOWN SAVE``; True if the server took it (it closed the connection)."""
    try:
        with _client(socket_path, max(timeout_s, _PING_TIMEOUT_S)) as client:
            client.shutdown(save=True)
    except (RedisError, OSError) as exc:
        logger.warning("SHUTDOWN of the server on %s failed: %s", socket_path, exc)
        return False
    return True


def _our_live_pid(paths: _HomePaths) -> int | None:
    """The pidfile's pid if that process is alive and is a server for this home."""
    pid = read_pid(paths.pidfile)
    if pid is None or not pid_alive(pid) or not works_in(pid, paths.data_dir):
        return None
    return pid


def _existing_server(paths: _HomePaths, deadline: float, timeout_s: float) -> EmbeddedRedis | None:
    """The server already running for this home, waiting for it if it is still starting."""
    answer = _ping(paths.socket)
    if answer is not None:
        _note_pid(paths, answer[0])
        return paths.running(*answer)
    starting = _our_live_pid(paths)
    if starting is None:
        return None
    logger.info("server pid %d for %s is not answering yet; waiting", starting, paths.home)
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        answer = _ping(paths.socket)
        if answer is not None:
            _note_pid(paths, answer[0])
            return paths.running(*answer)
        if not pid_alive(starting):
            return None
    raise StoreUnavailable(
        "redis",
        f"server pid {starting} for {paths.home} is running but did not answer on "
        f"{paths.socket} within {timeout_s:g} s (still loading its data?); see "
        f"{paths.logfile}; try again, or stop it with `kill {starting}`",
    )


def _note_pid(paths: _HomePaths, pid: int) -> None:
    """Make the pidfile name the server that answers, if it names another (or none)."""
    if read_pid(paths.pidfile) == pid:
        return
    logger.warning("pidfile %s did not name server pid %d; rewriting it", paths.pidfile, pid)
    with contextlib.suppress(OSError):
        paths.pidfile.write_text(f"{pid}\n", encoding="ascii")


def _remove_leftovers(paths: _HomePaths) -> None:
    """Remove a pidfile and a socket no live server owns (call with the lock held)."""
    for leftover in (paths.pidfile, paths.socket):
        try:
            leftover.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreUnavailable(
                "redis", f"cannot remove the stale {leftover}: {exc.strerror or exc}"
            ) from exc
        else:
            logger.info("removed stale %s", leftover)


def _start_server(
    paths: _HomePaths, binary: Path, deadline: float, timeout_s: float
) -> EmbeddedRedis:
    """Start a daemonised ``binary`` for this home and wait for it to answer PING."""
    _remove_leftovers(paths)
    try:
        paths.data_dir.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise StoreUnavailable(
            "redis", f"cannot create {paths.data_dir}: {exc.strerror or exc}"
        ) from exc
    log_offset = file_size(paths.logfile)
    argv = server_argv(
        binary,
        socket=paths.socket,
        pidfile=paths.pidfile,
        data_dir=paths.data_dir,
        logfile=paths.logfile,
    )
    logger.info("starting %s for %s", binary, paths.home)
    try:
        # With --daemonize yes the process forks and its parent exits at once.
        launched = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=max(deadline - time.monotonic(), POLL_S),
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        output = as_text(exc.stdout) + as_text(exc.stderr)
        reason = f"it did not daemonise within {timeout_s:g} s"
        _start_failed(paths, binary, log_offset, reason, output)
    except OSError as exc:
        _start_failed(paths, binary, log_offset, f"it cannot run: {exc.strerror or exc}", "")
    output = as_text(launched.stdout) + as_text(launched.stderr)
    if launched.returncode != 0:
        _start_failed(
            paths, binary, log_offset, f"it exited with status {launched.returncode}", output
        )
    while True:
        answer = _ping(paths.socket)
        if answer is not None:
            logger.info("%s pid %d for %s is up", answer[1], answer[0], paths.home)
            _note_pid(paths, answer[0])
            return paths.running(*answer)
        written = read_pid(paths.pidfile)
        if written is not None and not pid_alive(written):
            _start_failed(paths, binary, log_offset, "it exited while starting up", output)
        if time.monotonic() >= deadline:
            _start_failed(
                paths,
                binary,
                log_offset,
                f"it did not answer on {paths.socket} within {timeout_s:g} s",
                output,
            )
        time.sleep(POLL_S)


def _start_failed(
    paths: _HomePaths, binary: Path, log_offset: int, reason: str, output: str
) -> NoReturn:
    parts = [f"could not start the embedded server {binary} for {paths.home}: {reason}"]
    if output.strip():
        parts.append(f"its output:\n{tail(output)}")
    log_tail = tail(read_from(paths.logfile, log_offset))
    if log_tail:
        parts.append(f"the end of {paths.logfile}:\n{log_tail}")
    parts.append(f"to fix it: {HOW_TO_FIX}")
    raise StoreUnavailable("redis", "\n".join(parts))
