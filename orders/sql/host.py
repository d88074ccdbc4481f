"""The host's transaction: writing in a caller's Connection or Session, and following its end.

A host passes ``connection=`` to a use case so that the order is written in its own
transaction (beside its cart, its payment intent) and commits or rolls back with it.
:func:`host_connection` checks what it passed, before anything is written, and returns the
Connection to write on; :func:`follow` runs a step (the Redis follow-up) when that
transaction, or the savepoint the write ran in, ends.

How the end is heard: through SQLAlchemy's public ConnectionEvents (``commit``,
``rollback``, ``savepoint``, ``rollback_savepoint``, ``release_savepoint``), listened for
once per engine. What a transaction waits for is an entry in :data:`FOLLOWERS` (keyed by its
Connection, weakly) that the event which ends it takes out: nothing is left behind on a
long-lived connection, and nothing grows with the number of transactions. (A listener
cannot be removed while its own event is being dispatched: SQLAlchemy then raises "deque
mutated during iteration"; so the listeners are per engine and the entries per transaction.)

``commit`` is the only commit event Core has, and SQLAlchemy sends it just before the
database's COMMIT: a step on commit runs then. Should that COMMIT fail (or the process die
before it), the step has run for a transaction that did not commit; the callers' steps are
chosen so that this only leaves Redis under-counting, which the SQL slot guard and
reconcile put right (see ``orders.service``).

Savepoints are a stack: a savepoint begun after a write cannot undo it; rolling back one
that was already open when the write ran undoes it; releasing it hands the write to the
enclosing level.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy.exc import UnboundExecutionError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from sqlalchemy.orm import Session

from orders import metrics
from orders.errors import InvalidInput
from orders.sql.engine import sqlite_file
from orders.sql.failures import sql_errors

log = logging.getLogger(__name__)

#: The default port of each backend whose URLs may leave it out.
DEFAULT_PORTS = {"postgresql": 5432}


def host_connection(given: object, engine: Engine) -> Connection:
    """The Connection of the host's transaction that ``given`` (a Connection or a Session)
    names, autobegun if need be; :class:`InvalidInput` when it cannot be one of ``engine``'s
    database, before anything is written."""
    if isinstance(given, AsyncConnection | AsyncSession):
        raise InvalidInput(
            "connection",
            f"an {type(given).__name__} is for orders.aio.AsyncOrderService; "
            "pass a Connection or Session here",
        )
    if isinstance(given, Engine | AsyncEngine):
        raise InvalidInput(
            "connection", "an Engine, not a Connection or Session (pass engine.connect())"
        )
    if isinstance(given, Session):
        try:
            bind = given.get_bind()
        except UnboundExecutionError:
            raise InvalidInput("connection", "the Session is bound to no engine") from None
        check_same_database(bind.engine, engine)
        if isinstance(bind, Connection):
            check_open(bind)
        with sql_errors():
            conn = given.connection()
    elif isinstance(given, Connection):
        check_open(given)
        check_same_database(given.engine, engine)
        conn = given
    else:
        raise InvalidInput(
            "connection", f"a SQLAlchemy Connection or Session, not {type(given).__name__}"
        )
    if conn.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        raise InvalidInput("connection", "is in autocommit: there is no transaction to join")
    return conn


def check_open(conn: Connection) -> None:
    if conn.closed or conn.invalidated:
        raise InvalidInput("connection", "is closed")


def describe(engine: Engine) -> str:
    """Which database an engine reaches, without user or password."""
    url = engine.url
    backend = url.get_backend_name()
    if backend == "sqlite":
        return f"sqlite {sqlite_file(engine) or 'in memory'}"
    host = url.host or url.query.get("host") or "localhost"
    port = url.port or DEFAULT_PORTS.get(backend)
    return f"{backend} {host}:{port}/{url.database}"


def check_same_database(theirs: Engine, ours: Engine) -> None:
    """The host's engine must reach the service's database: the same backend, and the same
    host, port and database (for SQLite, the same file; a memory database only through the
    service's own engine)."""
    if theirs is ours:
        return
    if theirs.url.get_backend_name() == "sqlite" and sqlite_file(theirs) is None:
        same = False
    else:
        same = describe(theirs) == describe(ours)
    if not same:
        raise InvalidInput(
            "connection",
            f"is to another database ({describe(theirs)}) than the service's ({describe(ours)})",
        )


@dataclass
class Step:
    """What one write does when its host's transaction ends; ``level``: how many savepoints,
    begun after the transaction's first step, enclosed it."""

    level: int
    on_commit: Callable[[], None] | None
    on_rollback: Callable[[], None] | None


@dataclass
class Follower:
    """The steps of one transaction of a Connection, and its savepoints since the first."""

    depth: int = 0
    steps: list[Step] = field(default_factory=list)

    def savepoint_ended(self, *, rolled_back: bool) -> list[Step]:
        """The innermost savepoint ended; the steps it undid (rolled back), if any."""
        if self.depth == 0:  # one that was open before the first step: it encloses all
            undone, self.steps = (self.steps, []) if rolled_back else ([], self.steps)
            return undone
        inner = [step for step in self.steps if step.level >= self.depth]
        if rolled_back:
            self.steps = [step for step in self.steps if step.level < self.depth]
        else:
            for step in inner:
                step.level = self.depth - 1
            inner = []
        self.depth -= 1
        return inner


#: The transactions with steps waiting for their end, by Connection.
FOLLOWERS: weakref.WeakKeyDictionary[Connection, Follower] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_LISTENED: weakref.WeakSet[Engine] = weakref.WeakSet()


def follow(
    conn: Connection,
    *,
    on_commit: Callable[[], None] | None = None,
    on_rollback: Callable[[], None] | None = None,
) -> None:
    """Run ``on_commit`` when ``conn``'s transaction commits, or ``on_rollback`` when it, or
    a savepoint that was open at this call, rolls back. Each runs at most once; an error it
    raises is logged and counted, never raised into the host's commit or rollback."""
    listen(conn.engine)
    with _LOCK:
        follower = FOLLOWERS.setdefault(conn, Follower())
        follower.steps.append(Step(follower.depth, on_commit, on_rollback))


def pending(conn: Connection) -> int:
    """How many steps wait for ``conn``'s transaction to end."""
    with _LOCK:
        follower = FOLLOWERS.get(conn)
        return 0 if follower is None else len(follower.steps)


def listen(engine: Engine) -> None:
    """The five listeners, once per engine (see the module docstring)."""
    with _LOCK:
        if engine in _LISTENED:
            return
        _LISTENED.add(engine)
    event.listen(engine, "commit", _committed)
    event.listen(engine, "rollback", _rolled_back)
    event.listen(engine, "savepoint", _savepoint)
    event.listen(engine, "rollback_savepoint", _savepoint_rolled_back)
    event.listen(engine, "release_savepoint", _savepoint_released)


def _run(steps: list[Step], committed: bool) -> None:
    for step in steps:
        action = step.on_commit if committed else step.on_rollback
        if action is None:
            continue
        try:
            action()
        except Exception:
            # Never into the host's commit: the step is a follow-up that reconcile repeats.
            metrics.STORE_ERRORS.labels("redis").inc()
            log.exception("the follow-up of a host's transaction failed; reconcile will fix it")


def _ended(conn: Connection, committed: bool) -> None:
    with _LOCK:
        follower = FOLLOWERS.pop(conn, None)
    if follower is not None:
        _run(follower.steps, committed)


def _committed(conn: Connection) -> None:
    _ended(conn, committed=True)


def _rolled_back(conn: Connection) -> None:
    _ended(conn, committed=False)


def _savepoint(conn: Connection, _name: Any) -> None:
    with _LOCK:
        follower = FOLLOWERS.get(conn)
        if follower is not None:
            follower.depth += 1


def _savepoint_ended(conn: Connection, rolled_back: bool) -> None:
    with _LOCK:
        follower = FOLLOWERS.get(conn)
        if follower is None:
            return
        undone = follower.savepoint_ended(rolled_back=rolled_back)
        if not follower.steps:
            del FOLLOWERS[conn]
    _run(undone, committed=False)


def _savepoint_rolled_back(conn: Connection, _name: Any, _context: Any) -> None:
    _savepoint_ended(conn, rolled_back=True)


def _savepoint_released(conn: Connection, _name: Any, _context: Any) -> None:
    _savepoint_ended(conn, rolled_back=False)
