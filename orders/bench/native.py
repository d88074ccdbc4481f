"""The native floor of the ``aio`` figure: what a create on ``redis.asyncio`` and
SQLAlchemy's ``AsyncEngine`` costs at the least, with nothing of the service in between.

One ``EVALSHA`` of the index's own admission script (loaded by the workload, keys named by
the index, arguments by :func:`orders.index.unpaid.admit_args`) through a ``redis.asyncio``
client, then the order row and its ``created`` event written atomically through an
``AsyncEngine`` on the async driver of the configured database (psycopg's async side,
aiosqlite), built by :func:`orders.bootstrap.build_async_engine` with the service's pool
settings. No validation, no compensation, no metrics, no SQL guard (no free slot is
sought): an upper bound for a native ``orders.aio``, never a candidate's own figure.

The write is the service's own shape, or less: on PostgreSQL one autocommitted statement
that inserts the order and, from the row it returns, its event
(:func:`orders.sql.transitions.with_events`, as the service's create does, one round trip
and one commit); elsewhere the two INSERTs in one transaction. On SQLite the writers queue
on a lock of their own first, as the threaded floors' do
(:func:`orders.bench.driver.writer_queue`): aiosqlite's busy handler would sleep instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio
from sqlalchemy import BigInteger, bindparam, insert, literal, null

from orders.bootstrap import build_async_engine
from orders.config import Settings
from orders.domain import APPLICATION, EventKind
from orders.sql.models import events_table, orders_table
from orders.sql.transitions import with_events

_INSERT_ORDER = insert(orders_table)
_INSERT_EVENT = insert(events_table)
#: The order's columns the floor writes (the others keep their defaults).
COLUMNS = ("id", "user_id", "status", "created_at_ms", "expires_at_ms", "updated_at_ms")


def insert_with_event() -> Any:
    """PostgreSQL: the order row (:data:`COLUMNS`, bound by name) and its ``created`` event
    at ``created_at_ms``, in one statement."""
    created_at = bindparam("created_at_ms", type_=BigInteger)
    values = {name: created_at if name == "created_at_ms" else bindparam(name) for name in COLUMNS}
    order = insert(orders_table).values(values).returning(orders_table.c.id, orders_table.c.user_id)
    actor = (literal(APPLICATION.kind.value), null())
    return with_events(order, "created", EventKind.CREATED, created_at, actor=actor)


def redis_url(settings: Settings) -> str:
    """The configured Redis server's URL, else the embedded server's (started if gone)."""
    if settings.redis_url is not None:
        return settings.redis_url.reveal()
    from orders.embedded.server import ensure_redis  # noqa: PLC0415

    return ensure_redis(settings.home).url


class NativeStores:
    """A ``redis.asyncio`` client and an ``AsyncEngine`` on the bench's stores.

    Built off the loop (nothing connects until the first call); :meth:`aclose` on the loop
    that used them.
    """

    def __init__(self, settings: Settings) -> None:
        self.engine = build_async_engine(settings)
        self.client = redis.asyncio.Redis.from_url(
            redis_url(settings),
            socket_timeout=settings.redis_socket_timeout_s,
            socket_connect_timeout=settings.redis_socket_timeout_s,
        )
        dialect = self.engine.dialect.name
        self.writer: contextlib.AbstractAsyncContextManager[object] = (
            asyncio.Lock() if dialect == "sqlite" else contextlib.nullcontext()
        )
        self.in_one_statement = dialect == "postgresql"
        self._one_statement = insert_with_event()
        self._autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")

    async def evalsha(self, sha: str, keys: Sequence[str], args: Sequence[str | int]) -> Any:
        """One EVALSHA of a loaded script; its raw reply."""
        return await self.client.evalsha(sha, len(keys), *keys, *args)

    async def insert(self, order: Mapping[str, Any], event: Mapping[str, Any]) -> None:
        """The order row (:data:`COLUMNS`) and its event, committed together."""
        if self.in_one_statement:
            async with self._autocommit.connect() as conn:
                await conn.execute(self._one_statement, dict(order))
            return
        async with self.writer, self.engine.begin() as conn:
            await conn.execute(_INSERT_ORDER, dict(order))
            await conn.execute(_INSERT_EVENT, dict(event))

    async def aclose(self) -> None:
        try:
            await self.client.aclose()
        finally:
            await self.engine.dispose()
