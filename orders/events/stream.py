"""The event stream: ``order_events`` read in commit order, after a position.

Each transition writes its event in the transaction that makes it (an outbox). On SQLite
one writer at a time means ids come in commit order; on PostgreSQL they do not (a
transaction may take an id and commit after a later one), so each event also records its
transaction id, and a reader only takes events of transactions older than every one still
running (``txid_snapshot_xmin``): no event can later appear behind a position passed.
:mod:`orders.events.consumer` keeps a named reader's position over this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import ColumnElement, Engine, func, select, true, tuple_

from orders.domain import Actor, EventKind
from orders.errors import InvalidInput
from orders.sql.failures import sql_errors
from orders.sql.models import events_table

EC = events_table.c


@dataclass(frozen=True, slots=True, order=True)
class EventPosition:
    """A place in the event stream: (transaction id, event id); (0, 0) is the start."""

    txid: int = 0
    event_id: int = 0


@dataclass(frozen=True, slots=True)
class OrderEvent:
    id: int
    order_id: str
    user_id: str
    kind: EventKind
    at_ms: int
    data: Mapping[str, Any] = field(default_factory=dict)
    txid: int | None = None
    #: Who caused it; None for events written before migration 0008.
    actor: Actor | None = None

    @property
    def position(self) -> EventPosition:
        return EventPosition(self.txid or 0, self.id)


def event_of(row: Any) -> OrderEvent:
    """An ``order_events`` row as an :class:`OrderEvent`."""
    return OrderEvent(
        id=row.id,
        order_id=row.order_id,
        user_id=row.user_id,
        kind=EventKind(row.kind),
        at_ms=row.at_ms,
        data=dict(row.data or {}),
        txid=row.txid,
        actor=Actor.from_columns(row.actor_kind, row.actor),
    )


def read_events(
    engine: Engine, after: EventPosition = EventPosition(), limit: int = 100
) -> list[OrderEvent]:
    """Up to ``limit`` committed events after ``after``, in commit order."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= 10_000:
        raise InvalidInput("limit", "must be an integer between 1 and 10000")
    if not isinstance(after, EventPosition) or not all(
        type(v) is int and 0 <= v < 2**63 for v in (after.txid, after.event_id)
    ):
        raise InvalidInput("after", "must be an EventPosition of two integers in 0 .. 2**63-1")
    query = select(events_table).where(events_after(engine, after), committed(engine))
    query = query.order_by(*commit_order(engine)).limit(limit)
    with sql_errors(), engine.connect() as conn:
        return [event_of(row) for row in conn.execute(query)]


def newest_position(engine: Engine) -> EventPosition:
    """The position of the newest event a reader can take now (the start when there is
    none): every event committed later comes after it."""
    newest = (c.desc() for c in commit_order(engine))
    query = select(EC.txid, EC.id).where(committed(engine)).order_by(*newest).limit(1)
    with sql_errors(), engine.connect() as conn:
        found = conn.execute(query).one_or_none()
    return EventPosition() if found is None else EventPosition(found.txid or 0, found.id)


def committed(engine: Engine) -> ColumnElement[bool]:
    """Events no running transaction can still commit one behind (PostgreSQL: of
    transactions older than every running one); on SQLite, every event."""
    if engine.dialect.name == "postgresql":
        return EC.txid < func.txid_snapshot_xmin(func.txid_current_snapshot())
    return true()


def events_after(engine: Engine, after: EventPosition) -> ColumnElement[bool]:
    """Events past ``after`` in commit order (served by ix_oes_order_events_txid_id, or the key)."""
    if engine.dialect.name == "postgresql":
        return tuple_(EC.txid, EC.id) > tuple_(after.txid, after.event_id)
    return EC.id > after.event_id


def commit_order(engine: Engine) -> tuple[Any, ...]:
    return (EC.txid, EC.id) if engine.dialect.name == "postgresql" else (EC.id,)
