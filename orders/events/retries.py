"""An event consumer's book in SQL: its saved position, and its events being retried or parked.

A consumer of a name owns one row of ``event_cursors`` (the position it has handled up to)
and the rows of ``event_retries`` for its events that failed: each with its failed tries,
when the next try is due, the last error, and, once ``max_attempts`` tries have failed,
when it was parked. :class:`ConsumerBook` reads and writes these rows for
:class:`~orders.events.consumer.EventConsumer`, in either of its modes: a write that takes a
``conn`` joins the caller's transaction, so in the transactional mode it commits together
with the handler's writes. Every write is guarded against a twin (another instance of the
same name): the cursor only moves forward, and a parked row is never overwritten.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Select,
    delete,
    false,
    func,
    select,
    tuple_,
)

from orders.domain import Clock
from orders.errors import InvalidInput
from orders.events.stream import EC, EventPosition, OrderEvent, event_of
from orders.sql.base import TEXT_COLUMN_LENGTH
from orders.sql.failures import sql_errors
from orders.sql.models import cursors_table, events_table, retries_table
from orders.sql.upserts import upsert
from orders.validation import check_count

log = logging.getLogger("orders.events")  # the package's name: consumers configure it

RC = retries_table.c
CC = cursors_table.c
#: The rows of event_retries still being retried; the others are parked.
RETRYING = RC.parked_at_ms.is_(None)
PARKED = RC.parked_at_ms.is_not(None)
#: A source of uniform floats in [0, 1), like random.random; tests pass their own.
Random = Callable[[], float]
#: A due retry: (event id, failed tries so far, the event if it still exists).
DueRetry = tuple[int, int, OrderEvent | None]


def check_consumer_name(field_name: str, name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not name.isprintable():
        raise InvalidInput(field_name, "must be 1 to 64 printable characters")
    return name


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to fit ``event_retries.last_error``."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:TEXT_COLUMN_LENGTH]


def locked(query: Select[Any], conn: Connection) -> Any:
    """The row of ``query``, locked until ``conn`` commits; None if there is none or
    (PostgreSQL) a twin holds it. On SQLite ``conn`` holds the write lock already."""
    if conn.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    return conn.execute(query).one_or_none()


class ConsumerBook:
    """The cursor row and the retry rows of the consumer ``name`` (see the module docstring).

    After the n-th failure of an event its next try is due after a delay drawn uniformly
    ("full jitter") from 0 to ``backoff_s * 2**(n-1)``, at most ``max_backoff_s``, so many
    consumers failing at once do not retry in step; ``rand`` is the random source. The
    ``max_attempts``-th failure parks the event.
    """

    def __init__(
        self,
        engine: Engine,
        name: str,
        *,
        clock: Clock,
        backoff_s: float,
        max_backoff_s: float,
        max_attempts: int,
        rand: Random,
    ) -> None:
        self.engine = engine
        self.name = check_consumer_name("name", name)
        self.clock = clock
        self.max_attempts = check_count("max_attempts", max_attempts, 1, 1000)
        self.base_backoff_ms = round(backoff_s * 1000)
        self.max_backoff_ms = round(max_backoff_s * 1000)
        self.rand = rand

    # --- the position ----------------------------------------------------------------------

    def cursor_query(self) -> Select[tuple[int, int]]:
        return select(CC.txid, CC.event_id).where(CC.name == self.name)

    def saved_position(self) -> EventPosition | None:
        """The saved position; None before the consumer's row exists."""
        with sql_errors(), self.engine.connect() as conn:
            found = conn.execute(self.cursor_query()).one_or_none()
        return None if found is None else EventPosition(found.txid, found.event_id)

    def position(self) -> EventPosition:
        """The saved position (the start, before anything was saved)."""
        saved = self.saved_position()
        return EventPosition() if saved is None else saved

    def register(self, start: Callable[[], EventPosition]) -> EventPosition:
        """The saved position; first, when there is none, ``start()`` saved as it (a twin's
        row, saved meanwhile, wins)."""
        saved = self.saved_position()
        if saved is not None:
            return saved
        at = start()
        values = {"txid": at.txid, "event_id": at.event_id, "updated_at_ms": self.clock()}
        with sql_errors(), self.engine.begin() as conn:
            upsert(conn, cursors_table, {"name": self.name}, values, only_if=lambda new: false())
        return self.position()

    def locked_position(self, conn: Connection) -> EventPosition | None:
        """The saved position, its row locked until ``conn`` commits; None if a twin holds
        it (PostgreSQL) or there is no row yet."""
        found = locked(self.cursor_query(), conn)
        return None if found is None else EventPosition(found.txid, found.event_id)

    def save_position(self, conn: Connection, position: EventPosition) -> None:
        values = {
            "txid": position.txid,
            "event_id": position.event_id,
            "updated_at_ms": self.clock(),
        }

        # Forward only: a second consumer of this name that is behind cannot move it back
        # (everything up to the saved position was handled by the one that saved it).
        def ahead(new: Any) -> ColumnElement[bool]:
            return tuple_(new.txid, new.event_id) > tuple_(CC.txid, CC.event_id)

        upsert(conn, cursors_table, {"name": self.name}, values, only_if=ahead)

    # --- retries ---------------------------------------------------------------------------

    def due(self, limit: int) -> list[DueRetry]:
        """The retrying events due now, the earliest first."""
        query = (
            select(RC.event_id, RC.attempts)
            .where(RC.consumer == self.name, RETRYING, RC.next_at_ms <= self.clock())
            .order_by(RC.next_at_ms)
            .limit(limit)
        )
        with sql_errors(), self.engine.connect() as conn:
            due = conn.execute(query).all()
            ids = [row.event_id for row in due]
            events = {
                row.id: event_of(row)
                for row in conn.execute(select(events_table).where(EC.id.in_(ids)))
            }
        return [(event_id, attempts, events.get(event_id)) for event_id, attempts in due]

    def locked_attempts(self, conn: Connection, event_id: int) -> int | None:
        """The failed tries of a retry still due, its row locked until ``conn`` commits;
        None if a twin holds it (PostgreSQL), or has retried, deleted or parked it."""
        query = select(RC.attempts).where(
            RC.consumer == self.name,
            RC.event_id == event_id,
            RETRYING,
            RC.next_at_ms <= self.clock(),
        )
        found = locked(query, conn)
        return None if found is None else int(found.attempts)

    def forget(self, conn: Connection, event_id: int) -> int:
        """Delete the event's retry row; the rows deleted."""
        statement = delete(retries_table).where(RC.consumer == self.name, RC.event_id == event_id)
        return conn.execute(statement).rowcount

    def backoff_ms(self, attempts: int) -> int:
        """The delay before the next try after ``attempts`` failures: full jitter."""
        ceiling_ms = min(self.max_backoff_ms, self.base_backoff_ms << min(attempts - 1, 62))
        return round(ceiling_ms * min(max(self.rand(), 0.0), 1.0))

    def fail(self, conn: Connection, event_id: int, attempts: int, error: str) -> bool:
        """Record the failed try: retry it later, or park it. True if this parked it."""
        now_ms = self.clock()
        park = attempts >= self.max_attempts
        values = {
            "attempts": attempts,
            "next_at_ms": now_ms if park else now_ms + self.backoff_ms(attempts),
            "last_error": error,
            "parked_at_ms": now_ms if park else None,
        }
        # A row already parked (by a twin of this consumer) stays as it is.
        key = {"consumer": self.name, "event_id": event_id}
        written = upsert(conn, retries_table, key, values, only_if=lambda new: RETRYING)
        return park and written == 1

    def log_parked(self, event_id: int, attempts: int) -> None:
        """Said once, after the commit that parked it: a parked row is never tried (nor
        parked) again."""
        log.warning(
            "event consumer %s parked event %d after %d attempts; see `orders events parked`",
            self.name,
            event_id,
            attempts,
        )

    def pending(self) -> int:
        """Events still being retried (parked ones not counted)."""
        query = select(func.count()).where(RC.consumer == self.name, RETRYING)
        with sql_errors(), self.engine.connect() as conn:
            return int(conn.scalar(query) or 0)
