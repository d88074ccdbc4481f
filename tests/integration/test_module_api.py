"""The public surface of ``import orders``: names, errors, the env-configured default service.

Import-time behaviour is checked in a fresh interpreter (``sys.executable -c``) so that
nothing this test process already imported can hide a connection made at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import Engine, select

import orders
from orders.config import Settings
from orders.errors import InvalidInput
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock
from tests.support.processes import child_env, run_python

DEAD_DATABASE_URL = "postgresql://u:p@127.0.0.1:1/x"
DEAD_REDIS_URL = "redis://127.0.0.1:1/0"

FUNCTIONS = [
    "create_unpaid_order",
    "mark_paid",
    "cancel_order",
    "get_order",
    "list_unpaid",
    "sweep_expired",
]
TYPES = ["OrderService", "Order", "OrderStatus", "SweepResult", "Settings"]
ERRORS = [
    "OrdersError",
    "InvalidInput",
    "OrderConflict",
    "OrderNotFound",
    "UnpaidOrderLimitReached",
    "OrderClosed",
    "OrderAlreadyPaid",
    "StoreUnavailable",
]

# Runs in a fresh interpreter: refuses (and counts) every socket connect, imports orders,
# then reports what happened as one line of JSON on stdout.
CHILD_IMPORT = """
import json, socket, sys
attempts = []
def refuse(self, address, *args):
    attempts.append(repr(address))
    raise OSError("connect attempted during import")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
import orders
loaded = sorted(m for m in ("psycopg", "psycopg2") if m in sys.modules)
sys.stdout.write(json.dumps({"attempts": attempts, "drivers": loaded}))
"""

CHILD_CALL = """
import json, sys
import orders
try:
    {call}
except BaseException as exc:
    chain, seen = [], exc
    while seen is not None:
        chain.append(type(seen).__module__ + "." + type(seen).__qualname__)
        seen = seen.__cause__
    result = {{
        "raised": True,
        "type": chain[0],
        "chain": chain,
        "orders_error": isinstance(exc, orders.OrdersError),
        "store_unavailable": isinstance(exc, orders.StoreUnavailable),
        "store": getattr(exc, "store", None),
        "message": str(exc),
    }}
else:
    result = {{"raised": False}}
sys.stdout.write(json.dumps(result))
"""


def run_child(code: str, cwd: Path, **orders_env: str) -> subprocess.CompletedProcess[str]:
    return run_python("-c", code, env=child_env(**orders_env), cwd=cwd)


def raised_in_child(call: str, cwd: Path, database_url: str) -> dict[str, Any]:
    """What ``call`` raised as the first call in a fresh interpreter, on ``database_url``
    and a Redis nobody listens on (CHILD_CALL's report); it must raise."""
    code = CHILD_CALL.format(call=call)
    done = run_child(code, cwd, ORDERS_DATABASE_URL=database_url, ORDERS_REDIS_URL=DEAD_REDIS_URL)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["raised"] is True
    return result


# --- names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FUNCTIONS + TYPES + ERRORS)
def test_public_name_is_importable_from_the_package(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from orders import {name}", namespace)

    assert namespace[name] is getattr(orders, name)
    assert name in orders.__all__


@pytest.mark.parametrize("name", FUNCTIONS)
def test_use_case_functions_are_callable(name: str) -> None:
    assert callable(getattr(orders, name))


@pytest.mark.parametrize("name", ERRORS)
def test_every_error_is_an_orders_error(name: str) -> None:
    error = getattr(orders, name)

    assert isinstance(error, type)
    assert issubclass(error, Exception)
    assert issubclass(error, orders.OrdersError)


def test_order_status_values_are_exactly_the_four_states() -> None:
    assert {status.value for status in orders.OrderStatus} == {
        "unpaid",
        "paid",
        "cancelled",
        "closed",
    }
    assert len(orders.OrderStatus) == 4


# --- nothing connects at import ---------------------------------------------------------


def test_import_connects_to_nothing_and_prints_nothing(tmp_path: Path) -> None:
    done = run_child(
        CHILD_IMPORT,
        tmp_path,
        ORDERS_DATABASE_URL=DEAD_DATABASE_URL,
        ORDERS_REDIS_URL=DEAD_REDIS_URL,
    )

    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    report = json.loads(done.stdout)  # only the child's own line: import printed nothing
    assert report["attempts"] == []
    assert report["drivers"] == []  # no database driver loaded: no engine was built
    assert list(tmp_path.iterdir()) == []  # no embedded home created in the working dir


def test_first_call_with_unreachable_stores_raises_store_unavailable(tmp_path: Path) -> None:
    result = raised_in_child('orders.get_order("x")', tmp_path, DEAD_DATABASE_URL)

    assert result["orders_error"] is True, (
        f"a raw {result['type']} escaped instead of an OrdersError: {result['message']}"
    )
    assert result["store_unavailable"] is True
    assert result["store"] == "sql"
    assert ":p@" not in result["message"]


def test_first_create_with_unreachable_redis_raises_store_unavailable_and_writes_nothing(
    tmp_path: Path, database_url: str, engine: Engine
) -> None:
    create = 'orders.create_unpaid_order("u-1", order_id="o-1")'
    result = raised_in_child(create, tmp_path, database_url)

    assert result["store_unavailable"] is True, result
    assert result["store"] == "redis"
    assert result["chain"][1].startswith("redis.")  # the cause is kept for debugging
    with engine.connect() as conn:
        assert conn.execute(select(orders_table.c.id)).all() == []


# --- the default service from ORDERS_* --------------------------------------------------


@pytest.fixture
def env_default_service(
    monkeypatch: pytest.MonkeyPatch, database_url: str, redis_url: str
) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith("ORDERS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ORDERS_DATABASE_URL", database_url)
    monkeypatch.setenv("ORDERS_REDIS_URL", redis_url)
    monkeypatch.setenv("ORDERS_UNPAID_LIMIT", "2")
    monkeypatch.setenv("ORDERS_TTL_S", "60")
    orders.configure(None)
    try:
        yield
    finally:
        service = orders.default_service()
        service.engine.dispose()
        service.index.client.close()
        orders.configure(None)


def test_module_functions_run_on_the_default_service_configured_from_the_environment(
    env_default_service: None,
    engine: Engine,
    redis_client: redis.Redis,
    clock: ManualClock,
) -> None:
    user = "env-user"
    wall_before = time.time_ns() // 1_000_000
    first = orders.create_unpaid_order(user, amount="19.90", currency="EUR")
    second = orders.create_unpaid_order(user)
    wall_after = time.time_ns() // 1_000_000

    service = orders.default_service()
    assert service.settings.unpaid_limit == 2
    assert service.settings.default_policy.ttl_s == 60
    with pytest.raises(orders.UnpaidOrderLimitReached) as refused:
        orders.create_unpaid_order(user)
    assert refused.value.limit == 2
    assert refused.value.open_count == 2

    # The real clock: created now, expiring 60 s later.
    assert wall_before <= first.created_at_ms <= wall_after
    assert first.expires_at_ms - first.created_at_ms == 60_000
    assert second.expires_at_ms - second.created_at_ms == 60_000
    key = service.index.key(user)
    assert {m.decode() for m in redis_client.zrange(key, 0, -1)} == {first.id, second.id}
    assert int(redis_client.zscore(key, first.id) or 0) == first.expires_at_ms

    fetched = orders.get_order(first.id)
    assert fetched.id == first.id
    assert fetched.status is orders.OrderStatus.UNPAID
    assert fetched.amount == first.amount == Decimal("19.90")
    soonest_first = sorted([first, second], key=lambda o: (o.expires_at_ms, o.id))
    assert [o.id for o in orders.list_unpaid(user)] == [o.id for o in soonest_first]

    paid = orders.mark_paid(first.id, payment_ref="psp-1")
    cancelled = orders.cancel_order(second.id, reason="changed mind")
    assert paid.status is orders.OrderStatus.PAID
    assert cancelled.status is orders.OrderStatus.CANCELLED
    assert redis_client.zcard(key) == 0
    assert orders.list_unpaid(user) == []

    third = orders.create_unpaid_order(user)  # the slots are free again
    clock.set(third.expires_at_ms)  # move the default service to a clock the test controls
    service.clock = clock
    swept = orders.sweep_expired()
    assert isinstance(swept, orders.SweepResult)
    assert swept.closed == 1

    with engine.connect() as conn:
        statuses = dict(conn.execute(select(orders_table.c.id, orders_table.c.status)).all())
        kinds = conn.execute(
            select(events_table.c.order_id, events_table.c.kind).order_by(events_table.c.id)
        ).all()
    assert statuses == {first.id: "paid", second.id: "cancelled", third.id: "closed"}
    assert [tuple(k) for k in kinds] == [
        (first.id, "created"),
        (second.id, "created"),
        (first.id, "paid"),
        (second.id, "cancelled"),
        (third.id, "created"),
        (third.id, "closed"),
    ]
    assert redis_client.exists(key) == 0 or redis_client.zcard(key) == 0
    assert orders.get_order(third.id).status is orders.OrderStatus.CLOSED


def test_configure_binds_the_module_functions_to_a_given_service(
    env_default_service: None, service: orders.OrderService, redis_client: redis.Redis
) -> None:
    orders.configure(service)
    try:
        order = orders.create_unpaid_order("bound", limit=5)
        assert orders.default_service() is service
        assert service.index.members("bound") == {order.id: order.expires_at_ms}
        ttl_ms = order.expires_at_ms - order.created_at_ms
        assert ttl_ms == service.settings.default_policy.ttl_s * 1000  # not ORDERS_TTL_S's
    finally:
        orders.configure(None)


# --- Settings ---------------------------------------------------------------------------


def test_settings_from_env_parses_numbers_and_booleans() -> None:
    settings = Settings.from_env(
        {
            "ORDERS_UNPAID_LIMIT": "7",
            "ORDERS_TTL_S": "12.5",
            "ORDERS_STRICT_EXPIRY": "yes",
            "ORDERS_SWEEP_BATCH_SIZE": "250",
            "ORDERS_KEY_PREFIX": "Unpaid:",
            "ORDERS_HOME": "/tmp/orders-home",
            "ORDERS_DATABASE_URL": "",  # empty means unset
        }
    )

    assert settings.unpaid_limit == 7
    assert settings.default_policy.ttl_s == 12.5
    assert settings.strict_expiry is True
    assert settings.sweep_batch_size == 250
    assert settings.key_prefix == "Unpaid:"
    assert settings.home == Path("/tmp/orders-home")
    assert settings.database_url is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("true", True), ("ON", True), ("0", False), ("false", False), ("No", False)],
)
def test_settings_from_env_reads_boolean_spellings(raw: str, expected: bool) -> None:
    assert Settings.from_env({"ORDERS_STRICT_EXPIRY": raw}).strict_expiry is expected


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("ORDERS_UNPAID_LIMIT", "abc"),
        ("ORDERS_UNPAID_LIMIT", "2.5"),
        ("ORDERS_TTL_S", "soon"),
        ("ORDERS_STRICT_EXPIRY", "maybe"),
        ("ORDERS_SQL_POOL_SIZE", "five"),
    ],
)
def test_settings_from_env_refuses_an_unreadable_value_naming_the_variable(
    variable: str, raw: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings.from_env({variable: raw})

    assert refused.value.field == variable
    assert variable in str(refused.value)
    assert raw not in str(refused.value)  # the message does not echo the value


def test_settings_from_env_refuses_an_out_of_range_value() -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings.from_env({"ORDERS_UNPAID_LIMIT": "0"})

    assert "unpaid_limit" in str(refused.value).lower()


def test_settings_describe_hides_the_passwords_of_both_urls() -> None:
    settings = Settings(
        database_url="postgresql://app:s3cret-db@db.example:5432/orders",
        redis_url="redis://:s3cret-redis@cache.example:6380/2",
    )

    described = settings.describe()

    text = json.dumps(described)
    assert "s3cret-db" not in text
    assert "s3cret-redis" not in text
    assert described["database_url"] == "postgresql://app:***@db.example:5432/orders"
    assert described["redis_url"] == "redis://:***@cache.example:6380/2"
    assert described["unpaid_limit"] == "3"


def test_settings_describe_keeps_urls_without_a_password() -> None:
    settings = Settings(database_url="sqlite:////var/lib/orders.db", redis_url=DEAD_REDIS_URL)

    described = settings.describe()

    assert described["database_url"] == "sqlite:////var/lib/orders.db"
    assert described["redis_url"] == DEAD_REDIS_URL
