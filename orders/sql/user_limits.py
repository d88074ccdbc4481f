"""Per-user unpaid limits: ``oes_user_limits``, the record of every user whose limit is not
the settings' one.

SQL holds them; Redis keeps a copy per user that the admission script reads
(:meth:`orders.index.limits.LimitCopies.write`), and the SQL guard reads the row
itself inside its insert (:func:`orders.sql.slots.effective_limit`), so a limit holds in SQL
whatever Redis lost. Each function here opens and commits its own transaction; a set, and a
clear that removed a limit, append a row to ``oes_user_limit_history`` in it (who, when,
what), which only the user's erasure deletes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Row, delete, insert, select
from sqlalchemy.dialects import postgresql, sqlite

from orders.domain import Actor, ms_to_datetime
from orders.sql.models import user_limit_history_table, user_limits_table
from orders.sql.transactions import Transactions
from orders.validation import check_count

LC = user_limits_table.c
HC = user_limit_history_table.c


@dataclass(frozen=True, slots=True)
class UserLimit:
    """The limit that applies to a user: its own (``own``), or the settings' one."""

    user_id: str
    limit: int
    #: When its own limit was set, and by whom (None for the settings' limit).
    updated_at_ms: int | None = None
    actor: Actor | None = None

    @property
    def own(self) -> bool:
        """True when the user has a limit of its own (set by ``set_user_limit``)."""
        return self.updated_at_ms is not None

    @property
    def updated_at(self) -> datetime | None:
        return None if self.updated_at_ms is None else ms_to_datetime(self.updated_at_ms)


@dataclass(frozen=True, slots=True)
class LimitChange:
    """One set (``limit``) or clear (``limit`` None) of a user's own limit."""

    user_id: str
    limit: int | None
    changed_at_ms: int
    actor: Actor | None


def _to_limit(row: Row[Any]) -> UserLimit:
    actor = Actor.from_columns(row.actor_kind, row.actor)
    return UserLimit(row.user_id, row.unpaid_limit, row.updated_at_ms, actor)


def read_limit(tx: Transactions, user_id: str, default_limit: int) -> UserLimit:
    """The user's own limit, or ``default_limit`` (the settings') when it has none."""
    with tx.read() as conn:
        row = conn.execute(select(user_limits_table).where(LC.user_id == user_id)).one_or_none()
    return UserLimit(user_id, default_limit) if row is None else _to_limit(row)


def write_limit(tx: Transactions, user_id: str, limit: int, now_ms: int, actor: Actor) -> UserLimit:
    """Set the user's own limit (an insert, or an update of its row), and commit."""
    values = {"user_id": user_id, "unpaid_limit": limit, "updated_at_ms": now_ms}
    values.update(actor.columns())
    dialect = postgresql if tx.dialect == "postgresql" else sqlite
    upsert = dialect.insert(user_limits_table).values(values)
    upsert = upsert.on_conflict_do_update(
        index_elements=[LC.user_id],
        set_={name: upsert.excluded[name] for name in values if name != "user_id"},
    )
    with tx.write() as conn:
        conn.execute(upsert)
        _append_history(conn, user_id, limit, now_ms, actor)
        conn.commit()
    return UserLimit(user_id, limit, now_ms, actor)


def delete_limit(tx: Transactions, user_id: str, now_ms: int, actor: Actor) -> bool:
    """Remove the user's own limit (the settings' one applies again); True if it had one."""
    with tx.write() as conn:
        removed = conn.execute(delete(user_limits_table).where(LC.user_id == user_id)).rowcount
        if removed:
            _append_history(conn, user_id, None, now_ms, actor)
        conn.commit()
    return bool(removed)


def read_history(tx: Transactions, user_id: str, limit: int = 100) -> list[LimitChange]:
    """The user's latest ``limit`` limit changes, newest first."""
    query = (
        select(user_limit_history_table)
        .where(HC.user_id == user_id)
        .order_by(HC.id.desc())
        .limit(check_count("limit", limit, 1, 10_000))
    )
    with tx.read() as conn:
        rows = conn.execute(query).all()
    return [
        LimitChange(
            r.user_id, r.unpaid_limit, r.changed_at_ms, Actor.from_columns(r.actor_kind, r.actor)
        )
        for r in rows
    ]


def _append_history(
    conn: Connection, user_id: str, limit: int | None, now_ms: int, actor: Actor
) -> None:
    values = {"user_id": user_id, "unpaid_limit": limit, "changed_at_ms": now_ms}
    conn.execute(insert(user_limit_history_table).values(values | actor.columns()))
