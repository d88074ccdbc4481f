"""A throwaway redis-server on a unix socket, for the session or for one test."""

from __future__ import annotations

import subprocess
import time
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
