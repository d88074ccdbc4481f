"""Incident pauses: ``oes_pauses``, and the shift of the unpaid orders' expiries at resume.

While a pause is open, the statements that close or remind by expiry find nothing
(:data:`orders.sql.models.NOT_PAUSED` is one of their conditions), on every host at once,
from the first statement that starts after the pause committed. A resume first fixes the
pause's end (``resumed_at_ms``), then moves each unpaid order's expiry (and its reminder
not yet sent) later by the time the pause took from it, in batches by order id: each batch
commits the orders, their ``extended`` events and the pause's cursor together, so a resume
cut short by a crash goes on from where it stopped, and no order is moved twice. The pause
closes once the last batch is done; the sweep holds until then.

The time an order lost is the part of the pause it lived through: the whole pause for an
order created before it, the time since its creation for one created during it. Orders due
before the pause began are not moved (the sweep was late, not the shopper), nor orders that
do not expire.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Connection, Row, bindparam, case, select, update
from sqlalchemy.exc import IntegrityError

from orders.domain import Actor, Clock, EventKind, ms_to_datetime
from orders.errors import InvalidInput
from orders.policies import NEVER_EXPIRES_MS
from orders.sql.models import orders_table, pauses_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.transactions import Transactions
from orders.sql.transitions import insert_events

ORDER = orders_table.c
PAUSE = pauses_table.c


@dataclass(frozen=True, slots=True)
class Pause:
    """One incident pause as the database held it."""

    id: int
    reason: str
    started_at_ms: int
    actor: Actor | None
    #: When a resume began (the pause's end); None while it lasts.
    resumed_at_ms: int | None
    #: Orders moved so far by the resume.
    shifted: int
    #: When the resume finished (the sweep runs again); None while open.
    ended_at_ms: int | None

    @property
    def started_at(self) -> datetime:
        return ms_to_datetime(self.started_at_ms)

    @property
    def is_open(self) -> bool:
        return self.ended_at_ms is None

    def length_ms(self, now_ms: int) -> int:
        """How long expiries are held: to the resume, or to ``now_ms`` while it lasts."""
        end = now_ms if self.resumed_at_ms is None else self.resumed_at_ms
        return max(0, end - self.started_at_ms)


def _to_pause(row: Row[Any]) -> Pause:
    return Pause(
        id=row.id,
        reason=row.reason,
        started_at_ms=row.started_at_ms,
        actor=Actor.from_columns(row.actor_kind, row.actor),
        resumed_at_ms=row.resumed_at_ms,
        shifted=row.shifted,
        ended_at_ms=row.ended_at_ms,
    )


_OPEN = select(pauses_table).where(PAUSE.open_marker.is_not(None))
_STARTED = bindparam("started_at_ms", type_=BigInteger)
_RESUMED = bindparam("resumed_at_ms", type_=BigInteger)
#: The time an order lost to the pause (module docstring).
_LOST = case(
    (ORDER.created_at_ms > _STARTED, _RESUMED - ORDER.created_at_ms),
    else_=_RESUMED - _STARTED,
)
_TO_SHIFT = (
    select(ORDER.id)
    .where(
        UNPAID_PREDICATE,
        ORDER.id > bindparam("cursor"),
        ORDER.created_at_ms < _RESUMED,
        ORDER.expires_at_ms > _STARTED,
        ORDER.expires_at_ms < NEVER_EXPIRES_MS,
    )
    .order_by(ORDER.id)
    .limit(bindparam("size"))
)


class Pauses:
    """Pauses over one engine; each method opens and commits its own transaction."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def current(self) -> Pause | None:
        """The open pause (resuming included), if any."""
        with self.tx.read() as conn:
            row = conn.execute(_OPEN).one_or_none()
        return None if row is None else _to_pause(row)

    def recent(self, limit: int = 10) -> list[Pause]:
        """The latest pauses, newest first."""
        query = select(pauses_table).order_by(PAUSE.id.desc()).limit(limit)
        with self.tx.read() as conn:
            return [_to_pause(row) for row in conn.execute(query)]

    def start(self, reason: str, clock: Clock, actor: Actor) -> Pause:
        """Open a pause (:class:`InvalidInput` while one is open); its start is read once it
        has committed, when it takes hold: a close committed before it is before its start."""
        values = {"reason": reason, "started_at_ms": clock(), "open_marker": True, "shifted": 0}
        values.update(actor.columns())
        with self.tx.write() as conn:
            _refuse_if_open(conn)
            try:
                pause_id = conn.execute(
                    pauses_table.insert().values(values).returning(PAUSE.id)
                ).scalar_one()
            except IntegrityError:  # another pause committed between the read and here
                raise InvalidInput("pause", "a pause is open already") from None
            conn.commit()
        with self.tx.write() as conn:
            row = conn.execute(
                update(pauses_table)
                .where(PAUSE.id == pause_id)
                .values(started_at_ms=clock())
                .returning(*pauses_table.c)
            ).one()
            conn.commit()
        return _to_pause(row)

    def begin_resume(self, now_ms: int, actor: Actor) -> Pause:
        """Fix the open pause's end at ``now_ms`` (a resume already begun keeps its own);
        :class:`InvalidInput` when nothing is paused."""
        with self.tx.write() as conn:
            row = conn.execute(_OPEN).one_or_none()
            if row is None:
                raise InvalidInput("resume", "nothing is paused")
            if row.resumed_at_ms is None:
                conn.execute(
                    update(pauses_table)
                    .where(PAUSE.id == row.id)
                    .values(
                        resumed_at_ms=now_ms,
                        resumed_actor_kind=actor.kind.value,
                        resumed_actor=actor.name,
                    )
                )
            row = conn.execute(select(pauses_table).where(PAUSE.id == row.id)).one()
            conn.commit()
        return _to_pause(row)

    def shift_batch(
        self, pause: Pause, now_ms: int, size: int, actor: Actor
    ) -> list[tuple[str, str, int]] | None:
        """Move the next ``size`` orders of the resume (one transaction): their ids, users
        and new expiries, or None when none was left (the resume is done)."""
        resumed_at_ms = pause.resumed_at_ms
        if resumed_at_ms is None:
            raise InvalidInput("resume", "the pause has no end yet (begin_resume first)")
        params = {"started_at_ms": pause.started_at_ms, "resumed_at_ms": resumed_at_ms}
        with self.tx.write() as conn:
            cursor = conn.execute(
                select(PAUSE.shift_cursor).where(PAUSE.id == pause.id)
            ).scalar_one()
            ids = list(
                conn.execute(_TO_SHIFT, {**params, "cursor": cursor or "", "size": size}).scalars()
            )
            if not ids:
                return None
            moved = conn.execute(
                update(orders_table)
                .where(ORDER.id.in_(ids), UNPAID_PREDICATE)
                .values(
                    expires_at_ms=ORDER.expires_at_ms + _LOST,
                    remind_at_ms=ORDER.remind_at_ms + _LOST,
                    updated_at_ms=now_ms,
                )
                .returning(ORDER.id, ORDER.user_id, ORDER.expires_at_ms, _LOST.label("lost")),
                params,
            ).all()
            events = [
                (row.id, row.user_id, {"trigger": "resume", "pause_id": pause.id, "extra_ms": lost})
                for row in moved
                for lost in [int(row.lost)]
            ]
            insert_events(conn, events, EventKind.EXTENDED, now_ms, actor)
            conn.execute(
                update(pauses_table)
                .where(PAUSE.id == pause.id)
                # The last id in the database's own order (its collation, not Python's).
                .values(shift_cursor=ids[-1], shifted=PAUSE.shifted + len(moved))
            )
            conn.commit()
        return [(row.id, row.user_id, row.expires_at_ms) for row in moved]

    def no_longer_unpaid(self, order_ids: list[str]) -> list[tuple[str, str]]:
        """(user id, order id) of the orders given that are no longer unpaid."""
        query = select(ORDER.user_id, ORDER.id).where(ORDER.id.in_(order_ids), ~UNPAID_PREDICATE)
        with self.tx.read() as conn:
            return [(row.user_id, row.id) for row in conn.execute(query)]

    def finish(self, pause: Pause, now_ms: int) -> Pause:
        """Close the pause: the sweep runs again."""
        with self.tx.write() as conn:
            conn.execute(
                update(pauses_table)
                .where(PAUSE.id == pause.id)
                .values(open_marker=None, ended_at_ms=now_ms)
            )
            row = conn.execute(select(pauses_table).where(PAUSE.id == pause.id)).one()
            conn.commit()
        return _to_pause(row)


def _refuse_if_open(conn: Connection) -> None:
    row = conn.execute(_OPEN).one_or_none()
    if row is not None:
        since = ms_to_datetime(row.started_at_ms).isoformat(timespec="seconds")
        who = "" if row.actor_kind is None else f" by {row.actor_kind}:{row.actor}"
        raise InvalidInput("pause", f"a pause is open already (since {since}{who})")
