"""What several test modules share: small readers of the stores, child processes, logs."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, select

from orders.bench.measure import percentile
from orders.domain import Order
from orders.embedded.server import redis_status
from orders.index.nodes import RedisClient, primaries
from orders.service import OrderService
from orders.sql.models import events_table, orders_table


def create_orders(
    service: OrderService, ttls_s: Sequence[float], users: Sequence[str] = ("u1",)
) -> list[Order]:
    """One order per TTL, all created at the clock's current instant, users taken in turn."""
    return [
        service.create_unpaid_order(users[i % len(users)], ttl_s=ttl, limit=1000)
        for i, ttl in enumerate(ttls_s)
    ]


def sql_rows(engine: Engine) -> dict[str, Any]:
    """Every order row, by id."""
    with engine.connect() as conn:
        return {row.id: row for row in conn.execute(select(orders_table)).all()}


def closed_event_counts(engine: Engine) -> Counter[str]:
    """How many ``closed`` events each order has."""
    query = select(events_table.c.order_id).where(events_table.c.kind == "closed")
    with engine.connect() as conn:
        return Counter(conn.execute(query).scalars().all())


def figures(values: Sequence[float]) -> str:
    """``min / p50 / p99 / max`` of ``values`` (nearest rank), for a test's printed report."""
    if not values:
        return "none"
    return " / ".join(
        f"{x:g}" for x in (min(values), percentile(values, 50), percentile(values, 99), max(values))
    )


# --- child processes ------------------------------------------------------------------------

#: The checkout: the working directory of child processes, first on their PYTHONPATH.
REPO = Path(__file__).resolve().parents[1]


def refuse_inserts(engine: Engine, table: str, message: str) -> None:
    """Install a trigger that makes every later INSERT into ``table`` fail with an
    IntegrityError (a check violation) carrying ``message``, on either engine."""
    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.exec_driver_sql(
                f"CREATE TRIGGER refuse_{table} BEFORE INSERT ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
            return
        conn.exec_driver_sql(
            f"CREATE FUNCTION refuse_{table}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"RAISE EXCEPTION '{message}' USING ERRCODE = 'check_violation'; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER refuse_{table} BEFORE INSERT ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION refuse_{table}()"
        )


#: The one ORDERS_* variable children inherit: which redis-server an embedded default runs.
KEPT_ENV = {"ORDERS_REDIS_SERVER"}


def child_env(**orders_env: str) -> dict[str, str]:
    """A child's environment: ours without any ORDERS_* variable (a developer's own settings
    never leak in) but ORDERS_REDIS_SERVER (the binary of the test's run, see
    ``tests/conftest.py``: redis_binary), with this checkout first on PYTHONPATH, plus
    ``orders_env``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORDERS_") or k in KEPT_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(orders_env)
    return env


def run_python(
    *args: str, env: dict[str, str], cwd: Path = REPO, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` to its end: exit status, stdout and stderr as text (never raises on a
    non-zero exit; the caller asserts on it)."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def run_orders(
    *args: str, env: dict[str, str], cwd: Path = REPO, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """The ``orders`` command (``python -m orders ARGS``) as a real process, to its end."""
    return run_python("-m", "orders", *args, env=env, cwd=cwd, timeout_s=timeout_s)


def stop_process(
    proc: subprocess.Popen[Any], *, signum: int = signal.SIGTERM, timeout_s: float = 10
) -> int:
    """End a child we started, by its PID: ``signum``, then SIGKILL if it is still there
    after ``timeout_s``. Reaps it and returns its exit status (also if it had already ended)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
    return proc.wait(timeout_s)


def kill_embedded_redis(home: Path) -> None:
    """For cleanup: SIGKILL the embedded redis-server of ``home`` by its PID, if one runs."""
    running = redis_status(home)
    if running is not None:
        os.kill(running.pid, signal.SIGKILL)


def servers_under(base: Path) -> list[int]:
    """Live processes (not zombies) whose working dir is under ``base``: redis-server chdirs
    to its --dir, so these are the embedded servers of homes under ``base``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = Path(os.readlink(entry / "cwd"))
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            continue
        if cwd.is_relative_to(base) and state not in {"Z", "X"}:
            found.append(int(entry.name))
    return sorted(found)


# --- logs -------------------------------------------------------------------------------------


def record_texts(records: Iterable[logging.LogRecord]) -> list[str]:
    """Each record's message, and its traceback when it has one: all a log would show."""
    texts = []
    formatter = logging.Formatter()
    for record in records:
        texts.append(record.getMessage())
        if record.exc_info:
            texts.append(formatter.formatException(record.exc_info))
    return texts


def flush_db(client: RedisClient) -> None:
    """FLUSHDB on the server, or on every primary of a cluster."""
    for node in primaries(client):
        node.flushdb()


def key_count(client: RedisClient) -> int:
    """Keys in the server, or in all the primaries of a cluster (a cluster client's own
    DBSIZE asks one node only)."""
    return sum(int(node.dbsize()) for node in primaries(client))


def free_port() -> int:
    """A TCP port free on loopback right now (the kernel's pick; a child binds it next)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
