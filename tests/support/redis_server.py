"""A throwaway redis-server on a unix socket, for the session or for one test."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from orders.embedded.binary import find_redis_server
from tests.support.processes import stop_process


def wait_for_ping(client: redis.Redis, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        try:
            if client.ping():
                return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.01)


def debug_command_args(binary: Path | None) -> tuple[str, ...]:
    """The options that let a local client send DEBUG: 7.x refuses it unless told, and 6.2
    knows no such option."""
    found = re.search(
        r"v=(\d+)\.",
        subprocess.run(
            [str(binary or find_redis_server()), "--version"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout,
    )
    if found is None or int(found[1]) < 7:
        return ()
    return ("--enable-debug-command", "local")


class RedisServer:
    """A throwaway redis-server on a unix socket; the test that starts one stops it."""

    def __init__(
        self, folder: Path, *extra: str, binary: Path | None = None, tcp_port: int = 0
    ) -> None:
        self.folder = folder
        #: None: the binary the embedded default would run (``find_redis_server``).
        self.binary = binary
        self.socket = folder / "redis.sock"
        self.url = f"unix://{self.socket}"
        self.extra = extra
        #: 0: the unix socket only; else also this port, on 127.0.0.1 only.
        self.tcp_port = tcp_port
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        args = [
            str(self.binary or find_redis_server()),
            "--port", str(self.tcp_port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--dir", str(self.folder),
            "--save", "",
            "--appendonly", "no",
            "--logfile", str(self.folder / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with redis.Redis(unix_socket_path=str(self.socket), socket_timeout=1) as client:
            wait_for_ping(client, self.proc, 10)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None


@contextmanager
def own_server(binary: Path | None, *extra: str) -> Iterator[RedisServer]:
    """A redis-server of one test's own, which the test may stop, freeze or reconfigure;
    thawed, stopped and removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="orx", dir="/tmp"))
    server = RedisServer(folder, *extra, binary=binary).start()
    try:
        yield server
    finally:
        if server.proc is not None:
            server.proc.send_signal(signal.SIGCONT)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
