"""Consuming order_events: every transition, in commit order, at least once per consumer
(exactly once for a handler that writes only to this database, with ``transactional=True``).

Each transition writes an ``order_events`` row in the transaction that makes it (an
outbox), so an event exists exactly when its transition committed. :func:`read_events`
reads them after a :class:`EventPosition`; an :class:`EventConsumer` keeps a durable,
named position and calls a handler for each event:

* a new name starts after the newest event (``start="now"``, the default) or before the
  oldest one retention kept (``start="oldest"``), saved at its first run;
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
from typing import Any, Literal, TypedDict, Unpack, cast, overload

from sqlalchemy import Connection, Engine

from orders import tracing
from orders.domain import Clock, EventKind, system_clock
from orders.errors import InvalidInput
from orders.events.retries import ConsumerBook, Random, error_text
from orders.events.stream import EventPosition, OrderEvent, newest_position, read_events
from orders.sql.failures import sql_errors
from orders.sql.transactions import Transactions

log = logging.getLogger("orders.events")  # the package's name: consumers configure it

#: Where a consumer of a new name starts: after the newest event, or at the oldest kept one.
Start = Literal["now", "oldest"]
#: The handler of an :class:`EventConsumer`: called with each event, outside any transaction
#: of the consumer's.
Handler = Callable[[OrderEvent], None]
#: The handler of an ``EventConsumer(..., transactional=True)``: called with each event and
#: the consumer's Connection, inside the transaction that records the event's outcome.
TransactionalHandler = Callable[[OrderEvent, Connection], None]


class ConsumerOptions(TypedDict, total=False):
    """The keyword options of :class:`EventConsumer`, in either mode (its defaults there)."""

    kinds: Iterable[EventKind] | None
    clock: Clock | None
    backoff_s: float
    max_backoff_s: float
    max_attempts: int
    rand: Random | None
    start: Start


@dataclass
class ConsumeResult:
    handled: int = 0
    failed: int = 0
    retried_ok: int = 0
    #: Events that used up their attempts in this run and were parked.
    parked: int = 0

    def count(self, error: str | None, *, retried: bool = False) -> None:
        """One handed-over event's outcome."""
        if error is not None:
            self.failed += 1
        elif retried:
            self.retried_ok += 1
        else:
            self.handled += 1


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
        **options: Unpack[ConsumerOptions],
    ) -> None: ...

    @overload
    def __init__(
        self,
        engine: Engine,
        name: str,
        handler: TransactionalHandler,
        *,
        transactional: Literal[True],
        **options: Unpack[ConsumerOptions],
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
        start: Start = "now",
    ) -> None:
        self.book = ConsumerBook(
            engine,
            name,
            clock=clock or system_clock,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            max_attempts=max_attempts,
            rand=rand or random.random,
        )
        if not isinstance(transactional, bool):
            raise InvalidInput("transactional", "must be True or False")
        if start not in ("now", "oldest"):
            raise InvalidInput("start", "must be now or oldest")
        self.start = start
        self.engine = engine
        self.name = name
        self.handler = handler
        self.transactional = transactional
        self.transactions = Transactions(engine)
        self.kinds = None if kinds is None else frozenset(EventKind(k) for k in kinds)

    def position(self) -> EventPosition:
        """The position saved so far: every event up to it was handled (or is retried)."""
        return self.book.position()

    def register(self) -> EventPosition:
        """The saved position; for a new name (no position saved yet), its start saved
        first: after the newest event (``start="now"``: it is handed what commits from
        now on) or before the oldest one kept (``"oldest"``). Each run calls it."""
        if self.start == "oldest":
            return self.book.register(EventPosition)
        return self.book.register(lambda: newest_position(self.engine))

    def pending_retries(self) -> int:
        """Events of this consumer still being retried (parked ones not counted)."""
        return self.book.pending()

    def backoff_ms(self, attempts: int) -> int:
        """The delay before the next try after ``attempts`` failures: full jitter."""
        return self.book.backoff_ms(attempts)

    def run_once(self, limit: int = 100) -> ConsumeResult:
        """Retry what is due, then handle up to ``limit`` new events."""
        result = ConsumeResult()
        if self.transactional:
            self._run_in_transactions(limit, result)
            return result
        for event_id, attempts, event in self.book.due(limit):
            self._retry(event_id, attempts, event, result)
        for event in read_events(self.engine, self.register(), limit):
            error = None
            if self._wanted(event):
                error = self._call(event)
                result.count(error)
            with sql_errors(), self.engine.begin() as conn:
                parked = error is not None and self.book.fail(conn, event.id, 1, error)
                self.book.save_position(conn, event.position)
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

    def _retry(
        self, event_id: int, attempts: int, event: OrderEvent | None, result: ConsumeResult
    ) -> None:
        error = None if event is None else self._call(event)
        parked = False
        with sql_errors(), self.engine.begin() as conn:
            if error is None:
                self.book.forget(conn, event_id)
            else:
                parked = self.book.fail(conn, event_id, attempts + 1, error)
        if event is not None or error is not None:
            result.count(error, retried=True)
        self._count_parked(parked, event_id, attempts + 1, result)

    # --- transactional=True ---------------------------------------------------------------

    def _run_in_transactions(self, limit: int, result: ConsumeResult) -> None:
        """One transaction per handed-over event (retried or new); events of other kinds
        are passed by together, in the transaction of the next event handed over or in one
        at the end."""
        for event_id, _attempts, event in self.book.due(limit):
            self._retry_in_transaction(event_id, event, result)
        passed: EventPosition | None = None
        for event in read_events(self.engine, self.register(), limit):
            if not self._wanted(event):
                passed = event.position
                continue
            passed = None
            if not self._handle_in_transaction(event, result):
                return  # a twin holds the cursor: it carries on from here
        if passed is not None:
            with sql_errors(), self.engine.begin() as conn:
                self.book.save_position(conn, passed)

    def _handle_in_transaction(self, event: OrderEvent, result: ConsumeResult) -> bool:
        """Hand ``event`` over and advance the cursor past it, in one transaction; False if
        a twin holds the cursor. An event the cursor has passed meanwhile (a twin handled
        it) is left alone."""
        with self.transactions.write(queue=False) as conn:
            found = self.book.locked_position(conn)
            if found is None:
                return False
            if found >= event.position:
                return True
            error = self._call_in(conn, event)
            parked = error is not None and self.book.fail(conn, event.id, 1, error)
            self.book.save_position(conn, event.position)
            conn.commit()
        result.count(error)
        self._count_parked(parked, event.id, 1, result)
        return True

    def _retry_in_transaction(
        self, event_id: int, event: OrderEvent | None, result: ConsumeResult
    ) -> None:
        """Try a due event again: its retry row deleted (on success) or updated (on
        failure) in the transaction the handler writes in. A row a twin holds, or has
        retried, deleted or parked meanwhile, is left alone."""
        with self.transactions.write(queue=False) as conn:
            failed_before = self.book.locked_attempts(conn, event_id)
            if failed_before is None:
                return
            attempts = failed_before + 1
            error = None if event is None else self._call_in(conn, event)
            parked = False
            if error is not None:
                parked = self.book.fail(conn, event_id, attempts, error)
            elif self.book.forget(conn, event_id) != 1:
                return  # not ours after all: the handler's writes roll back with the rest
            conn.commit()
        if event is not None or error is not None:
            result.count(error, retried=True)
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

    def _count_parked(
        self, parked: bool, event_id: int, attempts: int, result: ConsumeResult
    ) -> None:
        if parked:
            result.parked += 1
            self.book.log_parked(event_id, attempts)
