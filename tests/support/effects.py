"""The host side of the exactly-once consumer tests: ``created`` events written straight into
SQL, and a table of the handler's effects with no unique constraint, so a duplicate shows.

Used by ``tests/crash/test_exactly_once_consumer.py``, its child
(``tests/support/workers/exactly_once.py``) and
``tests/integration/test_transactional_consumer.py``.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy import BigInteger, Column, Connection, Engine, MetaData, Table, insert, select

from orders.events.consumer import OrderEvent
from orders.sql.models import events_table, orders_table, retries_table

host_metadata = MetaData()
#: One row per handled event; deliberately without a key.
effects_table = Table("host_effects", host_metadata, Column("event_id", BigInteger))


def create_effects_table(engine: Engine) -> None:
    host_metadata.create_all(engine)


def write_events(engine: Engine, count: int, transactions: int = 1) -> list[int]:
    """``count`` orders with their ``created`` events, written in ``transactions`` separate
    transactions (on PostgreSQL, several transaction ids); the event ids in order."""
    per = -(-count // transactions)
    for start in range(0, count, per):
        numbers = range(start, min(start + per, count))
        with engine.begin() as conn:
            conn.execute(
                insert(orders_table),
                [
                    {
                        "id": f"order-{n:06d}",
                        "user_id": f"user-{n % 50}",
                        "status": "unpaid",
                        "created_at_ms": 1_000 + n,
                        "expires_at_ms": 10**13,
                        "updated_at_ms": 1_000 + n,
                    }
                    for n in numbers
                ],
            )
            conn.execute(
                insert(events_table),
                [
                    {
                        "order_id": f"order-{n:06d}",
                        "user_id": f"user-{n % 50}",
                        "kind": "created",
                        "at_ms": 1_000 + n,
                    }
                    for n in numbers
                ],
            )
    with engine.connect() as conn:
        return list(conn.scalars(select(events_table.c.id).order_by(events_table.c.id)))


def record_effect(event: OrderEvent, conn: Connection) -> None:
    conn.execute(insert(effects_table).values(event_id=event.id))


def tried_before(conn: Connection, consumer: str, event: OrderEvent) -> bool:
    """Whether ``consumer`` has a retry row for ``event`` (it failed on it before)."""
    query = select(retries_table.c.event_id).where(
        retries_table.c.consumer == consumer, retries_table.c.event_id == event.id
    )
    return conn.execute(query).first() is not None


def effect_counts(engine: Engine) -> Counter[int]:
    with engine.connect() as conn:
        return Counter(conn.scalars(select(effects_table.c.event_id)))


def retry_rows(engine: Engine, consumer: str) -> dict[int, tuple[int, bool]]:
    """This consumer's retry rows: event id -> (attempts, parked)."""
    rc = retries_table.c
    query = select(rc.event_id, rc.attempts, rc.parked_at_ms).where(rc.consumer == consumer)
    with engine.connect() as conn:
        return {r.event_id: (r.attempts, r.parked_at_ms is not None) for r in conn.execute(query)}
