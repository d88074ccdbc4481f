"""The names orders gives its objects in a database it may share with a host application.

Every table of ours, and every index and constraint named after one, carries the ``oes_``
prefix (order-expiry service) from migration 0007 on, and Alembic records our revision in
a version table of our own: a host's ``orders`` table or its own Alembic history in
``alembic_version`` then never meets ours. Releases before 0007 used the bare names; the
migrations that predate the prefix take their names from :class:`Names`, so a database
migrated from scratch has the prefixed names from its first revision on, and one migrated
by an older release keeps the bare ones until 0007 renames them.

This module holds the one rule from a bare name to a prefixed one, and the lookup of which
of a list of names the database already uses (a table, an index, a sequence...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import Connection, bindparam, inspect, text

PREFIX = "oes_"
#: Where Alembic records the revision of our schema.
VERSION_TABLE = f"{PREFIX}alembic_version"
#: Alembic's default version table, which releases before 0007 recorded our revision in
#: (and which a host application's own Alembic history uses).
LEGACY_VERSION_TABLE = "alembic_version"
#: Our tables as releases before 0007 named them.
LEGACY_TABLES = ("orders", "order_events", "event_cursors", "event_retries")

# A bare table name where it stands as a whole word of an object's name: at its start
# (the table itself, a sequence ``order_events_id_seq``) or after an underscore
# (``ix_orders_...``, ``fk_order_events_order_id_orders``). Longest first.
_BARE_TABLE = re.compile(
    r"(?:^|(?<=_))(" + "|".join(sorted(LEGACY_TABLES, key=len, reverse=True)) + r")(?=_|$)"
)
_PREFIX_WORD = re.compile(rf"(?:^|(?<=_)){PREFIX}")


def prefixed(bare: str) -> str:
    """The name ``bare`` (a table, or an index, constraint or sequence named after tables
    of ours) has from migration 0007 on: each of our table names in it gets the prefix."""
    return _BARE_TABLE.sub(lambda found: PREFIX + found[1], bare)


def unprefixed(name: str) -> str:
    """The inverse of :func:`prefixed`: the name as releases before 0007 had it."""
    return _PREFIX_WORD.sub("", name)


@dataclass(frozen=True)
class Names:
    """The names a migration before 0007 uses: bare or prefixed, the same for every
    object of one database (0007 renames all of them or none)."""

    prefixed: bool

    @classmethod
    def of(cls, connection: Connection) -> Names:
        """Prefixed when the database holds our tables under the prefixed names."""
        return cls(inspect(connection).has_table(prefixed(LEGACY_TABLES[0])))

    def __call__(self, bare: str) -> str:
        return prefixed(bare) if self.prefixed else bare


#: What each kind of relation is called in a message, by PostgreSQL's ``relkind``.
_PG_KINDS = {
    "r": "table",
    "p": "table",
    "i": "index",
    "I": "index",
    "S": "sequence",
    "v": "view",
    "m": "materialized view",
    "f": "foreign table",
    "c": "type",
}


def existing(connection: Connection, names: Iterable[str]) -> dict[str, str]:
    """Which of ``names`` the database already uses, each with its kind ("table",
    "index", ...): on PostgreSQL the relations of the current schema (tables, indexes,
    sequences and views share one namespace there), on SQLite the objects of the main file
    (index names are per file). Other engines: the tables only."""
    wanted = list(dict.fromkeys(names))
    if not wanted:
        return {}
    dialect = connection.dialect.name
    if dialect == "postgresql":
        query = text(
            "SELECT c.relname, c.relkind FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND c.relname IN :names"
        ).bindparams(bindparam("names", expanding=True))
        found = connection.execute(query, {"names": wanted}).all()
        return {str(name): _PG_KINDS.get(str(kind), "relation") for name, kind in found}
    if dialect == "sqlite":
        query = text("SELECT name, type FROM sqlite_master WHERE name IN :names").bindparams(
            bindparam("names", expanding=True)
        )
        return {str(name): str(kind) for name, kind in connection.execute(query, {"names": wanted})}
    tables = set(inspect(connection).get_table_names())
    return {name: "table" for name in wanted if name in tables}
