"""PostgreSQL restarted (fast shutdown, then start) under load from worker processes.

The test starts a PostgreSQL of its own, with fsync and synchronous commits on, as in
production. Two worker processes (tests/support/workers/pg.py) create, pay and sweep without
pause and log every acknowledged result (fsynced per line); meanwhile the server is shut down
"fast" (SIGINT: what ``pg_ctl stop -m fast`` sends), kept down a moment, and started again.

Nothing a caller was told has happened may be missing afterwards: each acknowledged create
is a row, each acknowledged payment is paid with its reference, each acknowledged close is
closed. During the outage callers get ``StoreUnavailable`` and nothing else, no call takes
longer than the configured timeouts allow, and each process works again without a restart
of its own. The Redis index equals SQL after reconcile.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine

from orders.bootstrap import build_engine
from orders.config import Settings
from orders.errors import StoreUnavailable
from orders.sql import migrate
from orders.sql.records import OrderRecords
from tests.support.checks import (
    assert_acknowledged_in_sql,
    assert_index_equals_sql_after_reconcile,
    assert_typed_outcomes,
    read_acks,
)
from tests.support.postgres import PostgresServer, find_postgres_bin
from tests.support.processes import started
from tests.support.workers.pg import MODULE as PG_WORKER

WORKERS = 2
#: The children's timeouts (ORDERS_* variables), small so an outage is felt quickly.
TIMEOUTS = {
    "ORDERS_SQL_POOL_TIMEOUT_S": "2",
    "ORDERS_SQL_CONNECT_TIMEOUT_S": "2",
    "ORDERS_SQL_STATEMENT_TIMEOUT_S": "5",
    "ORDERS_REDIS_SOCKET_TIMEOUT_S": "0.5",
}
#: A use case opens at most two SQL connections in turn (a create: its insert, then making
#: room) and calls Redis at most a few times, each with one retry.
LONGEST_CALL_S = 2 * (2 + 2 + 5) + 4 * 2 * 0.5


@pytest.fixture
def durable_postgres() -> Iterator[PostgresServer]:
    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb) found")
    server = PostgresServer(bindir, durable=True).start()
    try:
        server.execute("CREATE DATABASE orders")
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_acknowledged_work_survives_a_postgres_restart_and_every_process_recovers(
    durable_postgres: PostgresServer,
    redis_client: redis.Redis,
    redis_options: dict[str, Any],
    full_size: bool,
    tmp_path: Path,
) -> None:
    database_url = durable_postgres.url("orders")
    engine = build_engine(Settings(database_url=database_url))
    try:
        migrate.upgrade(engine)
        run(engine, durable_postgres, redis_client, redis_options, full_size, tmp_path)
    finally:
        engine.dispose()


def run(
    engine: Engine,
    server: PostgresServer,
    redis_client: redis.Redis,
    redis_options: dict[str, Any],
    full_size: bool,
    tmp_path: Path,
) -> None:
    database_url = server.url("orders")
    load_s, down_s = (10.0, 3.0) if full_size else (2.0, 1.0)
    specs = [
        (
            "load",
            {
                "name": f"w{n}",
                "users": 20,
                "limit": 1000,
                "ttl_s": [0.3, 1.5],
                "threads": 3,
                "pay_share": 0.3,
                "acks_path": str(tmp_path / f"w{n}.acks"),
            },
        )
        for n in range(WORKERS)
    ]
    with started(
        specs,
        database_url=database_url,
        redis_options=redis_options,
        log_dir=tmp_path,
        module=PG_WORKER,
        extra_env=TIMEOUTS,
    ) as workers:
        for worker in workers:
            worker.go()
        time.sleep(load_s)  # load before the restart
        down_at = time.time()
        server.shut_down()
        time.sleep(down_s)  # callers meet a server that is gone
        server.launch()
        up_at = time.time()
        time.sleep(load_s)  # load after it: each process must recover on its own
        for worker in workers:
            worker.stop()
        results = [worker.result(timeout_s=60) for worker in workers]
    acks = [read_acks(tmp_path / f"w{n}.acks") for n in range(WORKERS)]

    # --- callers saw only StoreUnavailable, never a hang, and recovered ---
    failed_in_all = assert_typed_outcomes(results, {"StoreUnavailable"})
    for r in results:
        for op, data in r["ops"].items():
            assert data["longest_s"] < LONGEST_CALL_S, (r["name"], op, data)
            assert data["last_ok_s"] is not None, (r["name"], op)
            assert data["last_ok_s"] > up_at, (r["name"], op)  # worked after the restart
            if data["last_failure_s"] is not None:
                assert data["first_success_after_s"] is not None, (r["name"], op)
    assert failed_in_all > 0, "no call met the outage: the test tested nothing"
    failed = [sum(sum(d["failed"].values()) for d in r["ops"].values()) for r in results]

    # --- nothing acknowledged is missing; the index equals SQL after reconcile ---
    acked = assert_acknowledged_in_sql(engine, acks)
    assert acked["pay"], acked
    assert acked["close"], acked
    settings = Settings(database_url=database_url, **redis_options)
    assert_index_equals_sql_after_reconcile(engine, redis_client, settings)

    print(
        f"\n[postgres restart] outage {up_at - down_at:.2f} s (down {down_s} s + start); "
        f"acknowledged creates {acked['create']}, payments {acked['pay']}, closes "
        f"{acked['close']}; all in SQL"
    )
    for r, n_failed in zip(results, failed, strict=True):
        ops = r["ops"]
        recovery = {
            op: round(d["first_success_after_s"] - up_at, 3)
            for op, d in ops.items()
            if d["first_success_after_s"] is not None
        }
        print(
            f"  {r['name']}: calls {sum(d['calls'] for d in ops.values())}, failed {n_failed} "
            f"({ {op: d['failed'] for op, d in ops.items()} }), longest call "
            f"{max(d['longest_s'] for d in ops.values())} s, first success after the "
            f"restart (s after it was up) {recovery}"
        )


@pytest.mark.timeout(30)
def test_a_server_that_accepts_but_never_answers_fails_the_call_within_the_connect_timeout() -> (
    None
):
    # A listening socket nobody reads: the TCP handshake completes, the start-up reply never
    # comes (a host stuck in its start-up, a half-open proxy). Without a connect timeout the
    # call would wait here until this test's own timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        settings = Settings(
            database_url=f"postgresql+psycopg://orders@127.0.0.1:{port}/orders",
            sql_connect_timeout_s=2,
        )
        engine = build_engine(settings)
        try:
            records = OrderRecords(engine)
            with pytest.raises(StoreUnavailable):
                records.find("any-order", 0)
        finally:
            engine.dispose()
