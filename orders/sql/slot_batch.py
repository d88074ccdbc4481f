"""Many admitted creates inserted into free slots in one transaction: one commit for all.

Each order goes in by the same guarded insert as a create alone (:mod:`orders.sql.slots`):
the lowest free slot of its user, under the same partial unique index, so the limit holds
in SQL exactly as before. What differs is what an order that cannot go in does: the
statement inserts nothing for it (``ON CONFLICT DO NOTHING`` with no target on PostgreSQL,
``INSERT OR IGNORE`` on SQLite) instead of raising, so it never aborts the transaction the
others share. Such an order is simply left out; its caller goes on alone, by today's path
(which makes room, refuses with the holders, or finds the id taken).

The orders are inserted in (user, id) order: two batches of two processes then take the
slot index entries of their users in one order, and never wait for each other in a cycle.

Each order's ``created`` event is written in the same transaction (on PostgreSQL in its
statement), so the outbox rule holds: the events of one commit share its transaction id and
are read in event-id order (:mod:`orders.events.stream`).

The statements go straight to the driver, compiled once: through SQLAlchemy each cost
about half a millisecond of the leader's time on PostgreSQL, most of a batch's, and on
SQLite the insert and its event took 40 % of a combined create's CPU at 64 threads. On
PostgreSQL they go at once (psycopg's ``executemany`` with ``returning``, in pipeline
mode: one round trip for all); on SQLite one after the other on the sqlite3 cursor, the
events then in one ``executemany``. Either way they run one after the other in the
transaction, so a second order of one user sees the first's slot taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection

from orders.domain import EventKind, NewOrder
from orders.sql.models import orders_table
from orders.sql.slots import insert_in_free_slot, insert_params
from orders.sql.transactions import Transactions
from orders.sql.transitions import event_row, insert_event_rows, record_events


class SlotBatch:
    """Inserts admitted creates in one transaction (module docstring)."""

    def __init__(self, tx: Transactions, *, direct: bool = True) -> None:
        """``direct``: send the statements straight to the driver (module docstring) with
        psycopg or sqlite3 (False: one by one through SQLAlchemy, as with any other
        driver)."""
        self.tx = tx
        self._insert = insert_in_free_slot(tx.dialect, any_conflict=True)
        self._event_in_statement = tx.dialect == "postgresql"
        driver = tx.engine.driver
        self._pipelined = direct and self._event_in_statement and driver == "psycopg"
        self._direct = self._pipelined or (
            direct and tx.dialect == "sqlite" and driver == "pysqlite"
        )
        if self._direct:
            dialect = tx.engine.dialect
            compiled = self._insert.compile(dialect=dialect)
            self._compiled = compiled
            self._sql = str(compiled)
            #: sqlite3 takes its parameters in the statement's order (qmark style).
            self._positions = compiled.positiontup if compiled.positional else None
            self._processors: dict[str, Callable[[Any], Any] | None] = {
                key: bind.type.dialect_impl(dialect).bind_processor(dialect)
                for key, bind in compiled.binds.items()
            }
            #: What SQLAlchemy would make of each returned column (SQLite's JSON is text).
            self._results: dict[str, Callable[[Any], Any]] = {
                column.name: process
                for column in orders_table.c
                if (process := column.type.dialect_impl(dialect).result_processor(dialect, None))
            }

    def insert_all(self, creates: Sequence[NewOrder]) -> dict[str, Mapping[str, Any]]:
        """Insert each order with its event where a slot is free, and commit once; the rows
        inserted, by order id (an order missing was not inserted). Raises when the
        transaction failed (then it may or may not have committed: a commit cut off is not
        known to have failed)."""
        ordered = sorted(creates, key=lambda new: (new.user_id, new.id))
        with self.tx.write() as conn:
            if self._pipelined:
                inserted = self._pipeline(conn, ordered)
            elif self._direct:
                inserted = self._on_cursor(conn, ordered)
            else:
                inserted = {}
                for new in ordered:
                    row = self._one(conn, new)
                    if row is not None:
                        inserted[row["id"]] = row
            conn.commit()
        return inserted

    def _one(self, conn: Connection, new: NewOrder) -> Mapping[str, Any] | None:
        """One insert in the caller's transaction, then (SQLite) its event."""
        row = conn.execute(self._insert, insert_params(new)).mappings().one_or_none()
        if row is None or self._event_in_statement:
            return None if row is None else dict(row)
        created = [(row["id"], row["user_id"])]
        record_events(conn, created, EventKind.CREATED, new.created_at_ms, new.trace, new.actor)
        return dict(row)

    def _bound(self, new: NewOrder) -> dict[str, Any]:
        """The create's parameters as the driver takes them (SQLAlchemy's bind processing)."""
        raw = self._compiled.construct_params(insert_params(new))
        return {
            key: value if (process := self._processors.get(key)) is None else process(value)
            for key, value in raw.items()
        }

    def _on_cursor(
        self, conn: Connection, ordered: Sequence[NewOrder]
    ) -> dict[str, Mapping[str, Any]]:
        """SQLite: each insert on the driver's cursor in the transaction ``conn`` began,
        then the inserted orders' events in one ``executemany`` (module docstring)."""
        assert self._positions is not None  # sqlite3's qmark style
        inserted: dict[str, Mapping[str, Any]] = {}
        events: list[dict[str, Any]] = []
        cursor: Any = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            for new in ordered:
                bound = self._bound(new)
                cursor.execute(self._sql, [bound[name] for name in self._positions])
                values = cursor.fetchone()
                if values is None:  # no free slot, or the id is taken: left out
                    continue
                names = [column[0] for column in cursor.description]
                row = dict(zip(names, values, strict=True))
                for name, process in self._results.items():
                    row[name] = process(row[name])
                inserted[row["id"]] = row
                at_ms = new.created_at_ms
                kind = EventKind.CREATED
                events.append(
                    event_row(row["id"], row["user_id"], kind, at_ms, new.trace, new.actor)
                )
        finally:
            cursor.close()
        insert_event_rows(conn, events)
        return inserted

    def _pipeline(
        self, conn: Connection, ordered: Sequence[NewOrder]
    ) -> dict[str, Mapping[str, Any]]:
        """PostgreSQL: every statement in one pipelined round trip (module docstring)."""
        conn.begin()  # ours: the commit below ends it
        batches = [self._bound(new) for new in ordered]
        inserted: dict[str, Mapping[str, Any]] = {}
        driver: Any = conn.connection.driver_connection
        names: list[str] = []
        with driver.cursor() as cursor:
            cursor.executemany(self._sql, batches, returning=True)
            while True:
                for values in cursor.fetchall():
                    # Every result has the statement's columns: named once (psycopg builds
                    # the description's Column objects anew on each read).
                    names = names or [column.name for column in cursor.description or ()]
                    row = dict(zip(names, values, strict=True))
                    inserted[row["id"]] = row
                if not cursor.nextset():
                    break
        return inserted
