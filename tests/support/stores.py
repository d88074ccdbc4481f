"""Readers and writers of the test's two stores, SQL and Redis, and counters of their traffic."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import Sequence
from typing import Any

import psycopg
from alembic.autogenerate import compare_metadata
from sqlalchemy import Engine, event, func, insert, inspect, select, text
from sqlalchemy.pool import Pool

from orders.domain import Order
from orders.index.keys import ADMITS_TAG
from orders.index.nodes import RedisClient, primaries
from orders.service import OrderService
from orders.sql import migrate
from orders.sql.migrate import is_ours, migration_context
from orders.sql.models import SCHEMA, events_table, orders_table

#: The SQL engines every database test runs on (``database_url``'s parameters).
ENGINES = ["sqlite", "postgresql"]


# --- SQL ------------------------------------------------------------------------------------


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


def write_orders_as_of_old(service: OrderService, orders: Sequence[dict[str, Any]]) -> None:
    """Order rows (``orders`` columns), each with its ``created`` event, written straight
    into SQL as if created long ago, and their members into the index at their expiries."""
    with service.engine.begin() as conn:
        conn.execute(insert(orders_table), list(orders))
        created = [
            {"order_id": o["id"], "user_id": o["user_id"], "kind": "created", "at_ms": at_ms}
            for o in orders
            for at_ms in [o["created_at_ms"]]
        ]
        conn.execute(insert(events_table), created)
    pipe = service.index.client.pipeline(transaction=False)
    for o in orders:
        pipe.zadd(service.index.key(o["user_id"]), {o["id"]: o["expires_at_ms"]})
    pipe.execute()


def orders_of(engine: Engine, user_id: str) -> dict[str, Any]:
    with engine.connect() as conn:
        rows = conn.execute(select(*orders_table.c).where(orders_table.c.user_id == user_id)).all()
    return {row.id: row for row in rows}


#: Events that record something beside an order's transitions (a refund owed, an
#: operator's action on a parked event).
RECORDS = ("payment_refused", "requeued", "discarded")


def events_of(engine: Engine, user_id: str) -> dict[str, list[str]]:
    """The user's orders' transition events (:data:`RECORDS` left out), by order."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(events_table.c.order_id, events_table.c.kind)
            .where(events_table.c.user_id == user_id, events_table.c.kind.not_in(RECORDS))
            .order_by(events_table.c.id)
        ).all()
    out: dict[str, list[str]] = {}
    for row in rows:
        out.setdefault(row.order_id, []).append(row.kind)
    return out


def closes_by_creates(engine: Engine, user_id: str) -> int:
    """Closed events written by creates that took the slot of an expired, unswept order."""
    with engine.connect() as conn:
        data = conn.scalars(
            select(events_table.c.data).where(
                events_table.c.user_id == user_id, events_table.c.kind == "closed"
            )
        )
        return sum(d == {"trigger": "slot_reuse"} for d in data)


def unpaid_count(engine: Engine, user_id: str) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count()).where(
                    orders_table.c.user_id == user_id, orders_table.c.status == "unpaid"
                )
            ).scalar_one()
        )


def schema_differences(engine: Engine) -> list[object]:
    """What differs between our tables in the database and the models (a host's tables,
    if any, are not looked at)."""
    with engine.connect() as conn:
        context = migration_context(conn, include_name=is_ours)
        return list(compare_metadata(context, SCHEMA))


def upgrade_to_head(engine: Engine) -> None:
    """Upgrade to the newest revision: the tables must then be the models'."""
    migrate.upgrade(engine)
    assert schema_differences(engine) == []


def upgrade_over(engine: Engine, revision: str, *inserts: str) -> None:
    """Upgrade to ``revision``, write rows as its schema holds them (``inserts``, SQL text),
    then upgrade over them to the newest revision (:func:`upgrade_to_head`)."""
    migrate.upgrade(engine, revision)
    with engine.begin() as conn:
        for statement in inserts:
            conn.execute(text(statement))
    upgrade_to_head(engine)


def table_columns(engine: Engine, table: str) -> set[str]:
    return {c["name"] for c in inspect(engine).get_columns(table)}


class DriverStatements:
    """Every statement the driver connections of this process run while installed,
    SQLAlchemy's and those sent straight to the driver (``orders.sql.direct``) alike, on
    every engine (the asyncio API's threads have one of their own): on SQLite from
    sqlite3's trace callback (BEGIN and COMMIT included, the values inlined), on
    PostgreSQL from psycopg cursors that note each query (and in ``autocommit`` whether
    its connection was in autocommit)."""

    def __init__(self) -> None:
        self.statements: list[str] = []
        self.autocommit: list[bool] = []

    @property
    def count(self) -> int:
        return len(self.statements)

    def __enter__(self) -> DriverStatements:
        event.listen(Pool, "checkout", self._checkout)
        event.listen(Pool, "checkin", self._checkin)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(Pool, "checkout", self._checkout)
        event.remove(Pool, "checkin", self._checkin)

    def _checkout(self, dbapi_connection: Any, *_: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.set_trace_callback(self.statements.append)
            return
        noted = self

        class Noting(psycopg.Cursor[Any]):
            def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
                noted.statements.append(str(query))
                noted.autocommit.append(self.connection.autocommit)
                return super().execute(query, *args, **kwargs)

        dbapi_connection.cursor_factory = Noting

    def _checkin(self, dbapi_connection: Any, *_: Any) -> None:
        if isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.set_trace_callback(None)
        elif dbapi_connection is not None:
            dbapi_connection.cursor_factory = psycopg.Cursor


class StatementCounter:
    def __init__(self) -> None:
        self.statements: list[str] = []

    def __call__(self, *args: Any) -> None:
        self.statements.append(args[2])

    @property
    def count(self) -> int:
        return len(self.statements)


# --- Redis ----------------------------------------------------------------------------------


def flush_db(client: RedisClient) -> None:
    """FLUSHDB on the server, or on every primary of a cluster."""
    for node in primaries(client):
        node.flushdb()


def key_count(client: RedisClient) -> int:
    """Keys in the server, or in all the primaries of a cluster (a cluster client's own
    DBSIZE asks one node only)."""
    return sum(int(node.dbsize()) for node in primaries(client))


def keys_but_admissions(client: RedisClient, window_ms: int) -> list[bytes]:
    """Every key but the users' admissions hashes (server, or each primary of a cluster),
    after checking that each of those expires within ``window_ms``: they outlive the
    orders they note by design, and go by themselves."""
    left: list[bytes] = []
    for node in primaries(client):
        for key in node.scan_iter(count=1000):
            if ADMITS_TAG.encode() in key:
                assert 0 < node.pttl(key) <= window_ms, key
            else:
                left.append(key)
    return left


def redis_commands(client: RedisClient) -> int:
    """Commands the server (every primary of a cluster) has processed so far, this INFO
    call (on each primary) and commands inside scripts included. To count round trips from
    the service, use the ``redis_round_trips`` fixture."""
    return sum(_commands_of(node.info("commandstats")) for node in primaries(client))


def _commands_of(stats: dict[str, Any]) -> int:
    """Calls of every command but REPLCONF: a cluster's replicas send REPLCONF ACK to their
    primary every second, which a count of the service's commands must leave out."""
    return sum(int(entry["calls"]) for name, entry in stats.items() if name != "cmdstat_replconf")


class RoundTripCounter:
    def __init__(self) -> None:
        self.count = 0


def refused_payments_of(engine: Engine, user_id: str) -> dict[str, int]:
    """How many refused payments each of the user's orders recorded (``payment_refused``)."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(events_table.c.order_id, func.count())
            .where(events_table.c.user_id == user_id, events_table.c.kind == "payment_refused")
            .group_by(events_table.c.order_id)
        ).all()
    return {order_id: int(count) for order_id, count in rows}
