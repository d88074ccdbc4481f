"""Migration 0009: the orders' policy and reminder columns, the ``expiring`` event kind and
the per-user limits, up and down, with data in place."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from orders.events.consumer import read_events
from orders.sql import migrate
from orders.sql.models import events_table, orders_table, user_limits_table
from tests.support.stores import table_columns, upgrade_over, upgrade_to_head

ORDER = (
    f"INSERT INTO {orders_table.name} (id, user_id, status, created_at_ms, expires_at_ms,"
    " updated_at_ms, slot) VALUES ('o-1', 'u-1', 'unpaid', 1000, 61000, 1000, 1)"
)
EVENT = (
    f"INSERT INTO {events_table.name} (order_id, user_id, kind, at_ms, actor_kind)"
    " VALUES ('o-1', 'u-1', 'created', 1000, 'application')"
)
NEW_COLUMNS = {"policy", "remind_at_ms", "reminded_at_ms"}


def limit_row(user_id: str, limit: int) -> dict[str, object]:
    return {"user_id": user_id, "unpaid_limit": limit, "updated_at_ms": 2000}


def test_0009_keeps_old_orders_on_the_defaults_and_downgrade_drops_only_its_own(
    empty_engine: Engine,
) -> None:
    upgrade_over(empty_engine, "0008", ORDER, EVENT)
    with empty_engine.connect() as conn:
        old = conn.execute(
            text(f"SELECT policy, remind_at_ms, reminded_at_ms, slot FROM {orders_table.name}")
        ).one()
    assert tuple(old) == (None, None, None, 1)
    with empty_engine.begin() as conn:
        conn.execute(
            events_table.insert().values(
                order_id="o-1", user_id="u-1", kind="expiring", at_ms=31000, actor_kind="sweeper"
            )
        )
        conn.execute(user_limits_table.insert().values(limit_row("u-1", 0)))
        conn.execute(user_limits_table.insert().values(limit_row("u-2", 1_000_000)))
    assert [e.kind for e in read_events(empty_engine)] == ["created", "expiring"]
    for wrong in (-1, 1_000_001):  # the range holds in the schema too
        with pytest.raises(IntegrityError), empty_engine.begin() as conn:
            conn.execute(user_limits_table.insert().values(limit_row("u-3", wrong)))
    with pytest.raises(IntegrityError), empty_engine.begin() as conn:  # one row per user
        conn.execute(user_limits_table.insert().values(limit_row("u-1", 5)))

    migrate.downgrade(empty_engine, "0008")
    assert user_limits_table.name not in inspect(empty_engine).get_table_names()
    assert NEW_COLUMNS.isdisjoint(table_columns(empty_engine, orders_table.name))
    assert [e.kind for e in read_events(empty_engine)] == ["created"]
    with empty_engine.connect() as conn:  # the order and its slot are intact
        rows = conn.execute(text(f"SELECT id, status, slot FROM {orders_table.name}")).all()
    assert [tuple(r) for r in rows] == [("o-1", "unpaid", 1)]

    upgrade_to_head(empty_engine)


@pytest.mark.parametrize("target", ["0005", "0002"])
def test_a_downgrade_that_drops_an_orders_column_keeps_every_event(
    empty_engine: Engine, target: str
) -> None:
    """0006 (slot) and 0003 (extensions) drop a column of the orders table: on SQLite a
    rebuild of that table would delete every event through the foreign key's cascade."""
    migrate.upgrade(empty_engine, "0006")
    with empty_engine.begin() as conn:
        conn.execute(text(ORDER))
        conn.execute(text(EVENT.replace(", actor_kind", "").replace(", 'application'", "")))

    migrate.downgrade(empty_engine, target)
    with empty_engine.connect() as conn:
        events = conn.execute(text(f"SELECT order_id, kind FROM {events_table.name}")).all()
    assert [tuple(e) for e in events] == [("o-1", "created")]
    upgrade_to_head(empty_engine)
