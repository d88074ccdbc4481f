"""Our tables, indexes and constraints take the ``oes_`` prefix.

A host application that shares the database has tables of its own, an ``orders`` table
often among them. From here on every table of ours is ``oes_<name>`` (``oes_orders``,
``oes_order_events``, ``oes_event_cursors``, ``oes_event_retries``), and every index,
constraint and sequence named after one follows (``ix_orders_unpaid_user_id_slot`` becomes
``ix_oes_orders_unpaid_user_id_slot``): on PostgreSQL index names share the schema's
namespace with tables, on SQLite the file's. The rule is orders.sql.schema_names.prefixed.

A database migrated from scratch by this release has these names already (the earlier
migrations take them from ``Names``): nothing to do. One migrated by an older release is
renamed here; processes of that release must be stopped first, their statements name the
old tables. Renaming is cheap on PostgreSQL (the catalog only); SQLite rebuilds the indexes,
which it cannot rename.

Downgrade renames back, unless one of the old names is taken by then (a host's ``orders``
table, say): the names then stay prefixed, and the earlier migrations' downgrades use them.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

from orders.errors import SchemaConflict
from orders.sql.schema_names import LEGACY_TABLES, Names, existing, prefixed, unprefixed

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    bind = op.get_bind()
    if Names.of(bind).prefixed:
        return
    plan = renames(bind, list(LEGACY_TABLES), prefixed)
    taken = existing(bind, plan.values())
    for name in plan.values():  # tables first
        if name in taken:
            raise SchemaConflict(taken[name], name, "the upgrade to 0007 changed nothing")
    rename(bind, plan)


def downgrade() -> None:
    bind = op.get_bind()
    if not Names.of(bind).prefixed:
        return
    plan = renames(bind, [prefixed(table) for table in LEGACY_TABLES], unprefixed)
    if existing(bind, plan.values()):
        return  # an old name is someone else's now: keep ours (see the docstring)
    rename(bind, plan)


def renames(bind: sa.Connection, tables: list[str], new: Callable[[str], str]) -> dict[str, str]:
    """Old name -> new name of the tables and of every named index, constraint and serial
    sequence of theirs whose name ``new`` changes."""
    inspector = sa.inspect(bind)
    names = list(tables)
    for table in tables:
        names += [str(ix["name"]) for ix in inspector.get_indexes(table) if ix["name"]]
        if bind.dialect.name == "postgresql":
            names.append(str(inspector.get_pk_constraint(table)["name"]))
            names += [str(ck["name"]) for ck in inspector.get_check_constraints(table)]
            names += [str(fk["name"]) for fk in inspector.get_foreign_keys(table)]
            names += serial_sequences(bind, table)
    return {old: new(old) for old in dict.fromkeys(names) if new(old) != old}


def serial_sequences(bind: sa.Connection, table: str) -> list[str]:
    """The sequences of ``table``'s serial columns (order events' ids): PostgreSQL named
    them after the table, and keeps the name when the table is renamed."""
    query = sa.text(
        "SELECT s.relname FROM pg_depend d"
        " JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'"
        " JOIN pg_class t ON t.oid = d.refobjid"
        " WHERE t.relname = :table AND t.relnamespace = s.relnamespace"
        " AND s.relnamespace = current_schema()::regnamespace"
    )
    return [str(name) for name in bind.execute(query, {"table": table}).scalars()]


def rename(bind: sa.Connection, plan: dict[str, str]) -> None:
    kinds = existing(bind, plan)
    tables = [old for old in plan if kinds.get(old) == "table"]
    for old in tables:
        op.rename_table(old, plan[old])
    if bind.dialect.name == "postgresql":
        rename_postgresql(bind, plan, kinds, tables)
    else:
        rebuild_sqlite_indexes(bind, plan, kinds)


def rename_postgresql(
    bind: sa.Connection, plan: dict[str, str], kinds: dict[str, str], tables: list[str]
) -> None:
    """Indexes and sequences are relations (ALTER ... RENAME); constraints belong to their
    table (a primary key's rename renames its index too, so it goes by its constraint)."""
    inspector = sa.inspect(bind)
    constraints: set[str] = set()
    for table in tables:
        new_table = plan[table]
        owned = [str(inspector.get_pk_constraint(new_table)["name"])]
        owned += [str(ck["name"]) for ck in inspector.get_check_constraints(new_table)]
        owned += [str(fk["name"]) for fk in inspector.get_foreign_keys(new_table)]
        for old in owned:
            if old in plan:
                op.execute(f'ALTER TABLE "{new_table}" RENAME CONSTRAINT "{old}" TO "{plan[old]}"')
                constraints.add(old)
    for old, new in plan.items():
        if old in constraints or kinds.get(old) not in ("index", "sequence"):
            continue
        op.execute(f'ALTER {kinds[old].upper()} "{old}" RENAME TO "{new}"')


def rebuild_sqlite_indexes(
    bind: sa.Connection, plan: dict[str, str], kinds: dict[str, str]
) -> None:
    """SQLite renames a table with its constraints, the references to it and its
    AUTOINCREMENT counter, but cannot rename an index: each is created again from its own
    definition under the new name."""
    for old, new in plan.items():
        if kinds.get(old) != "index":
            continue
        definition = bind.execute(
            sa.text("SELECT sql FROM sqlite_master WHERE type = 'index' AND name = :name"),
            {"name": old},
        ).scalar_one()
        op.execute(f'DROP INDEX "{old}"')
        op.execute(str(definition).replace(old, new, 1))
