"""Schema migrations, run from code: ``orders db upgrade`` and the embedded default use this.

The Alembic scripts live in the top-level ``migrations/`` folder of the source tree, and
are installed with the package as ``orders._migrations``. Alembic is imported only to
migrate or to ask it about the scripts: :func:`is_current`, which every command runs
before its first query, reads the version table and the scripts' revision ids itself.

Migrations run one at a time: ``env.py`` takes :func:`migration_lock` first, in the one
transaction Alembic then migrates in, so a second upgrade started beside the first waits
for it, reads the revision the first left and has nothing to do.
"""

from __future__ import annotations

import ast
from importlib import resources
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, String, column, inspect, select, table, text

from orders.sql.models import sql_errors

if TYPE_CHECKING:
    from alembic.config import Config

#: Where Alembic records the revision of a database (its default name).
VERSION_TABLE = "alembic_version"

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


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext  # noqa: PLC0415

    with sql_errors(), engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def is_current(engine: Engine) -> bool:
    """Whether the database is at the newest revision (one head, recorded alone)."""
    heads = script_heads()
    return len(heads) == 1 and stored_revisions(engine) == heads


def stored_revisions(engine: Engine) -> set[str]:
    """The revisions the version table records (none when there is no such table)."""
    with sql_errors(), engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return set()
        version_num = column("version_num", String)
        query = select(version_num).select_from(table(VERSION_TABLE))
        return set(connection.execute(query).scalars())


def script_heads() -> set[str]:
    """The revisions no script builds on, read from the scripts' ``revision`` and
    ``down_revision`` assignments without running them (they import Alembic)."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for script in (resources.files("orders._migrations") / "versions").iterdir():
        if script.name.endswith(".py") and script.name != "__init__.py":
            revision, builds_on = _revision_ids(script.read_text(encoding="utf-8"))
            revisions.add(revision)
            parents.update(builds_on)
    return revisions - parents


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
