"""What an operator asks of event consumers, and does to their parked events.

Functions over an Engine (``orders events`` runs them): :func:`list_consumers` (position,
lag, retrying and parked counts), :func:`parked_counts` (the scheduler's gauge),
:func:`list_parked`, and :func:`act_on_parked` with the two actions on a parked event,
after Sidekiq's dead set: requeue (retrying again, attempts reset, due now) and discard
(the entry goes; the event stays in order_events).
A consumer is known once it has saved a position or recorded a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Engine,
    Select,
    and_,
    delete,
    exists,
    func,
    select,
    union,
    update,
)

from orders.domain import Actor, ActorKind, Clock, EventKind, system_clock
from orders.errors import InvalidInput
from orders.events.retries import CC, PARKED, RC, RETRYING, check_consumer_name
from orders.events.stream import EC, EventPosition, commit_order, events_after
from orders.sql.failures import sql_errors
from orders.sql.models import events_table, retries_table
from orders.sql.transitions import record_events
from orders.validation import check_count, check_row_id

#: Who requeues or discards when the caller does not say: an operator, unnamed.
OPERATOR = Actor(ActorKind.OPERATOR)


@dataclass(frozen=True, slots=True)
class ConsumerStatus:
    name: str
    position: EventPosition
    #: Committed events after the position (including those its ``kinds`` pass by).
    lag_events: int
    #: How long the first of them has waited (its ``at_ms`` to now); None with no lag.
    oldest_unread_age_ms: int | None
    retrying: int
    parked: int
    #: The count stopped at ``list_consumers``' ``lag_cap``: the lag is at least that.
    lag_capped: bool = False


@dataclass(frozen=True, slots=True)
class ParkedEvent:
    consumer: str
    event_id: int
    #: None when the event is gone (its order was deleted).
    order_id: str | None
    kind: str | None
    attempts: int
    last_error: str | None
    parked_at_ms: int


def list_consumers(
    engine: Engine, *, clock: Clock | None = None, lag_cap: int | None = None
) -> list[ConsumerStatus]:
    """Every known consumer, by name, with its lag and its retrying and parked counts.

    ``lag_cap`` stops counting a consumer's lag there (``lag_capped`` says so): the count
    costs the lag, so a page refreshed every few seconds caps it; None counts it all.
    """
    if lag_cap is not None:
        check_count("lag_cap", lag_cap, 1)
    now_ms = (clock or system_clock)()
    names = union(select(CC.name.label("name")), select(RC.consumer.label("name")))
    counts = _failure_counts()
    with sql_errors(), engine.connect() as conn:
        positions = {
            row.name: EventPosition(row.txid, row.event_id)
            for row in conn.execute(select(CC.name, CC.txid, CC.event_id))
        }
        failures = {row.consumer: (row.retrying, row.parked) for row in conn.execute(counts)}
        found = []
        for name in sorted(conn.execute(names).scalars()):
            position = positions.get(name, EventPosition())
            lag, oldest_at_ms = _lag(conn, engine, position, lag_cap)
            retrying, parked = failures.get(name, (0, 0))
            found.append(
                ConsumerStatus(
                    name=name,
                    position=position,
                    lag_events=lag,
                    lag_capped=lag_cap is not None and lag >= lag_cap,
                    oldest_unread_age_ms=None if oldest_at_ms is None else now_ms - oldest_at_ms,
                    retrying=retrying,
                    parked=parked,
                )
            )
    return found


def parked_counts(engine: Engine) -> dict[str, int]:
    """Parked events per consumer, for every consumer with an event retrying or parked
    (one grouped query; a consumer missing here has none)."""
    with sql_errors(), engine.connect() as conn:
        return {row.consumer: row.parked for row in conn.execute(_failure_counts())}


def _failure_counts() -> Select[Any]:
    """Each consumer's retrying and parked counts, grouped in one pass over the entries."""
    return select(
        RC.consumer,
        func.count().filter(RETRYING).label("retrying"),
        func.count().filter(PARKED).label("parked"),
    ).group_by(RC.consumer)


def lag_statements(
    engine: Engine, position: EventPosition, cap: int | None = None
) -> tuple[Select[Any], Select[Any]]:
    """How many events are after ``position`` (at most ``cap``), and the ``at_ms`` of the
    first of them.

    Both are range scans of an index (order_events' (txid, id) on PostgreSQL, its key on
    SQLite), so they cost the lag, not the table; with a cap, at most ``cap`` entries.
    """
    after = events_after(engine, position)
    in_order = commit_order(engine)
    if cap is None:
        count = select(func.count()).select_from(events_table).where(after)
    else:
        counted = select(EC.id).where(after).order_by(*in_order).limit(cap).subquery()
        count = select(func.count()).select_from(counted)
    first = select(EC.at_ms).where(after).order_by(*in_order).limit(1)
    return count, first


def _lag(
    conn: Connection, engine: Engine, position: EventPosition, cap: int | None
) -> tuple[int, int | None]:
    count, first = lag_statements(engine, position, cap)
    return int(conn.scalar(count) or 0), conn.scalar(first)


def list_parked(
    engine: Engine, *, consumer: str | None = None, limit: int = 100
) -> list[ParkedEvent]:
    """Parked events, oldest parked first; of one consumer when ``consumer`` is given."""
    check_count("limit", limit, 1, 10_000)
    query = (
        select(retries_table, EC.order_id, EC.kind)
        .outerjoin(events_table, EC.id == RC.event_id)
        .where(PARKED)
        .order_by(RC.parked_at_ms, RC.consumer, RC.event_id)
        .limit(limit)
    )
    if consumer is not None:
        query = query.where(RC.consumer == check_consumer_name("consumer", consumer))
    with sql_errors(), engine.connect() as conn:
        if consumer is not None and not _known(conn, consumer):
            raise InvalidInput("consumer", "no consumer with that name")
        return [
            ParkedEvent(
                consumer=row.consumer,
                event_id=row.event_id,
                order_id=row.order_id,
                kind=row.kind,
                attempts=row.attempts,
                last_error=row.last_error,
                parked_at_ms=row.parked_at_ms,
            )
            for row in conn.execute(query)
        ]


class ParkedAction(StrEnum):
    """What an operator does to a parked event (``orders events requeue | discard``)."""

    REQUEUE = "requeue"
    DISCARD = "discard"


def act_on_parked(
    engine: Engine,
    action: ParkedAction,
    consumer: str,
    event_id: int,
    *,
    clock: Clock | None = None,
    actor: Actor = OPERATOR,
) -> None:
    """Requeue a parked event (retrying again: attempts from 0, due now, so the consumer's
    next run tries it and parks it again only after ``max_attempts`` more failures), or
    discard it (this consumer forgets it; the event itself stays in order_events).

    A ``requeued`` or ``discarded`` event of the parked event's order records who did it,
    in the same transaction (none when that event is gone with its order: there is no
    order left to record it on)."""
    now_ms = (clock or system_clock)()
    entry = _parked_entry(consumer, event_id)
    statement: Any
    if action == ParkedAction.REQUEUE:
        kind = EventKind.REQUEUED
        statement = update(retries_table).where(entry)
        statement = statement.values(parked_at_ms=None, attempts=0, next_at_ms=now_ms)
    elif action == ParkedAction.DISCARD:
        kind, statement = EventKind.DISCARDED, delete(retries_table).where(entry)
    else:
        raise InvalidInput("action", "must be requeue or discard")
    with sql_errors(), engine.begin() as conn:
        if conn.execute(statement).rowcount == 0:
            _refuse(conn, consumer, event_id)
        of_event = select(EC.order_id, EC.user_id).where(EC.id == event_id)
        parked = conn.execute(of_event).one_or_none()
        if parked is not None:
            data = {"consumer": consumer, "event_id": event_id}
            record_events(conn, [(parked.order_id, parked.user_id)], kind, now_ms, data, actor)


def _parked_entry(consumer: str, event_id: int) -> ColumnElement[bool]:
    check_consumer_name("consumer", consumer)
    check_row_id("event_id", event_id)
    return and_(RC.consumer == consumer, RC.event_id == event_id, PARKED)


def _known(conn: Connection, consumer: str) -> bool:
    return bool(
        conn.scalar(
            select(exists().where(CC.name == consumer) | exists().where(RC.consumer == consumer))
        )
    )


def _refuse(conn: Connection, consumer: str, event_id: int) -> None:
    """Say why (consumer, event_id) is not a parked entry; nothing was written."""
    if not _known(conn, consumer):
        raise InvalidInput("consumer", "no consumer with that name")
    retrying = select(exists().where(RC.consumer == consumer, RC.event_id == event_id))
    if conn.scalar(retrying):
        raise InvalidInput("event_id", "is retrying, not parked")
    raise InvalidInput("event_id", "no parked event with that id for this consumer")
