"""The raw driver of the floors: DBAPI cursors, SQL text in the driver's own paramstyle.

A floor is what the durable work costs the driver alone, so nothing of SQLAlchemy runs per
operation: the driver checks DBAPI connections out of the engine's pool as it first needs
them (so they have the engine's connect-time settings: WAL, foreign keys, timeouts), at
most ``connections`` of them, and holds them for the whole run; an operation takes an idle
one from its own stack (a thread waits there when all are busy, as the service's callers
wait on its pool), runs ``cursor.execute`` of each statement, then ``commit``. No pool
check-out, no pre-ping, no statement compilation, no result processing.

SQLite takes one writer at a time, and its busy handler sleeps (1, 2, 5, 10 ms ...) before
it retries: threads of one process that leave the queueing to it wait far longer than the
lock is held. So on SQLite the floors' writers queue on a lock in the process first, as
the service's do (:mod:`orders.sql.transactions`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

from sqlalchemy import Engine
from sqlalchemy.engine.interfaces import DBAPIConnection

from orders.domain import EventKind, OrderStatus
from orders.sql.base import UNPAID_SQL
from orders.sql.models import events_table, orders_table

#: A positional placeholder per DBAPI paramstyle (PEP 249) of the drivers the project ships.
_PLACEHOLDERS = {"qmark": "?", "format": "%s", "pyformat": "%s"}


class RawDriver:
    """The floors' statements on one engine's DBAPI driver, on at most ``connections`` held
    connections (give it the threads' count, capped at what the service's pool may open)."""

    def __init__(self, engine: Engine, connections: int = 1) -> None:
        self.engine = engine
        self.most = max(1, connections)
        style = getattr(engine.dialect.dbapi, "paramstyle", None)
        mark = _PLACEHOLDERS.get(str(style))
        if mark is None:
            raise RuntimeError(f"the bench's raw floors do not speak paramstyle {style!r}")
        # S608: the text is built from the schema's own constants, never from input.
        orders, events = orders_table.name, events_table.name

        def marks(n: int) -> str:
            return ", ".join([mark] * n)

        self.insert_order = (
            f"INSERT INTO {orders} (id, user_id, status, created_at_ms, expires_at_ms, "  # noqa: S608
            f"updated_at_ms) VALUES ({marks(6)})"
        )
        self.insert_event = (
            f"INSERT INTO {events} (order_id, user_id, kind, at_ms) VALUES ({marks(4)})"  # noqa: S608
        )
        # The compare-and-set of each transition, as the service's: by id, while unpaid.
        self.updates = {
            EventKind.PAID: (
                f"UPDATE {orders} SET status = {mark}, paid_at_ms = {mark}, "  # noqa: S608
                f"updated_at_ms = {mark} WHERE id = {mark} AND {UNPAID_SQL}"
            ),
            EventKind.CANCELLED: (
                f"UPDATE {orders} SET status = {mark}, closed_at_ms = {mark}, "  # noqa: S608
                f"close_reason = 'cancelled', updated_at_ms = {mark} "
                f"WHERE id = {mark} AND {UNPAID_SQL}"
            ),
        }
        self._status = {
            EventKind.PAID: OrderStatus.PAID,
            EventKind.CANCELLED: OrderStatus.CANCELLED,
        }
        self._idle: queue.LifoQueue[DBAPIConnection] = queue.LifoQueue()
        self._held: list[DBAPIConnection] = []
        self._guard = threading.Lock()
        self.writer = writer_queue(engine)

    @contextlib.contextmanager
    def connection(self) -> Iterator[DBAPIConnection]:
        """An idle held connection; a new one from the pool while fewer than ``most`` are
        held; else the next one given back."""
        try:
            conn = self._idle.get_nowait()
        except queue.Empty:
            with self._guard:
                fresh = len(self._held) < self.most
                if fresh:
                    conn = self.engine.raw_connection()
                    self._held.append(conn)
            if not fresh:
                conn = self._idle.get()
        try:
            yield conn
        finally:
            self._idle.put(conn)

    def release(self) -> None:
        """Return every held connection to the pool (after a run; uncommitted work rolls back)."""
        with self._guard:
            held, self._held = self._held, []
            self._idle = queue.LifoQueue()
        for conn in held:
            conn.close()

    def create(self, order_id: str, user_id: str, now_ms: int, expires_at_ms: int) -> None:
        """The minimal durable record of a create: the order row and its ``created`` event."""
        with self.connection() as conn, self.writer, contextlib.closing(conn.cursor()) as cursor:
            cursor.execute(
                self.insert_order,
                (order_id, user_id, OrderStatus.UNPAID.value, now_ms, expires_at_ms, now_ms),
            )
            cursor.execute(self.insert_event, (order_id, user_id, EventKind.CREATED.value, now_ms))
            conn.commit()

    def transition(self, kind: EventKind, order_id: str, user_id: str, now_ms: int) -> None:
        """``UPDATE ... WHERE id = ? AND status = 'unpaid'`` and, as it won, its event."""
        with self.connection() as conn, self.writer, contextlib.closing(conn.cursor()) as cursor:
            cursor.execute(self.updates[kind], (self._status[kind].value, now_ms, now_ms, order_id))
            if cursor.rowcount != 1:
                raise RuntimeError(f"the raw {kind.value} update found no unpaid {order_id}")
            cursor.execute(self.insert_event, (order_id, user_id, kind.value, now_ms))
            conn.commit()


def writer_queue(engine: Engine) -> contextlib.AbstractContextManager[object]:
    """What a floor's write transaction holds: on SQLite a lock of its own (one per call:
    each floor queues its own threads), elsewhere nothing."""
    if engine.dialect.name == "sqlite":
        return threading.Lock()
    return contextlib.nullcontext()
