"""Alembic environment for the orders schema.

The URL comes, in order, from a connection handed over by ``orders.sql.migrate`` (in
``config.attributes["connection"]``), from ``sqlalchemy.url`` if someone set it, or from the
service's own settings (``ORDERS_DATABASE_URL``, else the embedded SQLite file).

Our revision lives in a version table of our own (``oes_alembic_version``), so a host
application's Alembic history in ``alembic_version`` is never read or written here, and a
comparison against the models (``alembic check``) looks at our tables only.
"""

from alembic import context
from sqlalchemy import Connection

from orders.config import Settings
from orders.embedded.server import database_url
from orders.sql.engine import build_engine
from orders.sql.migrate import adopt_legacy_revision, is_ours, migration_lock
from orders.sql.models import SCHEMA
from orders.sql.schema_names import VERSION_TABLE

config = context.config
target_metadata = SCHEMA


def _configure(connection: Connection) -> None:
    # First, so the revision Alembic reads next is read under the lock (orders.sql.migrate).
    migration_lock(connection)
    adopt_legacy_revision(connection)  # an older release left our revision in alembic_version
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        include_name=is_ours,
        compare_type=True,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_offline() -> None:
    configured = Settings.from_env().database_url  # a SecretUrl: reveal it to alembic only
    url = config.get_main_option("sqlalchemy.url") or (configured.reveal() if configured else None)
    context.configure(
        url=url,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    handed: Connection | None = config.attributes.get("connection")
    if handed is not None:
        _configure(handed)
        return
    settings = Settings.from_env()
    engine = build_engine(
        settings, config.get_main_option("sqlalchemy.url") or database_url(settings)
    )
    try:
        # One transaction around every migration, as orders.sql.migrate runs them: the
        # migration lock lasts until it ends.
        with engine.begin() as connection:
            _configure(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
