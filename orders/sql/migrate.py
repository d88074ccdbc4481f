"""Schema migrations, run from code: ``orders db upgrade`` and the embedded default use this.

The Alembic scripts live in the top-level ``migrations/`` folder of the source tree, and
are installed with the package as ``orders._migrations``. Alembic is imported only to
migrate or to ask it about the scripts: :func:`is_current`, which every command runs
before its first query, reads the version table and the scripts' revision ids itself.

Migrations run one at a time: ``env.py`` takes :func:`migration_lock` first, in the one
transaction Alembic then migrates in, so a second upgrade started beside the first waits
for it, reads the revision the first left and has nothing to do. Under that lock it then
calls :func:`adopt_legacy_revision`: a revision of ours that an older release left in
Alembic's default ``alembic_version`` moves to our own version table. The first migration
calls :func:`refuse_conflicts` before it creates anything: a table or index name of ours
already taken is a :class:`~orders.errors.SchemaConflict`, and nothing is written.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, String, column, delete, inspect, select, table, text

from orders.errors import SchemaConflict
from orders.sql.failures import sql_errors
from orders.sql.models import SCHEMA
from orders.sql.schema_names import LEGACY_VERSION_TABLE, VERSION_TABLE, existing

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.runtime.migration import MigrationContext

#: The PostgreSQL advisory lock of this package's migrations (the single-bigint key space):
#: the first 8 bytes of sha256(b"orders schema migrations") as a signed integer. A host
#: application that migrates its own tables in the same database (with its own lock, if
#: any) collides with it only by choosing this very number; small numbers, a hashtext() of
#: a name or the two-int4 form (a key space of its own) never meet it.
MIGRATION_LOCK_KEY = -8803467110800572162


def script_location() -> str:
    return str(resources.files("orders._migrations"))


def alembic_config() -> Config:
    from alembic.config import Config  # noqa: PLC0415

    config = Config()
    config.set_main_option("script_location", script_location())
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema of ``engine``'s database up to ``revision``."""
    from alembic import command  # noqa: PLC0415

    config = alembic_config()
    with sql_errors(), engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def migration_lock(connection: Connection) -> None:
    """Serialise migrations on ``connection``'s database until its transaction ends.

    Call it first in the transaction the migrations run in, before Alembic reads the
    version table: the revision is then read under the lock. PostgreSQL: the transaction-
    scoped advisory lock :data:`MIGRATION_LOCK_KEY`, released by the commit or rollback.
    SQLite: ``BEGIN IMMEDIATE``, the database's write lock (pysqlite has not begun a
    transaction of its own yet: it begins one before DML, and nothing ran before this).
    A waiter waits as long as any statement may (PostgreSQL's statement timeout, SQLite's
    busy timeout), then fails as StoreUnavailable; on PostgreSQL the service's shorter
    ``lock_timeout`` is lifted for the migration's transaction. Other databases: no lock.
    """
    dialect = connection.dialect.name
    if dialect == "postgresql":
        # The service's sessions carry a lock_timeout of about a lease (a payment must not
        # wait on a frozen sweeper); a migration waits on the other upgrade and on the
        # tables' users instead, bounded by the statement timeout alone, as it did before.
        connection.exec_driver_sql("SET LOCAL lock_timeout = 0")
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
    elif dialect == "sqlite":
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def downgrade(engine: Engine, revision: str) -> None:
    from alembic import command  # noqa: PLC0415

    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def migration_context(connection: Connection, **opts: Any) -> MigrationContext:
    """Alembic's view of ``connection``'s database, reading our own version table
    (``opts``: more of MigrationContext's options)."""
    from alembic.runtime.migration import MigrationContext  # noqa: PLC0415

    return MigrationContext.configure(connection, opts={"version_table": VERSION_TABLE, **opts})


def current_revision(engine: Engine) -> str | None:
    with sql_errors(), engine.connect() as connection:
        return migration_context(connection).get_current_revision()


def is_current(engine: Engine) -> bool:
    """Whether the database is at the newest revision (one head, recorded alone)."""
    heads = script_heads()
    return len(heads) == 1 and stored_revisions(engine) == heads


def stored_revisions(engine: Engine) -> set[str]:
    """The revisions our version table records (none when there is no such table)."""
    with sql_errors(), engine.connect() as connection:
        return revisions_in(connection, VERSION_TABLE)


def revisions_in(connection: Connection, version_table: str) -> set[str]:
    """The revisions ``version_table`` records (none when there is no such table)."""
    if not inspect(connection).has_table(version_table):
        return set()
    query = select(column("version_num", String)).select_from(table(version_table))
    return set(connection.execute(query).scalars())


def adopt_legacy_revision(connection: Connection) -> None:
    """Move our revision from Alembic's default version table into ours.

    Releases before migration 0007 recorded it in ``alembic_version``, the table a host
    application's own Alembic history uses too. Only a row naming one of our scripts'
    revisions moves, and only while our own table has none; the table is dropped only
    when that row was its last (then it was ours alone). Any other row is the host's and
    stays as it is.
    """
    if revisions_in(connection, VERSION_TABLE):
        return
    ours = sorted(revisions_in(connection, LEGACY_VERSION_TABLE) & script_revisions())
    if not ours:
        return
    from alembic.script import ScriptDirectory  # noqa: PLC0415

    scripts = ScriptDirectory.from_config(alembic_config())
    for revision in ours:
        migration_context(connection).stamp(scripts, revision)
    legacy = table(LEGACY_VERSION_TABLE, column("version_num", String))
    connection.execute(delete(legacy).where(legacy.c.version_num.in_(ours)))
    if not revisions_in(connection, LEGACY_VERSION_TABLE):
        connection.execute(text(f"DROP TABLE {LEGACY_VERSION_TABLE}"))


def schema_objects() -> dict[str, str]:
    """The names our newest schema gives its tables, then its indexes (and primary keys,
    which PostgreSQL backs with an index of that name), each with its kind."""
    tables = SCHEMA.sorted_tables
    names = {schema_table.name: "table" for schema_table in tables}
    for schema_table in tables:
        names.update({str(index.name): "index" for index in schema_table.indexes})
        names[str(schema_table.primary_key.name)] = "index"
    return names


def refuse_conflicts(connection: Connection, outcome: str) -> None:
    """Raise SchemaConflict naming the first of our objects' names the database already
    uses; call it only when our version table records no revision (then none is ours):
    the first migration does, before it creates anything."""
    ours = schema_objects()
    taken = existing(connection, ours)
    for name in ours:  # tables first
        if name in taken:
            raise SchemaConflict(taken[name], name, outcome)


def refuse_unrecorded_schema(engine: Engine) -> None:
    """SchemaConflict when our version table records no revision but our objects' names
    are taken: what a service started on that database must say instead of
    "run `orders db upgrade`", which would refuse it."""
    with sql_errors(), engine.connect() as connection:
        if not revisions_in(connection, VERSION_TABLE):
            refuse_conflicts(
                connection, "nothing was done; rename or drop it, or use another database"
            )


def is_ours(name: str | None, type_: str, _parents: object) -> bool:
    """Alembic's ``include_name`` hook: a comparison of the schema against the models
    (``alembic check``, the tests) looks at our tables only, never at a host's."""
    return type_ != "table" or name in SCHEMA.tables


def script_revisions() -> set[str]:
    """Every revision id of our scripts."""
    return set(_script_graph())


def script_heads() -> set[str]:
    """The revisions no script builds on, read from the scripts' ``revision`` and
    ``down_revision`` assignments without running them (they import Alembic)."""
    graph = _script_graph()
    return set(graph) - {parent for parents in graph.values() for parent in parents}


@functools.cache
def _script_graph() -> Mapping[str, tuple[str, ...]]:
    """Each script's revision and the revisions it builds on; read once per process (the
    scripts are the installed package's). Parsing them costs about 8 ms of CPU, in C calls
    that hold the GIL: a service built in a thread beside a running event loop (the
    asyncio API's start-up) would make the loop wait for it every time."""
    graph: dict[str, tuple[str, ...]] = {}
    for script in (resources.files("orders._migrations") / "versions").iterdir():
        if script.name.endswith(".py") and script.name != "__init__.py":
            revision, builds_on = _revision_ids(script.read_text(encoding="utf-8"))
            graph[revision] = builds_on
    return graph


def _revision_ids(source: str) -> tuple[str, tuple[str, ...]]:
    """A script's ``revision`` and the revisions it builds on (its ``down_revision``)."""
    found: dict[str, Any] = {}
    for node in ast.parse(source).body:
        target: ast.expr
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id in ("revision", "down_revision"):
            found[target.id] = ast.literal_eval(value)
    down = found.get("down_revision")
    builds_on = () if down is None else (down,) if isinstance(down, str) else tuple(down)
    return str(found["revision"]), builds_on
