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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row

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

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx
        self._insert = insert_or_skip(tx.dialect)
        self._event_in_statement = tx.dialect == "postgresql"

    def insert_all(self, requests: Sequence[SlotRequest]) -> dict[str, Row[Any]]:
        """Insert each order with its event where a slot is free, and commit once; the rows
        inserted, by order id (an order missing was not inserted). Raises
        :class:`~orders.errors.StoreUnavailable` when the transaction failed (then it may or
        may not have committed: a commit cut off is not known to have failed)."""
        inserted: dict[str, Row[Any]] = {}
        ordered = sorted(requests, key=lambda r: (r.values["user_id"], r.values["id"]))
        with self.tx.write() as conn:
            for request in ordered:
                params = {name: request.values[name] for name in CREATE_COLUMNS}
                params["slot_limit"] = request.limit
                if self._event_in_statement:
                    params["event_data"] = request.event_data
                    params.update(request.actor.columns())
                row = conn.execute(self._insert, params).one_or_none()
                if row is None:
                    continue
                inserted[row.id] = row
                if not self._event_in_statement:
                    record_events(
                        conn,
                        [(row.id, row.user_id)],
                        EventKind.CREATED,
                        request.values["created_at_ms"],
                        request.event_data,
                        request.actor,
                    )
            conn.commit()
        return inserted
