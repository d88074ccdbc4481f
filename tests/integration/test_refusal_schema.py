"""Migration 0008: refused payments and the events' actors, up and down, with data in place."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from orders.events.consumer import read_events
from orders.sql import migrate
from orders.sql.models import events_table, orders_table, refusals_table
from tests.support.stores import table_columns, upgrade_over, upgrade_to_head

ORDER = (
    f"INSERT INTO {orders_table.name} (id, user_id, status, created_at_ms, expires_at_ms,"
    " updated_at_ms, close_reason, closed_at_ms)"
    " VALUES ('o-1', 'u-1', 'closed', 1000, 61000, 61000, 'expired', 61000)"
)
EVENTS = (
    f"INSERT INTO {events_table.name} (order_id, user_id, kind, at_ms) VALUES"
    " ('o-1', 'u-1', 'created', 1000), ('o-1', 'u-1', 'closed', 61000)"
)


def test_0008_keeps_old_events_readable_with_no_actor_and_downgrade_drops_only_its_own(
    empty_engine: Engine,
) -> None:
    upgrade_over(empty_engine, "0007", ORDER, EVENTS)
    old = read_events(empty_engine)
    assert [(e.kind, e.actor) for e in old] == [("created", None), ("closed", None)]
    with empty_engine.begin() as conn:  # the new kind is admitted, and ids go on
        conn.execute(
            events_table.insert().values(
                order_id="o-1",
                user_id="u-1",
                kind="payment_refused",
                at_ms=62000,
                actor_kind="application",
            )
        )
        conn.execute(
            refusals_table.insert().values(
                order_id="o-1",
                payment_ref="psp-1",
                user_id="u-1",
                reason="closed",
                refused_at_ms=62000,
                event_id=3,
            )
        )
    assert [e.id for e in read_events(empty_engine)] == [1, 2, 3]
    with pytest.raises(IntegrityError), empty_engine.begin() as conn:  # the check still holds
        conn.execute(events_table.insert().values(order_id="o-1", user_id="u-1", kind="x", at_ms=1))

    migrate.downgrade(empty_engine, "0007")
    assert refusals_table.name not in inspect(empty_engine).get_table_names()
    assert {"actor_kind", "actor"}.isdisjoint(table_columns(empty_engine, events_table.name))
    with empty_engine.connect() as conn:
        kinds = conn.execute(text(f"SELECT kind FROM {events_table.name} ORDER BY id")).all()
    assert [k for (k,) in kinds] == ["created", "closed"]

    upgrade_to_head(empty_engine)
