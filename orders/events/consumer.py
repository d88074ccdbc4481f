"""Consuming order_events: every transition, in commit order, at least once per consumer
(exactly once for a handler that writes only to this database, with ``transactional=True``).

Each transition writes an ``order_events`` row in the transaction that makes it (an
outbox), so an event exists exactly when its transition committed. :func:`read_events`
reads them after a :class:`EventPosition`; an :class:`EventConsumer` keeps a durable,
named position and calls a handler for each event:

* the position is saved after each handled event, so a consumer that dies resumes where it
  stopped: nothing is skipped, and at most the event in hand is delivered again;
* a handler that raises does not hold the stream up: the event goes to ``event_retries``
  and is tried again after an exponential backoff with full jitter, while later events
  carry on;
* after ``max_attempts`` tries in all the event is *parked*: kept with its attempt count
  and last error, logged once at WARNING, and not tried again until an operator requeues
  it (:mod:`orders.events.admin`, ``orders events``). The vocabulary follows Oban
  (retryable / discarded, ``max_attempts``) and Sidekiq (retry set / dead set);
* with ``transactional=True`` the handler writes on the consumer's own Connection, in the
  transaction that moves the cursor (or deletes the retry row): a handled event's writes
  and its outcome commit together, so a crash neither skips nor repeats them.

The events come in commit order from :mod:`orders.events.stream`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, cast, overload

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

from orders import tracing
from orders.domain import Clock, EventKind, system_clock
from orders.errors import InvalidInput
from orders.events.stream import (
    EC,
    EventPosition,
    OrderEvent,
    event_of,
    read_events,
)
from orders.sql.models import (
    TEXT_COLUMN_LENGTH,
    cursors_table,
    events_table,
    retries_table,
    sql_errors,
)
from orders.sql.transactions import Transactions
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


#: The handler of an :class:`EventConsumer`: called with each event, outside any transaction
#: of the consumer's.
Handler = Callable[[OrderEvent], None]
#: The handler of an ``EventConsumer(..., transactional=True)``: called with each event and
#: the consumer's Connection, inside the transaction that records the event's outcome.
TransactionalHandler = Callable[[OrderEvent, Connection], None]


def check_consumer_name(field_name: str, name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 64 or not name.isprintable():
        raise InvalidInput(field_name, "must be 1 to 64 printable characters")
    return name


@dataclass
class ConsumeResult:
    handled: int = 0
    failed: int = 0
    retried_ok: int = 0
    #: Events that used up their attempts in this run and were parked.
    parked: int = 0


def error_text(exc: BaseException) -> str:
    """``Type: first line of the message``, cut to fit ``event_retries.last_error``."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text[:TEXT_COLUMN_LENGTH]


class EventConsumer:
    """A named, durable reader of order_events that calls ``handler`` for each event.

    ``kinds`` limits the events handed over (the others are passed by). After the n-th
    failure of an event the next try is due after a delay drawn uniformly ("full jitter")
    from 0 to ``backoff_s * 2**(n-1)``, at most ``max_backoff_s``, so many consumers failing
    at once do not retry in step; ``rand`` is the random source (``random.random``).
    An event that failed ``max_attempts`` times is parked.

    By default the handler is called as ``handler(event)`` between the consumer's own
    transactions: at least once. One instance per name at a time is meant (the scheduler
    runs it as a single job); a second one racing it only causes duplicates.

    ``transactional=True``: exactly once for writes to this database. The handler is called
    as ``handler(event, conn)`` inside a savepoint of the one transaction that also advances
    the cursor (or, for a retried event, deletes its retry row) and records a failure: its
    writes on ``conn`` commit together with the event's outcome, or not at all. A handler
    that raises has its writes rolled back with the savepoint; the failure is recorded as
    in the default mode. The handler must not commit, roll back or close ``conn``. The
    transaction holds the consumer's cursor row locked (on SQLite, the database's write
    lock) from before the position is read until it commits, so instances of one name
    running at once never hand an event over twice: on PostgreSQL an instance that finds
    the cursor (or a retry row) locked leaves it to the holder and ends its run; on SQLite
    it waits. Keep such handlers short: on SQLite every writer waits while one runs.
    """

    @overload
    def __init__(
        self,
        engine: Engine,
        name: str,
        handler: Handler,
        *,
        transactional: Literal[False] = False,
        kinds: Iterable[EventKind] | None = None,
        clock: Clock | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        max_attempts: int = 10,
        rand: Random | None = None,
    ) -> None: ...

    @overload
    def __init__(
        self,
        engine: Engine,
        name: str,
        handler: TransactionalHandler,
        *,
        transactional: Literal[True],
        kinds: Iterable[EventKind] | None = None,
        clock: Clock | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        max_attempts: int = 10,
        rand: Random | None = None,
    ) -> None: ...

    def __init__(
        self,
        engine: Engine,
        name: str,
        handler: Handler | TransactionalHandler,
        *,
        transactional: bool = False,
        kinds: Iterable[EventKind] | None = None,
        clock: Clock | None = None,
        backoff_s: float = 1.0,
        max_backoff_s: float = 300.0,
        max_attempts: int = 10,
        rand: Random | None = None,
    ) -> None:
        check_consumer_name("name", name)
        if not isinstance(transactional, bool):
            raise InvalidInput("transactional", "must be True or False")
        self.max_attempts = check_count("max_attempts", max_attempts, 1, 1000)
        self.rand = rand or random.random
        self.engine = engine
        self.name = name
        self.handler = handler
        self.transactional = transactional
        self.transactions = Transactions(engine)
        self.kinds = None if kinds is None else frozenset(EventKind(k) for k in kinds)
        self.clock = clock or system_clock
        self.base_backoff_ms = round(backoff_s * 1000)
        self.max_backoff_ms = round(max_backoff_s * 1000)

    def position(self) -> EventPosition:
        with sql_errors(), self.engine.connect() as conn:
            found = conn.execute(self._cursor_query()).one_or_none()
        return EventPosition() if found is None else EventPosition(found.txid, found.event_id)

    def _cursor_query(self) -> Select[tuple[int, int]]:
        return select(CC.txid, CC.event_id).where(CC.name == self.name)

    def run_once(self, limit: int = 100) -> ConsumeResult:
        """Retry what is due, then handle up to ``limit`` new events."""
        result = ConsumeResult()
        if self.transactional:
            self._run_in_transactions(limit, result)
            return result
        for event_id, attempts, event in self._due_retries(limit):
            self._retry(event_id, attempts, event, result)
        for event in read_events(self.engine, self.position(), limit):
            if self._wanted(event):
                error = self._call(event)
                if error is None:
                    result.handled += 1
                else:
                    result.failed += 1
            else:
                error = None
            with sql_errors(), self.engine.begin() as conn:
                parked = error is not None and self._fail(conn, event.id, 1, error)
                self._save_position(conn, event.position)
            self._count_parked(parked, event.id, 1, result)
        return result

    def _wanted(self, event: OrderEvent) -> bool:
        return self.kinds is None or event.kind in self.kinds

    def _call(self, event: OrderEvent) -> str | None:
        try:
            with self._span(event):
                cast(Handler, self.handler)(event)  # the overloads pair it with the mode
        except Exception as exc:  # a handler is someone else's code; its failure is data
            return self._failed(event, exc)
        return None

    def _span(self, event: OrderEvent) -> Any:  # a context manager (orders.tracing)
        """The trace span of one handler call, linked to the create's trace if the event
        carries it (:mod:`orders.tracing`; nothing without a tracer provider)."""
        return tracing.consumer_span(
            "orders.consume_event",
            event.data,
            consumer=self.name,
            event_kind=event.kind.value,
            order_id=event.order_id,
            user_id=event.user_id,
        )

    def _failed(self, event: OrderEvent, exc: Exception) -> str:
        log.warning(
            "event handler %s failed on event %d (order %s): %s",
            self.name,
            event.id,
            event.order_id,
            type(exc).__name__,
        )
        return error_text(exc)

    def _due_retries(self, limit: int) -> list[tuple[int, int, OrderEvent | None]]:
        """The retrying events due now: (event id, failed tries, the event if it still exists)."""
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

    def _retry(
        self, event_id: int, attempts: int, event: OrderEvent | None, result: ConsumeResult
    ) -> None:
        error = None if event is None else self._call(event)
        parked = False
        with sql_errors(), self.engine.begin() as conn:
            if error is None:
                self._forget_retry(conn, event_id)
                result.retried_ok += event is not None
            else:
                result.failed += 1
                parked = self._fail(conn, event_id, attempts + 1, error)
        self._count_parked(parked, event_id, attempts + 1, result)

    def _forget_retry(self, conn: Connection, event_id: int) -> int:
        """Delete the event's retry row; the rows deleted."""
        statement = delete(retries_table).where(RC.consumer == self.name, RC.event_id == event_id)
        return conn.execute(statement).rowcount

    # --- transactional=True ---------------------------------------------------------------

    def _run_in_transactions(self, limit: int, result: ConsumeResult) -> None:
        """One transaction per handed-over event (retried or new); events of other kinds
        are passed by together, in the transaction of the next event handed over or in one
        at the end."""
        for event_id, _attempts, event in self._due_retries(limit):
            self._retry_in_transaction(event_id, event, result)
        with sql_errors(), self.engine.connect() as conn:
            found = conn.execute(self._cursor_query()).one_or_none()
        if found is None:
            self._create_cursor()
        start = EventPosition() if found is None else EventPosition(found.txid, found.event_id)
        passed: EventPosition | None = None
        for event in read_events(self.engine, start, limit):
            if not self._wanted(event):
                passed = event.position
                continue
            passed = None
            if not self._handle_in_transaction(event, result):
                return  # a twin holds the cursor: it carries on from here
        if passed is not None:
            with sql_errors(), self.engine.begin() as conn:
                self._save_position(conn, passed)

    def _create_cursor(self) -> None:
        """The cursor row at the start, so that there is a row to lock; a twin's row wins."""
        values = {"txid": 0, "event_id": 0, "updated_at_ms": self.clock()}
        with sql_errors(), self.engine.begin() as conn:
            upsert(conn, cursors_table, {"name": self.name}, values, only_if=lambda new: false())

    def _locked(self, query: Select[Any], conn: Connection) -> Any:
        """The row of ``query``, locked until ``conn`` commits; None if there is none or
        (PostgreSQL) a twin holds it. On SQLite ``conn`` holds the write lock already."""
        if conn.dialect.name == "postgresql":
            query = query.with_for_update(skip_locked=True)
        return conn.execute(query).one_or_none()

    def _handle_in_transaction(self, event: OrderEvent, result: ConsumeResult) -> bool:
        """Hand ``event`` over and advance the cursor past it, in one transaction; False if
        a twin holds the cursor. An event the cursor has passed meanwhile (a twin handled
        it) is left alone."""
        with self.transactions.write(queue=False) as conn:
            found = self._locked(self._cursor_query(), conn)
            if found is None:
                return False
            if EventPosition(found.txid, found.event_id) >= event.position:
                return True
            error = self._call_in(conn, event)
            parked = error is not None and self._fail(conn, event.id, 1, error)
            self._save_position(conn, event.position)
            conn.commit()
        if error is None:
            result.handled += 1
        else:
            result.failed += 1
        self._count_parked(parked, event.id, 1, result)
        return True

    def _retry_in_transaction(
        self, event_id: int, event: OrderEvent | None, result: ConsumeResult
    ) -> None:
        """Try a due event again: its retry row deleted (on success) or updated (on
        failure) in the transaction the handler writes in. A row a twin holds, or has
        retried, deleted or parked meanwhile, is left alone."""
        query = select(RC.attempts).where(
            RC.consumer == self.name,
            RC.event_id == event_id,
            RETRYING,
            RC.next_at_ms <= self.clock(),
        )
        with self.transactions.write(queue=False) as conn:
            found = self._locked(query, conn)
            if found is None:
                return
            attempts = found.attempts + 1
            error = None if event is None else self._call_in(conn, event)
            parked = False
            if error is not None:
                parked = self._fail(conn, event_id, attempts, error)
            elif self._forget_retry(conn, event_id) != 1:
                return  # not ours after all: the handler's writes roll back with the rest
            conn.commit()
        if error is not None:
            result.failed += 1
        else:
            result.retried_ok += event is not None
        self._count_parked(parked, event_id, attempts, result)

    def _call_in(self, conn: Connection, event: OrderEvent) -> str | None:
        """Call the handler in a savepoint of ``conn``'s transaction: its writes stay if it
        returns, and are rolled back (the error text returned) if it raises."""
        handler = cast(TransactionalHandler, self.handler)  # the overloads pair it with the mode
        savepoint = conn.begin_nested()
        try:
            with self._span(event):
                handler(event, conn)
        except Exception as exc:  # a handler is someone else's code; its failure is data
            error: str | None = self._failed(event, exc)
        else:
            error = None
        if not savepoint.is_active and not conn.invalidated:
            # Its writes may have committed without the event's outcome: say so, loudly.
            raise InvalidInput(
                "handler",
                f"of consumer {self.name} ended the consumer's transaction on event "
                f"{event.id}; it may write on the connection, never commit, roll back or "
                "close it",
            )
        if error is None:
            savepoint.commit()
        else:
            savepoint.rollback()
        return error

    def backoff_ms(self, attempts: int) -> int:
        """The delay before the next try after ``attempts`` failures: full jitter."""
        ceiling_ms = min(self.max_backoff_ms, self.base_backoff_ms << min(attempts - 1, 62))
        return round(ceiling_ms * min(max(self.rand(), 0.0), 1.0))

    def _fail(self, conn: Connection, event_id: int, attempts: int, error: str) -> bool:
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

    def _count_parked(
        self, parked: bool, event_id: int, attempts: int, result: ConsumeResult
    ) -> None:
        # Logged after the commit, once: a parked row is never tried (nor parked) again.
        if parked:
            result.parked += 1
            log.warning(
                "event consumer %s parked event %d after %d attempts; see `orders events parked`",
                self.name,
                event_id,
                attempts,
            )

    def _save_position(self, conn: Connection, position: EventPosition) -> None:
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

    def pending_retries(self) -> int:
        """Events of this consumer still being retried (parked ones not counted)."""
        query = select(func.count()).where(RC.consumer == self.name, RETRYING)
        with sql_errors(), self.engine.connect() as conn:
            return int(conn.scalar(query) or 0)
