"""examples/fastapi_checkout as a user runs it: uvicorn with several workers on PostgreSQL
and Redis, driven over HTTP by many concurrent clients, its metrics in multiprocess mode."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine, select

from orders.config import Settings
from orders.service import OrderService
from orders.sql.models import orders_table
from tests.support.aio import loop_kind
from tests.support.clocks import ManualClock
from tests.support.processes import REPO, child_env, free_port

EXAMPLE = REPO / "examples" / "fastapi_checkout"
WORKERS = 3
USERS = 20
REQUESTS = 200
LIMIT = 2
TTL_S = 1800


def group_alive(pgid: int) -> list[int]:
    """Live processes (not zombies) of process group ``pgid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            if int(fields[2]) == pgid and fields[0] not in {"Z", "X"}:
                found.append(int(entry.name))
    return found


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to uvicorn and its workers (its own process group), SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    deadline = time.monotonic() + 10
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # a worker that outlived its parent


def wait_until_ready(proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
    """Until every worker finished its lifespan startup and the app answers."""
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, f"uvicorn exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"uvicorn did not start:\n{log.read_text()}"
        if log.read_text().count("Application startup complete.") == WORKERS:
            with contextlib.suppress(httpx.TransportError):
                answer = httpx.get(f"{base}/users/nobody/orders", timeout=2, trust_env=False)
                if answer.status_code == 200:
                    return
        time.sleep(0.05)


@contextlib.contextmanager
def uvicorn_running(env: dict[str, str], log: Path) -> Iterator[str]:
    """The example under ``uvicorn --workers`` on the tests' event loop (uvicorn's
    ``--loop``: left to "auto", it would take uvloop whenever installed); yields its base
    URL; stops every process."""
    port = free_port()
    args = ["app:app", "--host", "127.0.0.1", "--port", str(port), "--workers", str(WORKERS)]
    args += ["--loop", loop_kind()]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", *args, "--no-access-log"],
            cwd=EXAMPLE,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the workers are stopped with it
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(proc, base, log)
        yield base
    finally:
        stop_group(proc)
    assert not group_alive(proc.pid), f"left running: {group_alive(proc.pid)}"
    text = log.read_text()
    assert proc.returncode == 0, text
    # Each worker's lifespan closed its service (an error there is "shutdown failed").
    assert text.count("Application shutdown complete.") == WORKERS, text
    assert "Traceback" not in text, text


async def create_concurrently(base: str) -> list[tuple[str, httpx.Response]]:
    """REQUESTS creates at once, spread over USERS users, each user its own client."""
    users = [f"user-{i}" for i in range(USERS)]
    clients = [httpx.AsyncClient(base_url=base, timeout=30, trust_env=False) for _ in users]

    async def create(i: int) -> tuple[str, httpx.Response]:
        user, client = users[i % USERS], clients[i % USERS]
        body = {"amount": "12.50", "currency": "EUR"} if i % 2 else None
        return user, await client.post(f"/users/{user}/orders", json=body)

    try:
        return await asyncio.gather(*(create(i) for i in range(REQUESTS)))
    finally:
        for client in clients:
            await client.aclose()


def scrape_creates(base: str) -> dict[str, float]:
    """``orders_creates_total`` by result, from the app's /metrics on a new connection (so
    any worker may answer)."""
    answer = httpx.get(f"{base}/metrics", timeout=10, trust_env=False)
    assert answer.status_code == 200, answer.text
    return {
        sample.labels["result"]: sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name == "orders_creates_total"
    }


def creates_by_worker(folder: Path) -> dict[int, float]:
    """Each worker's own count of creates, read from its file in the multiprocess folder."""
    counts = {}
    for path in folder.glob("counter_*.db"):
        pid = int(path.stem.removeprefix("counter_"))
        counts[pid] = sum(
            sample.value
            for family in MultiProcessCollector.merge([str(path)])
            for sample in family.samples
            if sample.name == "orders_creates_total"
        )
    return counts


def assert_metrics_sum_the_workers(base: str, folder: Path, admitted: int, refused: int) -> None:
    """Whichever worker answers /metrics, it counts every worker's creates."""
    served = {pid: n for pid, n in creates_by_worker(folder).items() if n}
    assert len(served) >= 2, f"one worker served every create: {served}"
    assert sum(served.values()) == admitted + refused
    for _ in range(2 * WORKERS):
        creates = scrape_creates(base)
        assert "admitted" in creates, creates
        assert creates["admitted"] == admitted
        assert creates.get("refused_redis", 0) + creates.get("refused_sql", 0) == refused


@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_fastapi_example_under_uvicorn_workers_keeps_the_limit_and_refunds_late_payments(
    engine: Engine,
    redis_client: redis.Redis,
    database_url: str,
    redis_options: dict[str, Any],
    clock: ManualClock,
    tmp_path: Path,
) -> None:
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()  # empty at start: files left by an earlier run would count too
    env = child_env(
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
        ORDERS_DATABASE_URL=database_url,
        ORDERS_REDIS_URL=redis_options["redis_url"],
        ORDERS_UNPAID_LIMIT=str(LIMIT),
        ORDERS_TTL_S=str(TTL_S),
        # Three workers and the clients share two cores: a slow answer is not the subject.
        ORDERS_REDIS_SOCKET_TIMEOUT_S="5",
    )
    settings = Settings(database_url=database_url, unpaid_limit=LIMIT, **redis_options)
    checker = OrderService(engine, redis_client, settings, clock=clock)
    with uvicorn_running(env, tmp_path / "uvicorn.log") as base:
        started_ms = time.time_ns() // 1_000_000  # as the service's clock reads it
        answers = asyncio.run(create_concurrently(base))
        ended_ms = time.time_ns() // 1_000_000 + 1
        print(f"{REQUESTS} creates, {USERS} users, {WORKERS} workers: {ended_ms - started_ms} ms")

        assert {r.status_code for _, r in answers} <= {201, 429}, [r.text for _, r in answers]
        created: dict[str, set[str]] = defaultdict(set)
        for user, r in answers:
            if r.status_code == 201:
                order = r.json()
                assert (order["user_id"], order["status"]) == (user, "unpaid")
                created[user].add(order["id"])
        refusals = [(user, r) for user, r in answers if r.status_code == 429]
        assert len(refusals) == REQUESTS - USERS * LIMIT
        assert_metrics_sum_the_workers(base, metrics_dir, USERS * LIMIT, len(refusals))
        with engine.connect() as conn:
            rows = {row.id: row for row in conn.execute(select(orders_table))}
        for user, r in refusals:
            # Refused between started_ms and ended_ms, when the user's earliest order had
            # this long to go: Retry-After is that, in whole seconds rounded up.
            earliest_ms = min(rows[oid].expires_at_ms for oid in created[user])
            retry_after = int(r.headers["Retry-After"])
            assert retry_after > 0
            assert math.ceil((earliest_ms - ended_ms) / 1000) <= retry_after
            assert retry_after <= math.ceil((earliest_ms - started_ms) / 1000)
            refusal = r.json()
            assert refusal["error"] == "UnpaidOrderLimitReached"
            assert (refusal["limit"], refusal["retry_after_s"]) == (LIMIT, retry_after)
        # Nothing expires or is paid meanwhile: each user gets exactly LIMIT orders.
        assert {user: len(ids) for user, ids in created.items()} == {
            f"user-{i}": LIMIT for i in range(USERS)
        }
        now_ms = time.time_ns() // 1_000_000
        assert set(rows) == set().union(*created.values())  # every 201 in SQL, nothing else
        for user, ids in created.items():
            open_in_sql = {
                oid
                for oid, row in rows.items()
                if row.user_id == user and row.status == "unpaid" and row.expires_at_ms > now_ms
            }
            assert open_in_sql == ids
            assert set(checker.index.members(user)) == ids  # Redis holds the same, no more
            with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
                listed = client.get(f"/users/{user}/orders").json()
            assert {order["id"] for order in listed} == ids

        with httpx.Client(base_url=base, timeout=10, trust_env=False) as client:
            # Closed by the sweep: an order of 1 s, the checker's clock moved past it.
            clock.set(now_ms)
            late = checker.create_unpaid_order("late-user", ttl_s=1)
            clock.advance(s=2)
            assert checker.sweep_expired().closed == 1
            r = client.post(f"/orders/{late.id}/pay", json={"payment_ref": "psp-late-1"})
            assert r.status_code == 409, r.text
            body = r.json()
            assert body["refund"] == {"required": True, "payment_ref": "psp-late-1"}
            assert (body["order_id"], body["status"]) == (late.id, "closed")
            assert "refunded" in body["detail"]
            assert checker.get_order(late.id).payment_ref is None

            # Cancelled: refunded too.
            first, second = sorted(created["user-0"])
            checker.cancel_order(first)
            r = client.post(f"/orders/{first}/pay", json={"payment_ref": "psp-late-2"})
            assert r.status_code == 409, r.text
            assert r.json()["refund"] == {"required": True, "payment_ref": "psp-late-2"}
            assert r.json()["status"] == "cancelled"

            # On time: paid; the same payment again is fine, another one is a conflict.
            r = client.post(f"/orders/{second}/pay", json={"payment_ref": "psp-1"})
            assert r.status_code == 200, r.text
            assert (r.json()["status"], r.json()["payment_ref"]) == ("paid", "psp-1")
            again = client.post(f"/orders/{second}/pay", json={"payment_ref": "psp-1"})
            assert again.status_code == 200, again.text
            other = client.post(f"/orders/{second}/pay", json={"payment_ref": "psp-2"})
            assert other.status_code == 409, other.text
            assert (other.json()["error"], "refund" in other.json()) == ("OrderAlreadyPaid", False)
            # user-0 holds no open order now: a create is admitted again.
            again_0 = client.post("/users/user-0/orders")
            assert again_0.status_code == 201, again_0.text
            created["user-0"] = {again_0.json()["id"]}

            missing = client.post("/orders/no-such-order/pay", json={"payment_ref": "psp-3"})
            assert (missing.status_code, missing.json()["error"]) == (404, "OrderNotFound")
            invalid = client.get(f"/users/{'u' * 200}/orders")
            assert (invalid.status_code, invalid.json()["field"]) == (422, "user_id")

    # At the end, in both stores: each user's open orders are the ones the test expects,
    # never more than the limit; the closed, cancelled and paid ones are in neither.
    now_ms = time.time_ns() // 1_000_000
    with engine.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(orders_table))}
    for user in [*created, "late-user"]:
        open_in_sql = {
            oid
            for oid, row in rows.items()
            if row.user_id == user and row.status == "unpaid" and row.expires_at_ms > now_ms
        }
        in_redis = set(checker.index.members(user))
        assert open_in_sql == in_redis == created.get(user, set()), user
        assert len(in_redis) <= LIMIT
    assert (rows[late.id].status, rows[first].status, rows[second].status) == (
        "closed",
        "cancelled",
        "paid",
    )
