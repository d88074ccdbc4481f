"""Which failures make the embedded client start its server again: a refused connect or a
missing socket, as redis-py hands them to its retry (bare, or inside its own
ConnectionError); never a timeout (a server alive but slow) nor a dropped connection (the
reconnect that follows finds out whether anything listens)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff

from orders.embedded.client import RestartingRetry, ServerRestarter


def raised_while_handling(error: OSError) -> redis.ConnectionError:
    """redis-py's ConnectionError as its connect raises it, inside ``except OSError``."""
    wrapped = redis.ConnectionError("Error 111 connecting to /h/redis.sock. Connection refused.")
    wrapped.__context__ = error  # what that `raise` sets
    return wrapped


FAILURES: dict[str, tuple[Callable[[], Exception], int]] = {
    "refused": (lambda: ConnectionRefusedError(111, "Connection refused"), 1),
    "no socket": (lambda: FileNotFoundError(2, "No such file or directory"), 1),
    "refused, wrapped": (lambda: raised_while_handling(ConnectionRefusedError(111, "x")), 1),
    "connect timeout": (lambda: TimeoutError("timed out"), 0),  # socket.timeout
    "redis timeout": (lambda: redis.TimeoutError("Timeout reading from socket"), 0),
    "dropped": (lambda: redis.ConnectionError("Connection closed by server."), 0),
}


@pytest.mark.parametrize("failure", FAILURES)
def test_only_a_refused_connect_or_a_missing_socket_restarts(tmp_path: Path, failure: str) -> None:
    make_error, restarts = FAILURES[failure]
    # A home that is gone: an attempt is counted, and no server is started for it.
    restarter = ServerRestarter(tmp_path / "removed", timeout_s=0.1, min_interval_s=0)
    retry = RestartingRetry(NoBackoff(), 1)
    retry.restarter = restarter
    tries: list[Exception] = []

    def connect() -> str:
        if not tries:
            tries.append(make_error())
            raise tries[0]
        return "connected"

    handled: list[Exception] = []
    assert retry.call_with_retry(connect, handled.append) == "connected"
    assert handled == tries  # redis-py's own failure handler still ran, on the same error
    assert restarter.attempts == restarts
