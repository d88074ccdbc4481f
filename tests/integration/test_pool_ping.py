"""Pooled connections a server dropped: pinged at checkout when idle, not on every use; and
the timeouts every session of the engine carries.

PostgreSQL only (a SQLite file has no server to drop a connection). The server end of the
one pooled connection is terminated behind the pool's back, as an idle timeout or a proxy
would; what the next create sees depends on whether that connection sat idle long enough
to be pinged (``orders.sql.engine.PING_IDLE_S``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.pool import NullPool

from orders import bootstrap
from orders.config import Settings
from orders.errors import StoreUnavailable
from orders.service import OrderService
from orders.sql import engine as sql_engine
from orders.sql import migrate


@pytest.fixture
def database_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A migrated PostgreSQL database of its own (this file has no SQLite half)."""
    target, _ = request.getfixturevalue("postgres_template")
    name = target.new_database()
    try:
        url = target.url(name)
        migrate.upgrade(create_engine(url, poolclass=NullPool))
        yield url
    finally:
        target.drop_database(name)


@pytest.fixture
def one_connection_engine(database_url: str) -> Iterator[Engine]:
    engine = bootstrap.build_engine(
        Settings(database_url=database_url, sql_pool_size=1, sql_max_overflow=0)
    )
    try:
        yield engine
    finally:
        engine.dispose()


def drop_the_pooled_connection(engine: Engine, database_url: str) -> None:
    """Terminate the server end of the pool's one connection, behind the pool's back."""
    with engine.connect() as conn:
        backend_pid = conn.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]
    other = create_engine(database_url, poolclass=NullPool)
    try:
        with other.connect() as conn:
            terminated = conn.execute(
                text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": backend_pid}
            ).scalar()
        assert terminated
    finally:
        other.dispose()


def test_an_idle_connection_the_server_dropped_is_replaced_before_use(
    one_connection_engine: Engine,
    database_url: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    service = OrderService(one_connection_engine, redis_client, Settings())
    service.create_unpaid_order("u1")
    drop_the_pooled_connection(one_connection_engine, database_url)
    monkeypatch.setattr(sql_engine, "PING_IDLE_S", 0.0)  # every checkout counts as idle

    order = service.create_unpaid_order("u2")  # the ping finds it dead: a new connection

    assert service.get_order(order.id).user_id == "u2"


def test_a_busy_connection_is_not_pinged_so_a_dropped_one_fails_once(
    one_connection_engine: Engine,
    database_url: str,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The negative control: without the ping the same drop reaches one caller, and the
    pool recovers on its own (SQLAlchemy invalidates it on the disconnect)."""
    service = OrderService(one_connection_engine, redis_client, Settings())
    service.create_unpaid_order("u1")
    drop_the_pooled_connection(one_connection_engine, database_url)
    monkeypatch.setattr(sql_engine, "PING_IDLE_S", 3600.0)

    with pytest.raises(StoreUnavailable):
        service.create_unpaid_order("u2")
    order = service.create_unpaid_order("u2")

    assert service.get_order(order.id).user_id == "u2"
    assert service.index.members("u2") == {order.id: order.expires_at_ms}


def test_each_session_carries_lock_bounds_that_follow_the_lease_unless_given(
    database_url: str,
) -> None:
    # A frozen holder's locks go (idle timeout, half the lease) before a waiting statement
    # gives up (lock timeout, the lease), and both before a standby takes over.
    read = text(
        "SELECT name, setting FROM pg_settings WHERE name IN"
        " ('statement_timeout', 'lock_timeout', 'idle_in_transaction_session_timeout')"
    )
    cases: list[tuple[dict[str, float], tuple[int, int]]] = [
        ({}, (5000, 2500)),
        ({"lease_ttl_s": 30}, (30_000, 15_000)),
        ({"sql_lock_timeout_s": 1.5, "sql_idle_in_transaction_timeout_s": 0}, (1500, 0)),
    ]
    for given, (lock_ms, idle_ms) in cases:
        engine = bootstrap.build_engine(Settings(database_url=database_url, **given))
        try:
            with engine.connect() as conn:
                found = {name: int(setting) for name, setting in conn.execute(read)}
        finally:
            engine.dispose()
        assert found == {
            "statement_timeout": 30_000,
            "lock_timeout": lock_ms,
            "idle_in_transaction_session_timeout": idle_ms,
        }, given
