"""Migration 0004: parked event retries, up and down, on each engine, with data in place."""

from __future__ import annotations

from sqlalchemy import Engine, inspect, select, text

from orders.events.retries import RC, RETRYING
from orders.sql import migrate
from orders.sql.models import retries_table
from orders.sql.schema_names import unprefixed
from tests.support.plans import explain
from tests.support.stores import upgrade_over, upgrade_to_head

RETRY_COLUMNS = "consumer, event_id, attempts, next_at_ms, last_error"


def retry_indexes(engine: Engine, table: str = retries_table.name) -> set[str]:
    return {ix["name"] or "" for ix in inspect(engine).get_indexes(table)}


def test_0004_keeps_retries_as_retrying_and_downgrade_keeps_parked_ones(
    empty_engine: Engine,
) -> None:
    retry = f"INSERT INTO {retries_table.name} ({RETRY_COLUMNS}) VALUES ('c', 1, 2, 5, 'E')"
    upgrade_over(empty_engine, "0003", retry)
    assert retry_indexes(empty_engine) == {"ix_oes_event_retries_retrying_consumer_next_at_ms"}
    with empty_engine.begin() as conn:
        [row] = conn.execute(select(retries_table)).all()
        assert (row.attempts, row.parked_at_ms) == (2, None)
        conn.execute(retries_table.update().values(parked_at_ms=9))

    migrate.downgrade(empty_engine, "0003")  # below 0007: the bare names again
    bare = unprefixed(retries_table.name)
    assert retry_indexes(empty_engine, bare) == {"ix_event_retries_consumer_next_at_ms"}
    assert "parked_at_ms" not in {c["name"] for c in inspect(empty_engine).get_columns(bare)}
    with empty_engine.connect() as conn:  # not deleted silently: a plain retry again
        assert conn.execute(text(f"SELECT {RETRY_COLUMNS} FROM {bare}")).all() == [
            ("c", 1, 2, 5, "E")
        ]

    upgrade_to_head(empty_engine)


def test_due_retries_are_found_through_an_index_over_retrying_rows_only(engine: Engine) -> None:
    [index] = inspect(engine).get_indexes(retries_table.name)
    where = str(index.get("dialect_options", {}).get(f"{engine.dialect.name}_where"))
    assert "parked_at_ms IS NULL" in where.replace("(", "").replace(")", "")
    due = (
        select(RC.event_id, RC.attempts)
        .where(RC.consumer == "c", RETRYING, RC.next_at_ms <= 5)
        .order_by(RC.next_at_ms)
        .limit(10)
    )
    assert "ix_oes_event_retries_retrying_consumer_next_at_ms" in explain(engine, due)
