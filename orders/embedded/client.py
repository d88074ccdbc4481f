"""A redis-py client for the embedded server that starts the server again if it has died.

A long-lived process (the scheduler, a host app) connects to the embedded redis-server once
and then keeps its pooled connections. If that server dies (killed, OOM, a crash), the next
connection to ``<home>/redis.sock`` is refused (or finds no socket at all). Here that
refusal calls :func:`orders.embedded.server.ensure_redis` for the home, the same locked
check-and-start every ``orders`` command uses, so one home still gets one server, and the
retry's next attempt connects to it. The server reloads its append-only file; SQL remains
the record.

Bounded: a start waits at most the client's socket timeout for the home's lock and as long
again for the new server to answer, and a process tries at most once per
:data:`MIN_RESTART_INTERVAL_S`; calls in between fail fast with the usual connection error
(``StoreUnavailable`` at the service's edge). A home folder that no longer exists is taken
as deliberately removed: no server is started for it.

Only for the embedded default; a configured ``ORDERS_REDIS_URL`` never gets this.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import redis
from redis.backoff import AbstractBackoff, NoBackoff
from redis.connection import UnixDomainSocketConnection
from redis.exceptions import BusyLoadingError
from redis.retry import Retry

from orders.embedded.locks import POLL_S
from orders.embedded.server import ensure_redis
from orders.errors import StoreUnavailable

logger = logging.getLogger("orders.embedded_client")  # its name before the move to a subpackage

#: A process starts the server at most once in this many seconds.
MIN_RESTART_INTERVAL_S = 1.0

#: What a connect meets when no server runs for the home: a socket nobody listens on, or
#: no socket at all. A timeout is not among them: it means a server alive but slow.
NOTHING_LISTENS: tuple[type[OSError], ...] = (ConnectionRefusedError, FileNotFoundError)

T = TypeVar("T")


class ServerRestarter:
    """Starts the embedded server of one home again, for one process, at most once a second.

    Thread-safe: threads that find the server gone together wait for one attempt and share
    its outcome. Never raises; a failed start is logged with its reason.
    """

    def __init__(
        self,
        home: Path,
        *,
        timeout_s: float,
        min_interval_s: float = MIN_RESTART_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.home = Path(home)
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ended: float | None = None
        self._last_ok = False
        #: Attempts made (for tests and logs): starts tried, not calls refused by the limit.
        self.attempts = 0

    def restart(self) -> bool:
        """Make sure a server runs for the home; True if one should answer now.

        Within ``min_interval_s`` of the last attempt, returns that attempt's outcome
        without trying again.
        """
        # ensure_redis waits up to timeout_s for the lock, then as long for the server.
        if not self._lock.acquire(timeout=2 * self.timeout_s + 1.0):
            return False
        try:
            if (
                self._last_ended is not None
                and self._clock() - self._last_ended < self.min_interval_s
            ):
                return self._last_ok
            self.attempts += 1
            self._last_ok = self._attempt()
            self._last_ended = self._clock()
            return self._last_ok
        finally:
            self._lock.release()

    def _attempt(self) -> bool:
        if not self.home.is_dir():
            logger.warning(
                "the embedded server for %s is gone and so is the folder; not starting one",
                self.home,
            )
            return False
        try:
            server = ensure_redis(self.home, timeout_s=self.timeout_s)
        except StoreUnavailable as exc:
            logger.warning("the embedded server is gone and could not be started: %s", exc)
            return False
        logger.warning(
            "the embedded %s for %s was gone; %s pid %d serves it now",
            server.program,
            self.home,
            server.program,
            server.pid,
        )
        return True


def nothing_listens(error: BaseException) -> bool:
    """Whether ``error`` is, or was raised while handling, one of :data:`NOTHING_LISTENS`.

    Where a retry runs around the socket's connect alone, redis-py hands its failure handler
    the socket's own error; where it runs around the whole connect, its ConnectionError,
    raised while handling that error.
    """
    seen: set[int] = set()  # a chain can loop back on itself
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        if isinstance(link, NOTHING_LISTENS):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False


class RestartingRetry(Retry):
    """A redis-py ``Retry`` that starts the embedded server again before its next attempt.

    Every connect of a redis-py connection, the pool's and the reconnect inside a command's
    retry alike, runs under the connection's ``retry``, whose ``call_with_retry`` hands each
    failure to a handler. Here that handler first asks :attr:`restarter` to start the
    server when the failure was a refused connect or a missing socket; the retry's next
    attempt then connects to it. So a call that finds the server dead succeeds if the retry
    has an attempt left (``retries`` of 1 or more), and otherwise fails while the server
    comes back for the next one. Besides redis-py's own retried errors, this retries
    :data:`NOTHING_LISTENS` itself, which redis-py meets before it wraps them.

    ``restarter`` is set by the :class:`RestartingConnection` that owns the retry (redis-py
    copies a connection's retry for each connection); without one it is a plain ``Retry``.
    """

    def __init__(self, backoff: AbstractBackoff, retries: int) -> None:
        super().__init__(backoff, retries)
        self.update_supported_errors(NOTHING_LISTENS)
        self.restarter: ServerRestarter | None = None

    def call_with_retry(
        self, do: Callable[[], T], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> T:
        def restart_then_fail(error: Exception, *more: Any) -> Any:
            if self.restarter is not None and nothing_listens(error):
                self.restarter.restart()
            return fail(error, *more)

        return super().call_with_retry(do, restart_then_fail, *args, **kwargs)


class RestartingConnection(UnixDomainSocketConnection):
    """A unix socket connection that restarts the embedded server when nothing listens.

    redis-py's extension point (``connection_class`` of a pool); the pool passes
    ``restarter`` with the other connection arguments, and ``retry`` must be a
    :class:`RestartingRetry`, which does the restart. Only a refused connect or a missing
    socket restart the server: a timeout means a server that is alive but slow. A server
    still loading its data (just restarted, by this process or another) is waited for.
    """

    def __init__(self, *, restarter: ServerRestarter, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        if not isinstance(self.retry, RestartingRetry):
            raise TypeError(f"RestartingConnection needs a RestartingRetry, not {self.retry!r}")
        self.retry.restarter = restarter
        self.restarter = restarter

    def on_connect_check_health(self, check_health: bool = True) -> None:
        # The handshake's commands (CLIENT, SELECT) are served while loading; PING is not.
        super().on_connect_check_health(check_health=check_health)
        self._wait_until_loaded()

    def _wait_until_loaded(self) -> None:
        """PING until the server stops answering LOADING, for at most the restart timeout.

        Without it, a call landing while a restarted server replays its append-only file
        would fail (twice, with its one retry) though the server is about to serve it.
        """
        deadline = time.monotonic() + self.restarter.timeout_s
        while True:
            self.send_command("PING", check_health=False)  # type: ignore[no-untyped-call]
            try:
                self.read_response()
            except BusyLoadingError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(POLL_S)
            else:
                return


def embedded_client(
    home: Path,
    *,
    socket_timeout: float,
    retry: RestartingRetry | None = None,
    **options: Any,
) -> redis.Redis:
    """A client for the embedded server of ``home``, started now if none runs and again by
    any later call that finds it gone. ``retry`` is its connections' retry policy (by
    default one more attempt, at once); ``options`` go to redis-py (timeouts, ...). A start
    is waited for as long as ``socket_timeout`` allows (see the module docstring).
    """
    server = ensure_redis(home)
    restarter = ServerRestarter(server.home, timeout_s=socket_timeout)
    return redis.Redis.from_url(
        server.url,
        connection_class=RestartingConnection,
        restarter=restarter,
        retry=retry or RestartingRetry(NoBackoff(), 1),
        socket_timeout=socket_timeout,
        **options,
    )
