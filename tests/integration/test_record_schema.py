"""Migration 0012: refusals that outlive their order, and the per-user limits' history, up
and down, with data in place."""

from __future__ import annotations

from sqlalchemy import Engine, inspect, select, text

from orders.sql import migrate
from orders.sql.models import (
    events_table,
    orders_table,
    refusals_table,
    user_limit_history_table,
)
from tests.support.stores import upgrade_over, upgrade_to_head

ORDER = (
    f"INSERT INTO {orders_table.name} (id, user_id, status, created_at_ms, expires_at_ms,"
    " updated_at_ms, close_reason, closed_at_ms)"
    " VALUES ('o-1', 'u-1', 'closed', 1000, 61000, 61000, 'expired', 61000)"
)
EVENT = (
    f"INSERT INTO {events_table.name} (order_id, user_id, kind, at_ms)"
    " VALUES ('o-1', 'u-1', 'payment_refused', 62000)"
)
REFUSAL = (
    f"INSERT INTO {refusals_table.name} (order_id, payment_ref, user_id, reason,"
    " refused_at_ms, event_id) VALUES ('o-1', 'psp-1', 'u-1', 'closed', 62000, 1)"
)


def refusal_keys(engine: Engine) -> list[tuple[str, str]]:
    query = select(refusals_table.c.order_id, refusals_table.c.payment_ref)
    with engine.connect() as conn:
        return sorted((r.order_id, r.payment_ref) for r in conn.execute(query))


def test_0012_keeps_every_refusal_admits_one_without_its_order_and_downgrade_drops_those(
    empty_engine: Engine,
) -> None:
    upgrade_over(empty_engine, "0011", ORDER, EVENT, REFUSAL)
    assert refusal_keys(empty_engine) == [("o-1", "psp-1")]
    with empty_engine.begin() as conn:  # no order, no user, no event: admitted now
        conn.execute(
            refusals_table.insert().values(
                order_id="o-gone", payment_ref="psp-2", reason="unknown_order", refused_at_ms=1
            )
        )
        conn.execute(
            user_limit_history_table.insert().values(user_id="u-1", unpaid_limit=2, changed_at_ms=1)
        )

    migrate.downgrade(empty_engine, "0011")
    assert refusal_keys(empty_engine) == [("o-1", "psp-1")]
    assert user_limit_history_table.name not in inspect(empty_engine).get_table_names()
    with empty_engine.begin() as conn:  # the foreign key is back: its order takes it along
        conn.execute(text(f"DELETE FROM {orders_table.name}"))
    assert refusal_keys(empty_engine) == []
    upgrade_to_head(empty_engine)
