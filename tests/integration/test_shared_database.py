"""A database shared with a host application: our own version table, prefixed names.

On each engine: a database the previous release migrated (its revision in Alembic's default
``alembic_version``, the bare table names) upgrades with every row kept; a host application
with its own Alembic history and its own ``orders`` table upgrades and downgrades beside
ours in either order, neither touching the other's tables, rows or revision; and a name of
ours already taken by something else is a SchemaConflict naming it, with nothing written,
from the code and from the CLI (one line, exit 9), at upgrade and at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, inspect, text

from orders.bootstrap import ensure_schema
from orders.errors import SchemaConflict
from orders.sql import migrate
from orders.sql.models import SCHEMA, events_table, orders_table
from orders.sql.schema_names import LEGACY_VERSION_TABLE, VERSION_TABLE, prefixed
from tests.support.processes import child_env, run_orders
from tests.support.schemas import (
    HOST_STATE,
    PREVIOUS_ROWS,
    HostApplication,
    as_previous_release,
    as_rows_were,
    rows_of,
)
from tests.support.stores import schema_differences

OUR_TABLES = [*SCHEMA.tables, VERSION_TABLE]


def our_state(engine: Engine) -> dict[str, list[tuple[object, ...]]]:
    return rows_of(engine, OUR_TABLES)


def table_names(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names())


# --- the previous release's database ----------------------------------------------------------


def test_a_database_of_the_previous_release_upgrades_with_its_revision_moved_and_rows_kept(
    empty_engine: Engine,
) -> None:
    migrate.upgrade(empty_engine)
    as_previous_release(empty_engine)
    before = rows_of(empty_engine, list(PREVIOUS_ROWS))
    assert all(len(rows) == 1 for rows in before.values())
    assert migrate.current_revision(empty_engine) is None  # ours is empty: not current

    migrate.upgrade(empty_engine)

    after = rows_of(empty_engine, [prefixed(name) for name in PREVIOUS_ROWS])
    renamed = {prefixed(name): rows for name, rows in before.items()}
    assert as_rows_were(after, renamed) == renamed
    assert migrate.current_revision(empty_engine) == migrate.head_revision()
    assert LEGACY_VERSION_TABLE not in table_names(empty_engine)  # it held our row alone
    assert not set(PREVIOUS_ROWS) & table_names(empty_engine)
    assert schema_differences(empty_engine) == []
    with empty_engine.begin() as conn:  # event ids go on from where they were
        conn.execute(
            events_table.insert().values(order_id="o-1", user_id="u-1", kind="paid", at_ms=2000)
        )
        ids = conn.execute(text(f"SELECT id FROM {events_table.name} ORDER BY id")).scalars()
        assert list(ids) == [1, 2]


def test_only_our_revision_moves_out_of_a_shared_alembic_version(empty_engine: Engine) -> None:
    """A host that had (wrongly) shared alembic_version with the previous release keeps its
    revision and the table; only ours moves."""
    migrate.upgrade(empty_engine)
    as_previous_release(empty_engine)
    with empty_engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {LEGACY_VERSION_TABLE} VALUES ('hostrev0001')"))

    migrate.upgrade(empty_engine)

    assert rows_of(empty_engine, [LEGACY_VERSION_TABLE, VERSION_TABLE]) == {
        LEGACY_VERSION_TABLE: [("hostrev0001",)],
        VERSION_TABLE: [(migrate.head_revision(),)],
    }


# --- a host application with its own Alembic history ------------------------------------------


@pytest.mark.parametrize("first", ["host", "orders"])
def test_a_host_and_orders_upgrade_and_downgrade_independently_in_either_order(
    empty_engine: Engine, empty_url: str, tmp_path: Path, first: str
) -> None:
    host = HostApplication(tmp_path / "host", empty_url)
    ours_up: Callable[[], None] = lambda: migrate.upgrade(empty_engine)  # noqa: E731
    for step in (host.upgrade, ours_up) if first == "host" else (ours_up, host.upgrade):
        step()
    assert host.state(empty_engine) == HOST_STATE
    assert schema_differences(empty_engine) == []
    with empty_engine.begin() as conn:
        conn.execute(
            orders_table.insert().values(
                id="o-1", user_id="u-1", status="unpaid", created_at_ms=1, expires_at_ms=2,
                updated_at_ms=1, slot=1,
            )
        )  # fmt: skip
    ours = our_state(empty_engine)
    assert ours[VERSION_TABLE] == [(migrate.head_revision(),)]

    # Ours down below 0007 and back: the host's `orders` keeps our tables prefixed.
    migrate.downgrade(empty_engine, "0006")
    assert host.state(empty_engine) == HOST_STATE
    assert orders_table.name in table_names(empty_engine)
    migrate.upgrade(empty_engine)
    assert host.state(empty_engine) == HOST_STATE
    assert our_state(empty_engine) == ours

    # The host's down and up again: ours untouched.
    host.downgrade()
    assert "orders" not in table_names(empty_engine)
    assert our_state(empty_engine) == ours
    host.upgrade()
    assert host.state(empty_engine) == HOST_STATE
    assert our_state(empty_engine) == ours

    # Ours down to nothing and up again: the host's untouched.
    migrate.downgrade(empty_engine, "base")
    assert host.state(empty_engine) == HOST_STATE
    assert not set(SCHEMA.tables) & table_names(empty_engine)
    migrate.upgrade(empty_engine)
    assert host.state(empty_engine) == HOST_STATE
    assert schema_differences(empty_engine) == []


# --- names already taken ----------------------------------------------------------------------

#: Something of a host's under a name of ours: a table, or an index on a table of its own.
TAKEN = {
    "table": f"CREATE TABLE {orders_table.name} (number INTEGER PRIMARY KEY)",
    "index": "CREATE INDEX ix_oes_orders_unpaid_expires_at_ms ON host_things (at)",
}


@pytest.mark.parametrize("kind", list(TAKEN))
def test_a_name_of_ours_already_taken_refuses_the_upgrade_and_writes_nothing(
    empty_engine: Engine, kind: str
) -> None:
    with empty_engine.begin() as conn:
        conn.execute(text("CREATE TABLE host_things (at INTEGER)"))
        conn.execute(text(TAKEN[kind]))
    before = table_names(empty_engine)

    with pytest.raises(SchemaConflict) as refused:
        migrate.upgrade(empty_engine)

    name = orders_table.name if kind == "table" else "ix_oes_orders_unpaid_expires_at_ms"
    assert (refused.value.kind, refused.value.name) == (kind, name)
    assert str(refused.value) == (
        f"{kind} '{name}' already exists in the database and is not orders' "
        "(created by something else); the upgrade changed nothing"
    )
    assert table_names(empty_engine) == before  # not even our version table


def test_a_primary_key_name_of_ours_taken_is_a_conflict_where_the_engine_shares_it(
    empty_engine: Engine,
) -> None:
    """A host's table whose primary-key constraint has the name ours needs (``pk_oes_orders``).
    PostgreSQL backs the constraint with an index of that name, among the relations our
    CREATE TABLE would add its own to: a SchemaConflict naming it, before anything is
    written (at upgrade and at start-up). SQLite keeps a constraint's name with its table
    alone, so there it takes nothing of ours: the upgrade goes through beside it."""
    primary_key = str(orders_table.primary_key.name)
    with empty_engine.begin() as conn:
        constraint = f"CONSTRAINT {primary_key} PRIMARY KEY (at)"
        conn.execute(text(f"CREATE TABLE host_things (at INTEGER, {constraint})"))
        conn.execute(text("INSERT INTO host_things VALUES (7)"))
    host_things = {"host_things": [(7,)]}

    if empty_engine.dialect.name == "sqlite":
        migrate.upgrade(empty_engine)
        assert schema_differences(empty_engine) == []
        assert rows_of(empty_engine, ["host_things"]) == host_things
        return
    for refusing in (migrate.upgrade, ensure_schema):
        with pytest.raises(SchemaConflict) as refused:
            refusing(empty_engine)
        assert (refused.value.kind, refused.value.name) == ("index", primary_key)
        assert table_names(empty_engine) == {"host_things"}  # not even our version table
        assert rows_of(empty_engine, ["host_things"]) == host_things


def test_the_cli_says_the_conflict_in_one_line_with_its_own_exit_code(
    empty_engine: Engine, empty_url: str, tmp_path: Path
) -> None:
    with empty_engine.begin() as conn:
        conn.execute(text(TAKEN["table"]))
        conn.execute(text(f"INSERT INTO {orders_table.name} VALUES (7)"))
    env = child_env(ORDERS_DATABASE_URL=empty_url, ORDERS_HOME=str(tmp_path / "home"))

    upgraded = run_orders("db", "upgrade", env=env)

    line = (
        f"error: table '{orders_table.name}' already exists in the database and is not "
        "orders' (created by something else); the upgrade changed nothing\n"
    )
    assert (upgraded.returncode, upgraded.stderr, upgraded.stdout) == (9, line, "")
    assert table_names(empty_engine) == {orders_table.name}
    assert rows_of(empty_engine, [orders_table.name]) == {orders_table.name: [(7,)]}


def test_a_service_on_our_tables_without_our_revision_says_the_conflict_not_run_upgrade(
    engine: Engine,
) -> None:
    """Tables of ours but no revision recorded: "run `orders db upgrade`" would loop (the
    upgrade refuses them), so start-up says the conflict instead."""
    ensure_schema(engine)  # at head: fine
    with engine.begin() as conn:
        conn.execute(text(f"DELETE FROM {VERSION_TABLE}"))

    with pytest.raises(SchemaConflict) as refused:
        ensure_schema(engine)

    assert refused.value.kind == "table"
    assert refused.value.name in SCHEMA.tables
    assert "orders db upgrade" not in str(refused.value)
