"""A host application's side of ``connection=`` tests: its own table beside the service's,
and reads of both stores at the end of a test."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select

from orders.service import OrderService
from orders.sql.models import events_table, orders_table


class Boom(Exception):
    """The host's own failure inside its transaction block."""


HOST_METADATA = MetaData()
#: The host application's own table: its cart, written in the same transaction.
CARTS = Table(
    "host_carts",
    HOST_METADATA,
    Column("id", Integer, primary_key=True),
    Column("user_id", String(64), nullable=False),
)


#: The host's row, as a statement its Connection, Session or async twins execute.
def cart_insert(user_id: str) -> Any:
    return CARTS.insert().values(user_id=user_id)


@contextmanager
def host_tables(engine: Engine) -> Iterator[None]:
    """The host's table in the test's database, for the test."""
    HOST_METADATA.create_all(engine)
    try:
        yield
    finally:
        HOST_METADATA.drop_all(engine)


def cart_count(engine: Engine, user_id: str) -> int:
    with engine.connect() as conn:
        query = select(func.count()).select_from(CARTS).where(CARTS.c.user_id == user_id)
        return int(conn.execute(query).scalar_one())


def sql_status(engine: Engine, order_id: str) -> str | None:
    with engine.connect() as conn:
        query = select(orders_table.c.status).where(orders_table.c.id == order_id)
        status: str | None = conn.execute(query).scalar_one_or_none()
        return status


def event_kinds(engine: Engine, order_id: str) -> list[str]:
    with engine.connect() as conn:
        query = select(events_table.c.kind).where(events_table.c.order_id == order_id)
        return sorted(conn.execute(query).scalars())


def members(service: OrderService, user_id: str) -> set[str]:
    return set(service.index.members(user_id))


def admission_notes(service: OrderService, user_id: str) -> set[str]:
    raw = service.index.client.hkeys(service.index.admits_key(user_id))
    return {key.decode() if isinstance(key, bytes) else key for key in raw}


def open_orders(engine: Engine) -> dict[str, set[str]]:
    """Every unpaid order in SQL, by user."""
    found: dict[str, set[str]] = {}
    with engine.connect() as conn:
        query = select(orders_table.c.user_id, orders_table.c.id).where(
            orders_table.c.status == "unpaid"
        )
        for user_id, order_id in conn.execute(query):
            found.setdefault(user_id, set()).add(order_id)
    return found
