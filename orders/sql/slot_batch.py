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

On PostgreSQL the statements go to the driver at once (psycopg's ``executemany`` with
``returning``, in pipeline mode: one round trip for all), compiled once: run one by one
through SQLAlchemy, each cost about half a millisecond of the leader's time, most of a
batch's. They still run one after the other in the transaction, so a second order of one
user sees the first's slot taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection

from orders.domain import Actor, EventKind
from orders.sql.slots import CREATE_COLUMNS, insert_or_skip
from orders.sql.transactions import Transactions
from orders.sql.transitions import record_events


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """One admitted create for the shared transaction."""

    values: Mapping[str, Any]
    limit: int
    actor: Actor
    #: The caller's trace context, for its event (:func:`orders.tracing.event_context`).
    event_data: dict[str, str] | None


class SlotBatch:
    """Inserts admitted creates in one transaction (module docstring)."""

    def __init__(self, tx: Transactions, *, pipelined: bool = True) -> None:
        """``pipelined``: on PostgreSQL with psycopg, send the statements at once (False:
        one by one through SQLAlchemy, as with any other driver)."""
        self.tx = tx
        self._insert = insert_or_skip(tx.dialect)
        self._event_in_statement = tx.dialect == "postgresql"
        self._pipelined = pipelined and self._event_in_statement and tx.engine.driver == "psycopg"
        if self._pipelined:
            dialect = tx.engine.dialect
            compiled = self._insert.compile(dialect=dialect)
            self._compiled = compiled
            self._sql = str(compiled)
            self._processors: dict[str, Callable[[Any], Any] | None] = {
                key: bind.type.dialect_impl(dialect).bind_processor(dialect)
                for key, bind in compiled.binds.items()
            }

    def insert_all(self, requests: Sequence[SlotRequest]) -> dict[str, Mapping[str, Any]]:
        """Insert each order with its event where a slot is free, and commit once; the rows
        inserted, by order id (an order missing was not inserted). Raises when the
        transaction failed (then it may or may not have committed: a commit cut off is not
        known to have failed)."""
        ordered = sorted(requests, key=lambda r: (r.values["user_id"], r.values["id"]))
        with self.tx.write() as conn:
            if self._pipelined:
                inserted = self._pipeline(conn, ordered)
            else:
                inserted = {}
                for request in ordered:
                    row = self._one(conn, request)
                    if row is not None:
                        inserted[row["id"]] = row
            conn.commit()
        return inserted

    def _params(self, request: SlotRequest) -> dict[str, Any]:
        params = {name: request.values[name] for name in CREATE_COLUMNS}
        params["slot_limit"] = request.limit
        params["event_data"] = request.event_data
        params.update(request.actor.columns())
        return params

    def _one(self, conn: Connection, request: SlotRequest) -> Mapping[str, Any] | None:
        """One insert in the caller's transaction, then (SQLite) its event."""
        row = conn.execute(self._insert, self._params(request)).mappings().one_or_none()
        if row is None or self._event_in_statement:
            return None if row is None else dict(row)
        record_events(
            conn,
            [(row["id"], row["user_id"])],
            EventKind.CREATED,
            request.values["created_at_ms"],
            request.event_data,
            request.actor,
        )
        return dict(row)

    def _pipeline(
        self, conn: Connection, ordered: Sequence[SlotRequest]
    ) -> dict[str, Mapping[str, Any]]:
        """PostgreSQL: every statement in one pipelined round trip (module docstring)."""
        conn.begin()  # ours: the commit below ends it
        batches = []
        for request in ordered:
            raw = self._compiled.construct_params(self._params(request))
            batches.append(
                {
                    key: value if (process := self._processors.get(key)) is None else process(value)
                    for key, value in raw.items()
                }
            )
        inserted: dict[str, Mapping[str, Any]] = {}
        driver: Any = conn.connection.driver_connection
        with driver.cursor() as cursor:
            cursor.executemany(self._sql, batches, returning=True)
            while True:
                names = [column.name for column in cursor.description or ()]
                for values in cursor.fetchall():
                    row = dict(zip(names, values, strict=True))
                    inserted[row["id"]] = row
                if not cursor.nextset():
                    break
        return inserted
