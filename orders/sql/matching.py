"""The unpaid orders an operator's filter matches, read a page at a time (bulk actions).

Pages walk the partial indexes over unpaid orders (by expiry; by user and expiry when
the filter names a user) with a keyset on ``(expires_at_ms, id)``, never OFFSET, so each
page costs the same however far the walk has gone, and the walk never holds a lock.

The walk goes from the latest expiry down. An extension moves an order to a later expiry,
behind the keyset, so an extended order is never read (and extended) twice; a cancelled,
paid or closed order leaves the partial index. An order created during the walk is read
only when its expiry falls below the keyset and the filter matches it.

``created_before`` and ``metadata`` narrow the rows the index finds. The metadata filter
compares the JSON element as text (SQLAlchemy's ``as_string``: ``json_extract`` on SQLite,
``->>`` on PostgreSQL): ``{"shop": "eu"}`` for ``shop=eu``, and an integer by its digits
(``{"n": 5}`` for ``n=5``) on both engines alike (a test pins it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import ColumnElement, and_, or_, select

from orders.domain import Order
from orders.sql.models import orders_table
from orders.sql.predicates import UNPAID_PREDICATE
from orders.sql.records import to_order
from orders.sql.transactions import Transactions

ORDER = orders_table.c


@dataclass(frozen=True)
class OrderFilter:
    """Which unpaid orders a bulk action touches; every field given must hold (AND).

    Times are epoch milliseconds; ``metadata``: keys whose string values must be equal.
    """

    user_id: str | None = None
    created_before_ms: int | None = None
    expiring_before_ms: int | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """True when nothing narrows it: it would match every unpaid order."""
        return (
            self.user_id is None
            and self.created_before_ms is None
            and self.expiring_before_ms is None
            and not self.metadata
        )

    def conditions(self) -> list[ColumnElement[bool]]:
        """The filter as SQL conditions over unpaid orders."""
        where: list[ColumnElement[bool]] = [UNPAID_PREDICATE]
        if self.user_id is not None:
            where.append(ORDER.user_id == self.user_id)
        if self.created_before_ms is not None:
            where.append(ORDER.created_at_ms < self.created_before_ms)
        if self.expiring_before_ms is not None:
            where.append(ORDER.expires_at_ms < self.expiring_before_ms)
        for key, value in self.metadata.items():
            where.append(ORDER.metadata[key].as_string() == value)
        return where


#: Where a walk stands: the last (expires_at_ms, id) read, or None before the first page.
Keyset = tuple[int, str] | None


def matching_page(
    tx: Transactions, wanted: OrderFilter, after: Keyset, limit: int, now_ms: int
) -> list[Order]:
    """Up to ``limit`` unpaid orders matching ``wanted`` below ``after`` in (expiry, id)
    order, latest first."""
    where = wanted.conditions()
    if after is not None:
        expires_at_ms, order_id = after
        where.append(
            or_(
                ORDER.expires_at_ms < expires_at_ms,
                and_(ORDER.expires_at_ms == expires_at_ms, ORDER.id < order_id),
            )
        )
    query = (
        select(*orders_table.c)
        .where(*where)
        .order_by(ORDER.expires_at_ms.desc(), ORDER.id.desc())
        .limit(limit)
    )
    with tx.read() as conn:
        return [to_order(row, now_ms) for row in conn.execute(query)]


def keyset_of(order: Order) -> Keyset:
    """The keyset after ``order``, the last of a page."""
    return (order.expires_at_ms, order.id)
