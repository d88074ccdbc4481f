"""The one rule from the names before migration 0007 to ours, against the models."""

from __future__ import annotations

from sqlalchemy import Table

from orders.sql.models import SCHEMA
from orders.sql.schema_names import LEGACY_TABLES, PREFIX, prefixed, unprefixed


def names_of(table: Table) -> list[str]:
    constraints = [str(c.name) for c in table.constraints if c.name]
    return [table.name, *(str(ix.name) for ix in table.indexes), *constraints]


#: Tables created after 0007, with the prefix from the start.
BORN_PREFIXED = {
    "oes_payment_refusals",
    "oes_user_limits",
    "oes_pauses",
    "oes_user_limit_history",
    "oes_resources",
    "oes_holds",
    "oes_units",
    "oes_waiting",
}


def test_every_table_of_the_models_is_a_former_table_with_the_prefix_or_born_with_it() -> None:
    former = {PREFIX + name for name in LEGACY_TABLES}
    assert set(SCHEMA.tables) == former | BORN_PREFIXED
    assert all(name.startswith(PREFIX) for name in BORN_PREFIXED)


def test_every_name_of_the_models_is_the_prefixed_form_of_its_former_name() -> None:
    for table in SCHEMA.tables.values():
        for name in names_of(table):
            if table.name in BORN_PREFIXED:
                assert PREFIX in name, name
                continue
            former = unprefixed(name)
            assert PREFIX not in former, name
            assert prefixed(former) == name, name


def test_prefixed_names_each_of_our_tables_in_a_name_and_nothing_else() -> None:
    assert prefixed("fk_order_events_order_id_orders") == "fk_oes_order_events_order_id_oes_orders"
    assert prefixed("order_events_id_seq") == "oes_order_events_id_seq"
    assert prefixed("ix_orders_unpaid_user_id_slot") == "ix_oes_orders_unpaid_user_id_slot"
    assert prefixed("host_order_ids") == "host_order_ids"
    assert prefixed("orders_pkey") == "oes_orders_pkey"
