"""`orders demo` and `orders scheduler` as the real processes a user starts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import redis
from sqlalchemy import Engine, func, select

from orders.config import Settings
from orders.embedded.server import redis_status
from orders.index.lease import SweeperLease
from orders.service import OrderService
from orders.sql.models import events_table
from tests.support.processes import (
    REPO,
    child_env,
    free_port,
    kill_embedded_redis,
    run_orders,
    stop_process,
)


def test_demo_runs_to_its_checked_summary_and_stops_what_it_started(tmp_path: Path) -> None:
    home = Path(os.path.join("/tmp", f"od{os.getpid()}"))
    try:
        done = run_orders("demo", "--fast", env=child_env(ORDERS_HOME=str(home)))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "refused at the limit" in done.stdout
        assert "late payments refunded" in done.stdout
        assert "passed" in done.stdout
        assert redis_status(home) is None  # the demo stopped the server it started
    finally:
        kill_embedded_redis(home)
        shutil.rmtree(home, ignore_errors=True)


def test_scheduler_command_closes_orders_at_their_expiry_and_stops_on_sigterm(
    engine: Engine, redis_client: redis.Redis, database_url: str, redis_url: str
) -> None:
    # The scheduler runs on the real clock, so this service does too.
    service = OrderService(engine, redis_client, Settings(database_url=database_url))
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orders",
            "scheduler",
            "--interval",
            "0.5",
            "--ops-port",
            str(port),
        ],
        env=child_env(ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=redis_url),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        orders = [service.create_unpaid_order(f"u{i}", ttl_s=0.3 + i / 10) for i in range(5)]
        deadline = time.monotonic() + 20
        while any(service.get_order(o.id).status == "unpaid" for o in orders):
            assert time.monotonic() < deadline, "the scheduler did not close the orders"
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.05)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
            metrics = page.read().decode()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            stop_process(proc, signum=signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, stderr
    closed = [service.get_order(o.id) for o in orders]
    assert {o.status for o in closed} == {"closed"}
    lags = [o.closed_at_ms - o.expires_at_ms for o in closed if o.closed_at_ms is not None]
    assert len(lags) == 5
    assert min(lags) >= 0
    with engine.connect() as conn:
        per_order = conn.execute(
            select(events_table.c.order_id, func.count())
            .where(events_table.c.kind == "closed")
            .group_by(events_table.c.order_id)
        ).all()
    assert sorted(count for _, count in per_order) == [1] * 5
    # The summary lines (at most one per 10 s, the last at exit) account for every close;
    # the per-sweep lines are DEBUG, not shown by default.
    summaries = [
        json.loads(line[line.index("{") :])
        for line in stderr.splitlines()
        if '"event": "summary"' in line
    ]
    assert sum(line["closed"] for line in summaries) == 5, stderr
    assert '"event": "sweep"' not in stderr
    closes = re.search(r"^orders_closes_total (\S+)$", metrics, re.MULTILINE)
    assert closes is not None
    assert float(closes.group(1)) == 5
    lease = SweeperLease(service.index.client, key_prefix=service.index.key_prefix)
    assert lease.owner() is None  # released on the way out
    assert all(service.index.members(f"u{i}") == {} for i in range(5))
