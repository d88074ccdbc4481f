"""Faults of a real Redis Cluster under load: a primary SIGKILLed (its replica promoted),
slots resharded, a primary restarted empty.

Two worker processes (tests/support/workers/pg.py, mode ``load``) create orders for a few
users each at a limit of 2, pay some and sweep, on PostgreSQL and a local cluster of 3
primaries and 3 replicas of the test's own (a short node timeout: a failover takes a
second or two). Mid-run the fault strikes; the load goes on through it and after it.

Asserted for each fault: every call ended in its result or a typed error (StoreUnavailable
while a node was unreachable, never anything untyped); each worker's creates work again
after the fault without a restart of the process; no user held more unpaid orders than the
limit in SQL at any sampled instant or at the end; nothing acknowledged is missing from
SQL; after a reconcile the index equals SQL. The figures of each run are printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from orders.bootstrap import build_redis
from orders.config import Settings
from orders.embedded.binary import find_redis_server
from tests.support.checks import (
    assert_acknowledged_in_sql,
    assert_index_equals_sql_after_reconcile,
    assert_typed_outcomes,
    read_acks,
)
from tests.support.cluster import LocalCluster, running_cluster
from tests.support.monitor import LimitMonitor
from tests.support.processes import started
from tests.support.workers.pg import MODULE as PG_WORKER

WORKERS = 2
LIMIT = 2
#: The children's timeouts, small so a dead node is felt quickly.
TIMEOUTS = {"ORDERS_REDIS_SOCKET_TIMEOUT_S": "0.5", "ORDERS_SQL_POOL_TIMEOUT_S": "5"}


@pytest.fixture
def cluster() -> Iterator[LocalCluster]:
    """A cluster of the test's own: the faults break it."""
    with running_cluster(find_redis_server(), "orders-cluster-fault-") as running:
        yield running


def busy_key() -> str:
    """The key of a user the workers use (tests/support/workers/pg.py names users so)."""
    return "UnpaidOrder-w0-user-0"


def kill_a_primary(cluster: LocalCluster) -> str:
    victim = cluster.primary_of(busy_key())
    cluster.kill(victim)
    cluster.wait_healthy()  # a replica was promoted
    return f"SIGKILL to primary :{victim.port}, replica promoted"


def reshard(cluster: LocalCluster) -> str:
    source = cluster.primary_of(busy_key())
    target = next(node for node in cluster.primaries() if node.port != source.port)
    # All but its last slot (the busy keys' slot is below it, asserted): emptied, a 7.0
    # primary turns replica of the node that took its last slot, and that switch fails
    # redis-cli's last step at random ("UNBLOCKED ... master -> replica?").
    slots = cluster.slot_count(source) - 1
    cluster.reshard(source, target, slots=slots)
    assert cluster.primary_of(busy_key()).port == target.port
    return f"{slots} slots of :{source.port} moved to :{target.port}"


def restart_a_primary_empty(cluster: LocalCluster) -> str:
    victim = cluster.primary_of(busy_key())
    for replica in cluster.replicas_of(victim):  # so it cannot take over: the data is lost
        with replica.client() as client:
            client.config_set("cluster-replica-no-failover", "yes")
    cluster.kill(victim)
    cluster.restart(victim)
    cluster.wait_healthy()
    with victim.client() as client:
        role = client.info("replication")["role"]
    assert role == "master", "the restarted node did not come back as the primary"
    return f"primary :{victim.port} SIGKILLed and restarted without its data"


FAULTS: dict[str, Callable[[LocalCluster], str]] = {
    "primary-killed": kill_a_primary,
    "resharded": reshard,
    "primary-restarted-empty": restart_a_primary_empty,
}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_cluster_fault_under_load_loses_nothing_acknowledged_and_keeps_the_limit(
    fault: str,
    cluster: LocalCluster,
    engine: Engine,
    database_url: str,
    full_size: bool,
    tmp_path: Path,
) -> None:
    redis_options: dict[str, Any] = {"redis_url": cluster.url, "redis_cluster": True}
    load_s = 6.0 if full_size else 1.5
    specs = [
        (
            "load",
            {
                "name": f"w{n}",
                "users": 6,
                "limit": LIMIT,
                "ttl_s": [0.5, 4.0],
                "threads": 3,
                "pay_share": 0.3,
                "acks_path": str(tmp_path / f"w{n}.acks"),
            },
        )
        for n in range(WORKERS)
    ]
    with (
        started(
            specs,
            database_url=database_url,
            redis_options=redis_options,
            log_dir=tmp_path,
            module=PG_WORKER,
            extra_env=TIMEOUTS,
        ) as workers,
        LimitMonitor(engine, limit=LIMIT) as monitor,
    ):
        for worker in workers:
            worker.go()
        time.sleep(load_s)  # load before the fault
        struck_at = time.time()
        what = FAULTS[fault](cluster)
        healed_at = time.time()
        time.sleep(load_s)  # load after it: each process must carry on by itself
        for worker in workers:
            worker.stop()
        results = [worker.result(timeout_s=60) for worker in workers]

    failed = assert_typed_outcomes(results, {"StoreUnavailable"})
    for r in results:
        creates = r["ops"]["create"]
        assert creates["last_ok_s"] is not None, r["name"]
        assert creates["last_ok_s"] > healed_at, (r["name"], "no create after the fault")
    assert monitor.samples > 0
    assert monitor.max_unpaid <= LIMIT, f"a user held {monitor.max_unpaid} unpaid orders in SQL"
    assert monitor.violations == [], monitor.violations[:5]
    assert monitor.sample().unpaid <= LIMIT  # and at the end
    acked = assert_acknowledged_in_sql(
        engine, [read_acks(tmp_path / f"w{n}.acks") for n in range(WORKERS)]
    )
    # A URL naming a node alive now (the one named at first may be the one killed).
    redis_options["redis_url"] = cluster.url
    client = build_redis(Settings(**redis_options))
    try:
        settings = Settings(database_url=database_url, **redis_options)
        members = assert_index_equals_sql_after_reconcile(engine, client, settings)
    finally:
        client.close()

    if fault == "resharded":  # MOVED and ASK followed by the sweep's bulk cleanup too
        assert [r["sweep_redis_errors"] for r in results] == [0] * WORKERS
    failures = {
        r["name"]: {op: data["failed"] for op, data in r["ops"].items() if data["failed"]}
        for r in results
    }
    recovered = [
        round(data["first_success_after_s"] - healed_at, 3)
        for r in results
        for data in r["ops"].values()
        if data["first_success_after_s"] is not None
    ]
    print(
        f"\n[cluster {fault}] {what}; fault took {healed_at - struck_at:.2f} s; "
        f"acknowledged {dict(acked)}; failed calls {failed} {failures}; sweeps whose Redis "
        f"cleanup failed {[r['sweep_redis_errors'] for r in results]}; longest call "
        f"{max(d['longest_s'] for r in results for d in r['ops'].values())} s; first "
        f"success after the last failure, s after the fault ended: {recovered}; most unpaid "
        f"of one user in SQL {monitor.max_unpaid} ({monitor.samples} samples); index after "
        f"reconcile {members} members"
    )
