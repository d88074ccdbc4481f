"""Whether a create that left a Redis member but no SQL row is over, or still running.

A member whose create started a while ago and has no row belongs to a create that died (its
process killed inside the host's transaction, its Redis step failed after the script had
run) or to one still on its way. What tells them apart:

* PostgreSQL: a create's insert takes a shared transaction-scoped advisory lock on its order
  id in the same statement (:func:`in_flight_lock`), held until its transaction ends, a dead
  connection's too. The check tries that lock exclusively, then looks for the row, in that
  order: at READ COMMITTED the second statement's snapshot sees the commit that released
  the lock. No row and the lock free: the create's transaction is over. (Shared, so that
  twins of one id never wait on each other; a create waits only on a check, milliseconds.)
* SQLite: one writer at a time. The check takes the write lock (waiting at most
  :data:`WRITE_LOCK_WAIT_MS`) and then looks for the row: while it holds the lock no
  insert is left uncommitted anywhere. A writer that holds the lock longer (a host's open
  transaction) leaves the answer unknown for now.

Neither sees a create that has not reached its insert yet: past the age a refusal asks
about (``orders.index.unpaid.SUSPECT_AFTER_MS``) one waits on a starved pool or a connect,
and losing its member costs nothing of the limit (the slot guard decides, and a refusal by
SQL writes the member back).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, String, bindparam, func, literal_column, select
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import OperationalError

from orders.sql.failures import sql_errors
from orders.sql.models import orders_table
from orders.sql.transactions import Transactions

#: The first key of the creates' advisory locks (two int4 keys: a space apart from the
#: migrations' single bigint).
LOCK_CLASS: ColumnElement[int] = literal_column("7300467")  # "oes"
#: How long the SQLite check waits for the write lock (a plain create holds it milliseconds).
WRITE_LOCK_WAIT_MS = 200


def in_flight_lock(order_id: ColumnElement[Any], *, check: bool = False) -> ColumnElement[Any]:
    """The create's shared lock on ``order_id`` (true once held), or the check's try of it."""
    key = func.hashtext(order_id)
    if check:
        return func.pg_try_advisory_xact_lock(LOCK_CLASS, key)
    return func.pg_advisory_xact_lock_shared(LOCK_CLASS, key).is_not(None)


_IDS = func.unnest(bindparam("ids", type_=postgresql.ARRAY(String))).column_valued("oid")
_TRY_LOCKS = select(_IDS, in_flight_lock(_IDS, check=True))
_ROWS = select(orders_table.c.id).where(orders_table.c.id.in_(bindparam("ids", expanding=True)))


class CreateFates(NamedTuple):
    """What SQL knows of some creates: ``committed`` have a row; ``dead`` have none and no
    transaction that could still write one; the others may still be running."""

    committed: list[str]
    dead: list[str]


class CreatesInFlight:
    """The check of the module docstring."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def fates(self, order_ids: Sequence[str]) -> CreateFates | None:
        """Which creates of ``order_ids`` (a few) committed and which are over without a row;
        None when SQLite's write lock stays held (no answer yet)."""
        ids = list(order_ids)
        if self.tx.dialect == "postgresql":
            with self.tx.write() as conn:  # the locks go with its rollback
                free = {oid for oid, got in conn.execute(_TRY_LOCKS, {"ids": ids}) if got}
                rows = set(conn.scalars(_ROWS, {"ids": ids}))
        else:
            with sql_errors(), self.tx.engine.connect() as conn:
                if not _write_lock(conn):
                    return None
                rows = set(conn.scalars(_ROWS, {"ids": ids}))
                free = set(ids)
        return CreateFates([o for o in ids if o in rows], [o for o in ids if o in free - rows])


def _write_lock(conn: Any) -> bool:
    """``BEGIN IMMEDIATE`` waiting at most :data:`WRITE_LOCK_WAIT_MS`; False if it is held."""
    busy_ms = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
    conn.exec_driver_sql(f"PRAGMA busy_timeout = {WRITE_LOCK_WAIT_MS}")
    try:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    except OperationalError as exc:
        if "locked" not in str(exc.orig):
            raise
        return False
    finally:
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(busy_ms)}")
    return True
