"""``orders dashboard`` as a real process: refused settings end in one line and exit 2 before
anything listens; a good one serves until SIGTERM and never prints its token."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from click.testing import CliRunner

from orders.cli import main
from tests.support.processes import REPO, child_env, free_port, stop_process

TOKEN = "a-dashboard-token-for-tests"


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


#: Stores that cannot be reached (port 1): a command that connected to them would exit 8.
UNREACHABLE = {
    "ORDERS_DATABASE_URL": "postgresql://orders:db-password@127.0.0.1:1/orders",
    "ORDERS_REDIS_URL": "redis://127.0.0.1:1/0",
}


@pytest.mark.parametrize(
    ("args", "token", "words"),
    [
        (["--host", "0.0.0.0"], None, "set ORDERS_DASHBOARD_TOKEN"),
        (["--host", "192.0.2.1"], None, "not loopback"),
        ([], "short", "at least 16 characters"),
        (["--port", "70000"], None, "invalid port"),
        (["--refresh", "0"], None, "invalid refresh_s"),
    ],
)
def test_a_refused_setting_is_one_line_and_exit_2_before_the_stores_are_reached(
    args: list[str], token: str | None, words: str
) -> None:
    env = dict(UNREACHABLE)
    if token is not None:
        env["ORDERS_DASHBOARD_TOKEN"] = token
    done = CliRunner().invoke(main, ["dashboard", *args], env=env, catch_exceptions=False)
    assert done.exit_code == 2, done.output
    assert done.stderr.count("\n") == 1, done.stderr
    assert words in done.stderr
    assert "db-password" not in done.stderr
    if token is not None:
        assert token not in done.output


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_taken_port_is_one_error_line_and_exit_2(database_url: str, redis_url: str) -> None:
    env = {"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": redis_url}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["dashboard", "--port", str(port)]
        done = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
    assert done.exit_code == 2, done.output
    # Found once the stores are up (their start-up warnings may come first): one error line.
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith(f"error: invalid port: cannot listen on 127.0.0.1:{port}: ")


def fetch(url: str, token: str | None) -> tuple[int, Any]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@contextmanager
def orders_process(
    database_url: str, redis_url: str, *args: str
) -> Iterator[subprocess.Popen[str]]:
    """``orders -v ARGS`` as a child with the token set, stopped by its PID at the end."""
    env = child_env(
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_url,
        ORDERS_DASHBOARD_TOKEN=TOKEN,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "orders", "-v", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc
    finally:
        stop_process(proc, signum=signal.SIGKILL)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_it_serves_until_sigterm_and_never_prints_its_token(
    database_url: str, redis_url: str
) -> None:
    port = free_port()
    with orders_process(database_url, redis_url, "dashboard", "--port", str(port)) as proc:
        deadline = time.monotonic() + 20
        while not listening(port):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the dashboard did not start listening"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/api/overview"
        status, body = fetch(url, TOKEN)
        assert status == 200
        assert body["sql"]["stats"]["by_status"]["unpaid"] == 0
        assert fetch(url, None)[0] == 401
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 0, stderr
    assert f"dashboard on http://127.0.0.1:{port}/" in stderr
    assert TOKEN not in stdout + stderr
