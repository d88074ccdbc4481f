"""The SQL side of the unpaid limit: every unpaid order holds one of its user's slots.

A user's slots are numbered 1 to ``limit``; a partial unique index on ``(user_id, slot)``
over unpaid orders (migration 0006) makes two unpaid orders in one slot impossible. A
create inserts its order into the lowest free slot, so the insert is the guard: no lock,
no count, and the limit holds in SQL whatever Redis lost.

The fast path is one statement on PostgreSQL, run in autocommit (so one round trip and one
commit): find the free slot, insert the order (``ON CONFLICT DO NOTHING`` on the slot
index), and insert its ``created`` event from the inserted row, atomically. Two creates
racing for one slot: one inserts, the other inserts nothing and tries again. SQLite runs
the same insert and then the event in one ``BEGIN IMMEDIATE`` transaction, which already
serialises writers.

When no slot is free, :meth:`SlotGuard.make_room` looks at the holders in a transaction of
its own: a holder whose expiry has passed but which the sweep has not closed yet is closed
there and then (the same compare-and-set as the sweep's, with its ``closed`` event) and the
insert is tried again; if every slot is held by a live order, SQL refuses
(:class:`LimitReachedInSql`, with the holders, from which the caller repairs the index).

A user's own limit (``oes_user_limits``) replaces the caller's inside the same statement.
Slots are numbers, not a count, so a lowered limit needs one more rule to stay exact: while
an unpaid order of the user holds a slot above the effective limit, no slot is free (the
slots at or below it may be free while more than the limit are held). A user left over a
lowered limit is therefore refused until every order above it has left (paid, cancelled,
or closed), even once fewer than the limit remain: never one too many, at the cost of
refusing early for at most the life of those orders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Connection,
    Integer,
    String,
    bindparam,
    exists,
    func,
    insert,
    literal_column,
    select,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import IntegrityError

from orders.domain import APPLICATION, EventKind, NewOrder, OrderStatus
from orders.sql.direct import PerDialect
from orders.sql.holds import take
from orders.sql.inflight import in_flight_lock
from orders.sql.models import events_table, orders_table, user_limits_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.transactions import Transactions
from orders.sql.transitions import CLOSE_ALL_EXPIRED, Changed, record_events, with_events
from orders.validation import amount_to_text

ORDER = orders_table.c

#: Event data of a close that a create made to take the slot of an expired order.
SLOT_REUSE = {"trigger": "slot_reuse"}


def order_row(new: NewOrder) -> dict[str, Any]:
    """The orders row a create writes, but its slot: the one place it is built."""
    return {
        "id": new.id,
        "user_id": new.user_id,
        "status": OrderStatus.UNPAID.value,
        "amount": amount_to_text(new.amount),
        "currency": new.currency,
        "created_at_ms": new.created_at_ms,
        "expires_at_ms": new.expires_at_ms,
        "updated_at_ms": new.created_at_ms,
        "metadata": new.metadata or None,
        "remind_at_ms": new.remind_at_ms,
        "policy": new.policy,
        "holds": {rid: list(h) if isinstance(h, tuple) else h for rid, h in new.asked().items()}
        or None,
    }


#: The columns a create writes, each from a bind parameter of its own name.
CREATE_COLUMNS = tuple(order_row(NewOrder("", "", 0, 0, 0, APPLICATION)))


def insert_params(new: NewOrder) -> dict[str, Any]:
    """The free-slot insert's parameters: the row, the limit, and its event's data and actor
    (which only PostgreSQL's one statement reads)."""
    return {
        **order_row(new),
        "slot_limit": new.limit,
        "event_data": new.trace,
        **new.actor.columns(),
    }


class InsertConflict(Exception):
    """The database refused a create's insert (a duplicate id, or another constraint)."""


class LimitReachedInSql(Exception):
    """Every slot of the user is held by a live order (the caller turns this into
    :class:`~orders.errors.UnpaidOrderLimitReached`); ``holders`` maps their ids to their
    expiries, what the user's index should hold. ``limit``: the effective limit;
    ``own_limit``: the user's own (None: the caller's applied), what the index should hold
    of it."""

    def __init__(self, holders: Mapping[str, int], limit: int, own_limit: int | None) -> None:
        super().__init__(len(holders))
        self.holders = dict(holders)
        self.open_count = len(holders)
        self.earliest_ms = min(holders.values(), default=None)
        self.limit = limit
        self.own_limit = own_limit


def own_limit_of(user: Any) -> Any:
    """SELECT the user's own limit (no row: none)."""
    return select(user_limits_table.c.unpaid_limit).where(user_limits_table.c.user_id == user)


def effective_limit(user: Any) -> Any:
    """The user's own limit if one is set, else ``:slot_limit`` (an SQL expression)."""
    return func.coalesce(
        own_limit_of(user).scalar_subquery(), bindparam("slot_limit", type_=Integer)
    )


def _free_slot() -> Any:
    """The lowest slot from 1 to the effective limit that no unpaid order of ``:user_id``
    holds; none while one holds a slot above that limit (see the module docstring).

    The candidates are 1 and each held slot + 1: the lowest free slot is one of them, so
    the query reads only the user's few index entries, for any limit.
    """
    held = orders_table.alias("held")
    holder = orders_table.alias("holder")
    above = orders_table.alias("above")
    user = bindparam("user_id", type_=String)
    # The status as a literal in the SQL, never a parameter: only then may the planner use
    # the partial index over unpaid orders (it must prove the predicate at plan time).
    unpaid: ColumnElement[str] = literal_column(f"'{OrderStatus.UNPAID.value}'")
    one = literal_column("1", Integer)
    candidates = union_all(
        select(one.label("n")),
        select((held.c.slot + one).label("n")).where(
            held.c.user_id == user, held.c.status == unpaid
        ),
    ).subquery("candidate")
    taken = exists().where(
        holder.c.user_id == user,
        holder.c.slot == candidates.c.n,
        holder.c.status == unpaid,
    )
    limit = effective_limit(user)
    over_limit = exists().where(
        above.c.user_id == user, above.c.slot > limit, above.c.status == unpaid
    )
    return (
        select(candidates.c.n)
        .where(candidates.c.n <= limit, ~taken, ~over_limit)
        .order_by(candidates.c.n)
        .limit(1)
        .subquery("free")
    )


def insert_in_free_slot(dialect: str, *, any_conflict: bool = False) -> Any:
    """INSERT INTO oes_orders ... SELECT the values, the free slot: no row when none is free;
    on PostgreSQL with its in-flight lock (:mod:`orders.sql.inflight`) and its ``created``
    event in the statement (bind parameters ``event_data``, ``actor_kind``, ``actor``).
    ``any_conflict``: no row either when any unique constraint refuses it (the id too),
    instead of raising: the insert of combined creates (:mod:`orders.sql.slot_batch`), so
    that one order never aborts the transaction many share."""
    free = _free_slot()
    values = [bindparam(name, type_=ORDER[name].type) for name in CREATE_COLUMNS]
    source = select(*values, free.c.n)
    columns = [*CREATE_COLUMNS, "slot"]
    if dialect != "postgresql":
        plain = insert(orders_table).from_select(columns, source)
        if any_conflict:
            plain = plain.prefix_with("OR IGNORE")
        return plain.returning(*orders_table.c)
    # The create's in-flight lock, held until its transaction ends (orders.sql.inflight).
    source = source.where(in_flight_lock(values[CREATE_COLUMNS.index("id")]))
    statement = postgresql.insert(orders_table).from_select(columns, source)
    if any_conflict:
        statement = statement.on_conflict_do_nothing()
    else:
        statement = statement.on_conflict_do_nothing(
            index_elements=[ORDER.user_id, ORDER.slot], index_where=UNPAID_PREDICATE
        )
    created_at = bindparam("created_at_ms", type_=BigInteger)
    data = bindparam("event_data", type_=events_table.c.data.type)
    returned = statement.returning(*orders_table.c)
    return with_events(returned, "created", EventKind.CREATED, created_at, data)


_HOLDERS = select(ORDER.id, ORDER.expires_at_ms, ORDER.slot).where(
    ORDER.user_id == bindparam("user_id"), UNPAID_PREDICATE
)
_ID_TAKEN = select(ORDER.id).where(ORDER.id == bindparam("oid"))
#: The order's ``holds`` once its named units are picked (:func:`orders.sql.units.take_units`).
_NAME_UNITS = (
    update(orders_table)
    .where(ORDER.id == bindparam("oid"))
    .values(holds=bindparam("held", type_=ORDER.holds.type))
    .returning(*orders_table.c)
)
_OWN_LIMIT = own_limit_of(bindparam("user_id"))


class SlotGuard:
    """Inserts creates into free slots; see the module docstring."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx
        #: Straight to the driver (:mod:`orders.sql.direct`): SQLAlchemy's execution of it
        #: cost more client CPU than the driver's.
        self._insert = PerDialect(insert_in_free_slot(tx.dialect))
        self._in_one_statement = tx.dialect == "postgresql"

    def _insert_row(self, conn: Connection, new: NewOrder) -> Changed | None:
        """The free-slot insert in ``conn``'s transaction: the order's row, or None.
        Raises InsertConflict (as SQLAlchemy's IntegrityError, by either path)."""
        try:
            rows = self._insert.rows(conn, insert_params(new))
        except IntegrityError as exc:
            raise InsertConflict(new.id) from exc
        return rows[0] if rows else None

    def insert(self, new: NewOrder, host: Connection | None = None) -> Changed | None:
        """Insert the order and its event into the lowest free slot; None if none is free
        (or, on PostgreSQL, a concurrent create took it first). Raises InsertConflict.
        ``host``: in the host's transaction (``Transactions.in_host``)."""
        if self._in_one_statement and not new.holds:
            with self.tx.statements(host) as conn:
                return self._insert_row(conn, new)
        with self.tx.write(host) as conn:
            row = self._insert_row(conn, new)
            if row is not None:
                if not self._in_one_statement:
                    created = [(row["id"], row["user_id"])]
                    record_events(
                        conn, created, EventKind.CREATED, new.created_at_ms, new.trace, new.actor
                    )
                if new.holds:  # taken in the insert's transaction, or neither is written
                    named = take(conn, new)
                    if named.keys() - dict(new.names).keys():  # units picked: name them
                        row = (
                            conn.execute(
                                _NAME_UNITS,
                                {"oid": new.id, "held": {**dict(new.holds), **named}},
                            )
                            .mappings()
                            .one()
                        )
                self.tx.commit(conn, host)
            return row

    def make_room(self, new: NewOrder, host: Connection | None = None) -> dict[str, int]:
        """No slot was free: close the holders whose time is up, so that a retry may find one.

        Returns the live holders (id -> expiry) when a retry is worth it: a holder was due
        (closed here, or by someone else meanwhile), or a slot is free after all (a create
        that raced ours took one, then something freed another). Raises InsertConflict when
        the order's id exists already (a retry of a create, or another order's id), and
        LimitReachedInSql when live orders hold every slot (or one above the user's own,
        lowered limit: see the module docstring).
        """
        user, now_ms, actor = {"user_id": new.user_id}, new.created_at_ms, new.actor
        with self.tx.write(host) as conn:
            if conn.execute(_ID_TAKEN, {"oid": new.id}).first() is not None:
                raise InsertConflict(new.id)
            own_limit: int | None = conn.scalar(_OWN_LIMIT, user)
            holders = conn.execute(_HOLDERS, user).all()
            due = [h.id for h in holders if h.expires_at_ms <= now_ms]
            if due:  # in one statement: see CLOSE_ALL_EXPIRED
                params = {"oids": due, "now_ms": now_ms}
                CLOSE_ALL_EXPIRED.run_all(conn, params, SLOT_REUSE, actor)
            self.tx.commit(conn, host)
        live = {h.id: h.expires_at_ms for h in holders if h.expires_at_ms > now_ms}
        bound = new.limit if own_limit is None else own_limit
        held = [h.slot for h in holders if h.id in live]
        # Slots are distinct: fewer live holders at or below the bound than the bound
        # leaves one free, unless a holder sits above it.
        free = all(slot <= bound for slot in held) and len(held) < bound
        if due or free:
            return live
        raise LimitReachedInSql(live, bound, own_limit)
