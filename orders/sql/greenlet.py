"""Waiting on the event loop from synchronous code that runs in SQLAlchemy's greenlet bridge.

An ``AsyncEngine`` runs its synchronous core in a greenlet (:mod:`orders.aio` runs the whole
use case there); where that code would block, :func:`wait_for` hands an awaitable to the
loop instead. It lives with SQL because the SQL layer needs it too: a SQLite writer of an
``AsyncEngine`` must queue on a :class:`LoopLock` (:mod:`orders.sql.transactions`), not on a
thread lock that would stop the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import util as sa_util

T = TypeVar("T")

# SQLAlchemy 2.1 names it await_, 2.0 await_only (kept in 2.1 as a deprecated alias).
_await: Callable[[Awaitable[Any]], Any] = getattr(sa_util, "await_", None) or sa_util.await_only


def wait_for(awaitable: Awaitable[T]) -> T:
    """In the greenlet bridge: hand ``awaitable`` to the event loop, resume with its result."""
    result: T = _await(awaitable)
    return result


class LoopLock:
    """A lock for code in the greenlet bridge: waiting for it yields to the event loop.

    A ``threading.Lock`` would stop the loop itself while another task holds it.
    """

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    def __enter__(self) -> None:
        wait_for(self._lock.acquire())

    def __exit__(self, *_exc: object) -> None:
        self._lock.release()
