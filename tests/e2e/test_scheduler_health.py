"""`orders scheduler --health-port` as the real process a probe talks to: healthy and ready,
then its Redis stops: not ready (naming Redis), still healthy (restarting it would not help)."""

from __future__ import annotations

import http.client
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes import REPO, child_env, free_port, run_orders, stop_process
from tests.support.redis_server import RedisServer


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def wait_for(
    what: str, probe: Callable[[], tuple[int, dict[str, Any]] | None], proc: subprocess.Popen[str]
) -> tuple[int, dict[str, Any]]:
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"the scheduler exited with {proc.returncode}"
        found = probe()
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def stopped(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, then its stderr once it exited 0."""
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 0, stderr
    return stderr


def kill_if_running(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        stop_process(proc, signum=signal.SIGKILL)
        proc.communicate()


def answered_after_a_sweep(
    url: str, status: int
) -> Callable[[], tuple[int, dict[str, Any]] | None]:
    """A probe of ``url``: its answer once it is ``status`` and names a sweep, else None."""

    def probe() -> tuple[int, dict[str, Any]] | None:
        try:
            found = get(url)
        except OSError:
            return None  # not listening yet
        return found if found[0] == status and found[1].get("last_successful_sweep") else None

    return probe


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_health_and_readiness_of_a_real_scheduler_and_its_redis_going_down(
    database_url: str, redis_binary: Path | None
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ohr", dir="/tmp"))
    server = RedisServer(folder, binary=redis_binary).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", "scheduler", "--interval", "0.2"],
        env=child_env(
            ORDERS_HOME=str(folder / "home"),
            ORDERS_DATABASE_URL=database_url,
            ORDERS_REDIS_URL=server.url,
            ORDERS_HEALTH_PORT=str(port),
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"

    def answered(path: str, status: int) -> Callable[[], tuple[int, dict[str, Any]] | None]:
        return answered_after_a_sweep(base + path, status)

    try:
        _, healthy = wait_for("/healthz 200 after a sweep", answered("/healthz", 200), proc)
        assert healthy["status"] == "ok"
        assert healthy["role"] == "active"
        assert healthy["owner"].split(":")[1] == str(proc.pid)  # host:pid:random
        assert healthy["last_successful_sweep_ms"] > 0
        assert healthy["lease_expires_ms"] > healthy["last_successful_sweep_ms"]
        status, ready = get(base + "/readyz")
        assert (status, ready["checks"]) == (200, {"sql": "ok", "redis": "ok"})

        server.stop()  # the test's own Redis, by its PID
        _, not_ready = wait_for("/readyz 503", answered("/readyz", 503), proc)
        assert not_ready["status"] == "failing"
        assert not_ready["checks"]["sql"] == "ok"
        assert not_ready["checks"]["redis"] != "ok"
        assert server.url not in json.dumps(not_ready)
        status, still = get(base + "/healthz")
        assert (status, still["status"], still["checks"]["scheduler"]) == (200, "ok", "running")

        assert f"health on {base}/healthz" in stopped(proc)
    finally:
        kill_if_running(proc)
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_bad_or_taken_health_port_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, problem in [
            (["--health-port", "70000"], "must be a TCP port"),
            (["--health-port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
        ]:
            done = run_orders("scheduler", *args, env=child_env(ORDERS_HOME=str(home)))
            assert done.returncode == 2, done.stderr
            (line,) = done.stderr.splitlines()
            assert line.startswith(f"error: invalid health_port: {problem}")
            assert not home.exists()  # no store was opened, no embedded Redis started


def secure_login_cookie(port: int, token: str | None) -> str:
    """The Set-Cookie of a login on the dashboard at ``port`` ("" when none is set)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    conn.request("POST", "/login", body=f"token={token or ''}", headers=form)
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply.getheader("Set-Cookie") or ""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_one_port_serves_metrics_health_and_the_dashboard(
    database_url: str, redis_url: str, redis_client: Any, tmp_path: Path
) -> None:
    port = free_port()
    env = child_env(
        ORDERS_HOME=str(tmp_path / "home"),
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_url,
        ORDERS_OPS_PORT=str(port),
    )
    token = "t" * 32
    proc = subprocess.Popen(  # the dashboard's login cookie marked Secure (behind TLS)
        [sys.executable, "-m", "orders", "scheduler", "--interval", "0.2"],
        env={**env, "ORDERS_DASHBOARD_TOKEN": token, "ORDERS_DASHBOARD_SECURE_COOKIE": "1"},
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(
            "/healthz 200 after a sweep",
            answered_after_a_sweep(f"http://127.0.0.1:{port}/healthz", 200),
            proc,
        )
        assert secure_login_cookie(port, token).endswith("; HttpOnly; SameSite=Strict; Secure")
        stopped(proc)
    finally:
        kill_if_running(proc)

    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", "scheduler", "--interval", "0.2"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        swept = answered_after_a_sweep(base + "/healthz", 200)
        _, healthy = wait_for("/healthz 200 after a sweep", swept, proc)
        assert healthy["role"] == "active"
        status, ready = get(base + "/readyz")
        assert (status, ready["checks"]) == (200, {"sql": "ok", "redis": "ok"})
        with urllib.request.urlopen(base + "/metrics", timeout=10) as answer:
            metrics = answer.read().decode()
        assert "\norders_scheduler_active 1.0\n" in metrics
        status, overview = get(base + "/api/overview")  # loopback: no token needed
        assert status == 200
        assert overview["sql"]["stats"]["by_status"]["unpaid"] == 0
        with urllib.request.urlopen(base + "/", timeout=10) as answer:
            assert b'src="static/dashboard.js"' in answer.read()

        assert f"metrics, health and dashboard on {base}/" in stopped(proc)
    finally:
        kill_if_running(proc)
    # Off loopback the one port needs the dashboard's token, as the dashboard's own does.
    refused = run_orders("scheduler", "--ops-port", "0", "--ops-addr", "0.0.0.0", env=env)
    assert refused.returncode == 2, refused.stderr
    assert "ORDERS_DASHBOARD_TOKEN" in refused.stderr
