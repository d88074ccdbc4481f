"""The read-only SQL statements reconcile runs, built once at import.

Each reads the open unpaid orders (:func:`orders.sql.predicates.open_at`) through the partial index
``ix_oes_orders_unpaid_user_id_expires_at_ms``: a page in user order, a user range again, or a
batch of users; none takes a lock or writes. The users' own limits (``oes_user_limits``) are
read here too, a page in user order or a batch of users, for the limit keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    String,
    and_,
    bindparam,
    func,
    select,
    tuple_,
)
from sqlalchemy.dialects import postgresql

from orders.domain import is_open
from orders.sql.models import orders_table, user_limits_table
from orders.sql.predicates import open_at
from orders.sql.transactions import Transactions

ORDER = orders_table.c
LIMIT = user_limits_table.c

#: The maximum number of ids per ``IN (...)`` list (SQLite accepts 32,766 parameters).
IN_CHUNK = 5000

_OPEN_COLUMNS = (ORDER.user_id, ORDER.id, ORDER.expires_at_ms)
#: The index's own order, then the id: each user's orders come in the order of their set.
_PAGE_ORDER = (ORDER.user_id, ORDER.expires_at_ms, ORDER.id)
# The rows after (after_user, after_expiry, after_id) as a row comparison, its user bound
# spelt out too: the driver's prepared statement gets a generic plan, and this form keeps it
# on the per-user index from the last page's end. The OR form let it walk the expiry index
# over every open order and sort them, once a page, when history skewed the statistics.
_PAGE = (
    select(*_OPEN_COLUMNS)
    .where(
        open_at(bindparam("now_ms")),
        ORDER.user_id >= bindparam("after_user"),
        tuple_(*_PAGE_ORDER)
        > tuple_(bindparam("after_user"), bindparam("after_expiry"), bindparam("after_id")),
    )
    .order_by(*_PAGE_ORDER)
    .limit(bindparam("size"))
)
_OPEN_IN_RANGE = select(ORDER.id).where(
    open_at(bindparam("now_ms")),
    and_(ORDER.user_id >= bindparam("first"), ORDER.user_id <= bindparam("last")),
)
# The users of a batch with no open order: the batch goes as one parameter (a JSON array on
# SQLite, an array on PostgreSQL), each user is one probe of the index, and only the users
# without an open order come back (on a right index, hardly any).
_SQLITE_BATCH = func.json_each(bindparam("users", type_=String)).table_valued("value")
_PG_BATCH = func.unnest(bindparam("users", type_=postgresql.ARRAY(String))).column_valued(
    "batch_user"
)


def _idle_users(user: ColumnElement[str]) -> Select[Any]:
    has_open = select(ORDER.id).where(ORDER.user_id == user, open_at(bindparam("now_ms")))
    return select(user).where(~has_open.exists())


#: Public for the plan checks of the tests. A thousand IN parameters cost PostgreSQL ten
#: times as much as one array, most of it in planning.
IDLE_USERS_SQLITE = _idle_users(_SQLITE_BATCH.c.value)
IDLE_USERS_POSTGRESQL = _idle_users(_PG_BATCH)


class ReconcileReads:
    """The queries of :mod:`orders.rules.reconcile`, over the records' transactions."""

    def __init__(self, tx: Transactions) -> None:
        self.tx = tx

    def open_page(
        self, now_ms: int, after: tuple[str, str, int] | None, size: int
    ) -> list[tuple[str, str, int]]:
        """Up to ``size`` open orders as (user id, order id, expiry) in (user, expiry, id)
        order, after the row ``after`` (keyset paging: pass the last row of a page)."""
        user, order_id, expiry = after or ("", "", now_ms)  # before every open order
        params: dict[str, str | int] = {"now_ms": now_ms, "size": size, "after_id": order_id}
        params |= {"after_user": user, "after_expiry": expiry}
        with self.tx.read() as conn:
            rows: list[Any] = list(conn.execute(_PAGE, params).all())  # rows unpack as tuples
        return rows

    def open_in_range(self, first: str, last: str, now_ms: int) -> set[str]:
        """The ids of the open orders of the users from ``first`` to ``last`` (SQL's order)."""
        params = {"now_ms": now_ms, "first": first, "last": last}
        with self.tx.read() as conn:
            return set(conn.scalars(_OPEN_IN_RANGE, params).all())

    def users_without_open(self, user_ids: Sequence[str], now_ms: int) -> list[str]:
        """The users of ``user_ids`` that have no open order."""
        users: list[str] | str = list(user_ids)
        query = IDLE_USERS_POSTGRESQL
        if self.tx.dialect != "postgresql":
            query, users = IDLE_USERS_SQLITE, json.dumps(users)
        with self.tx.read() as conn:
            return list(conn.scalars(query, {"users": users, "now_ms": now_ms}).all())

    def open_by_user(self, user_ids: Sequence[str], now_ms: int) -> dict[str, dict[str, int]]:
        """For each user: open order id -> expiry."""
        query = select(*_OPEN_COLUMNS).where(ORDER.user_id.in_(user_ids), open_at(now_ms))
        wanted: dict[str, dict[str, int]] = {user: {} for user in user_ids}
        with self.tx.read() as conn:
            for user, order_id, expires_at_ms in conn.execute(query):
                wanted[user][order_id] = expires_at_ms
        return wanted

    def open_owners(self, order_ids: Sequence[str], now_ms: int) -> dict[str, str | None]:
        """For each id that has a row: its user if the order is open, else None."""
        found: dict[str, str | None] = {}
        columns = (ORDER.id, ORDER.user_id, ORDER.status, ORDER.expires_at_ms)
        with self.tx.read() as conn:
            for start in range(0, len(order_ids), IN_CHUNK):
                query = select(*columns).where(ORDER.id.in_(order_ids[start : start + IN_CHUNK]))
                for order_id, user, status, expires_at_ms in conn.execute(query):
                    found[order_id] = user if is_open(status, expires_at_ms, now_ms) else None
        return found

    def limits_page(self, after: str | None, size: int) -> dict[str, int]:
        """Up to ``size`` users' own limits in user order, after user ``after``."""
        query = select(LIMIT.user_id, LIMIT.unpaid_limit).order_by(LIMIT.user_id).limit(size)
        if after is not None:
            query = query.where(LIMIT.user_id > after)
        with self.tx.read() as conn:
            return {row.user_id: row.unpaid_limit for row in conn.execute(query)}

    def limits_of(self, user_ids: Sequence[str]) -> dict[str, int]:
        """The own limits of those of ``user_ids`` that have one."""
        found: dict[str, int] = {}
        with self.tx.read() as conn:
            for start in range(0, len(user_ids), IN_CHUNK):
                chunk = user_ids[start : start + IN_CHUNK]
                query = select(LIMIT.user_id, LIMIT.unpaid_limit).where(LIMIT.user_id.in_(chunk))
                found.update((row.user_id, row.unpaid_limit) for row in conn.execute(query))
        return found
