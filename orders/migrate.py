"""Schema migrations, run from code: ``orders db upgrade`` and the embedded default use this.

The Alembic scripts live in the top-level ``migrations/`` folder of the source tree, and
are installed with the package as ``orders._migrations``.
"""

from __future__ import annotations

from importlib import resources

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from orders.models import sql_errors


def script_location() -> str:
    return str(resources.files("orders._migrations"))


def alembic_config() -> Config:
    config = Config()
    config.set_main_option("script_location", script_location())
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema of ``engine``'s database up to ``revision``."""
    config = alembic_config()
    with sql_errors(), engine.begin() as connection:
        config.attributes["connection"] = connection
        command.upgrade(config, revision)


def downgrade(engine: Engine, revision: str) -> None:
    config = alembic_config()
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def current_revision(engine: Engine) -> str | None:
    with sql_errors(), engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def is_current(engine: Engine) -> bool:
    return current_revision(engine) == head_revision()
