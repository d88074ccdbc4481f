"""Small readers of the stores that several test modules share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, select

from orders.domain import Order
from orders.models import events_table, orders_table
from orders.service import OrderService


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
