"""`orders scheduler --ops-port` as the real process a probe, Prometheus and an operator talk
to, on one port: healthy and ready, its metrics, its dashboard (showing it active, behind the
token, with a Secure login cookie); then its Redis stops: not ready (naming Redis), still
healthy (restarting it would not help); at SIGTERM it stops and frees the port."""

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

TOKEN = "a-scheduler-dashboard-token"


def request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    status, body = request(url, headers=headers)
    return status, json.loads(body)


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


def answered_after_a_sweep(
    url: str, status: int, headers: dict[str, str] | None = None
) -> Callable[[], tuple[int, dict[str, Any]] | None]:
    """A probe of ``url``: its answer once it is ``status`` and names a sweep, else None."""

    def probe() -> tuple[int, dict[str, Any]] | None:
        try:
            found = get(url, headers)
        except OSError:
            return None  # not listening yet
        return found if found[0] == status and found[1].get("last_successful_sweep") else None

    return probe


def login_cookie(port: int) -> str:
    """The Set-Cookie of a login with the token on the pages at ``port``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    conn.request("POST", "/login", body=f"token={TOKEN}", headers=form)
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply.getheader("Set-Cookie") or ""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_one_port_serves_probes_metrics_and_dashboard_of_a_real_scheduler_as_its_redis_goes(
    database_url: str, redis_binary: Path | None
) -> None:
    folder = Path(tempfile.mkdtemp(prefix="ohr", dir="/tmp"))
    server = RedisServer(folder, binary=redis_binary).start()
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", "-v", "scheduler", "--interval", "0.2"],
        env=child_env(
            ORDERS_HOME=str(folder / "home"),
            ORDERS_DATABASE_URL=database_url,
            ORDERS_REDIS_URL=server.url,
            ORDERS_OPS_PORT=str(port),
            ORDERS_DASHBOARD_TOKEN=TOKEN,
            ORDERS_DASHBOARD_SECURE_COOKIE="1",  # browsers reach it over HTTPS
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    bearer = {"Authorization": f"Bearer {TOKEN}"}

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
        assert request(base + "/readyz", "HEAD") == (200, b"")
        status, metrics = request(base + "/metrics")  # no token: no order data there
        assert status == 200
        assert b"\norders_scheduler_active 1.0\n" in metrics

        # The dashboard behind the token shows this scheduler active, by its beat.
        def beat() -> tuple[int, dict[str, Any]] | None:
            scheduling = get(base + "/api/overview", bearer)[1]["scheduling"]
            beats = scheduling["schedulers"]
            return (200, scheduling) if beats and beats[0]["last_sweep_ms"] else None

        _, scheduling = wait_for("the dashboard to show a beat", beat, proc)
        assert scheduling["lease_owner"] == healthy["owner"]
        assert [(b["owner"], b["active"]) for b in scheduling["schedulers"]] == [
            (healthy["owner"], True)
        ]
        assert get(base + "/api/overview")[0] == 401
        status, page = request(base + "/", headers=bearer)
        assert (status, b'src="static/dashboard.js"' in page) == (200, True)
        assert login_cookie(port).endswith("; HttpOnly; SameSite=Strict; Secure")

        server.stop()  # the test's own Redis, by its PID
        _, not_ready = wait_for("/readyz 503", answered("/readyz", 503), proc)
        assert not_ready["status"] == "failing"
        assert not_ready["checks"]["sql"] == "ok"
        assert not_ready["checks"]["redis"] != "ok"
        assert server.url not in json.dumps(not_ready)
        status, still = get(base + "/healthz")
        assert (status, still["status"], still["checks"]["scheduler"]) == (200, "ok", "running")

        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 0, stderr
        assert f"metrics, health and dashboard on {base}/" in stderr
        assert TOKEN not in stderr
    finally:
        if proc.poll() is None:
            stop_process(proc, signum=signal.SIGKILL)
            proc.communicate()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def test_a_bad_taken_or_open_ops_port_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with_token = {"ORDERS_DASHBOARD_TOKEN": TOKEN}
        for args, env, problem in [
            (["--ops-port", "70000"], {}, "invalid ops_port: must be between 0 and 65535"),
            ([f"--ops-port={port}"], {}, f"invalid ops_port: cannot listen on 127.0.0.1:{port}"),
            # An address of no interface here (TEST-NET-1).
            (["--ops-port=0", "--ops-addr=192.0.2.1"], with_token, "invalid ops_port: cannot"),
            # Off loopback the dashboard on the port needs its token.
            (["--ops-port=0", "--ops-addr=0.0.0.0"], {}, "invalid host: 0.0.0.0 is not loop"),
        ]:
            done = run_orders("scheduler", *args, env=child_env(ORDERS_HOME=str(home), **env))
            assert done.returncode == 2, done.stderr
            (line,) = done.stderr.splitlines()
            assert line.startswith(f"error: {problem}"), line
            assert not home.exists()  # no store was opened, no embedded Redis started
