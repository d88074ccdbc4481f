"""The order predicates in SQL: one vocabulary for every statement that asks whether an order
counts, is due, may close or has a reminder due.

``orders.domain.is_open`` is the same rule in Python, and admit.lua the same in Redis: an
order counts while unpaid with its expiry ahead, and is due once unpaid with its expiry at
or before the cutoff. Each predicate is written as the partial indexes over it state it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, and_, exists, literal_column

from orders.domain import OrderStatus
from orders.sql.models import orders_table, pauses_table

#: ``status = 'unpaid'`` as an inline literal, the form the partial indexes can serve
#: (PostgreSQL's generic plans of prepared statements included; a bound parameter is not).
UNPAID_PREDICATE = orders_table.c.status == literal_column(f"'{OrderStatus.UNPAID.value}'")


def open_at(now_ms: int | ColumnElement[Any]) -> ColumnElement[bool]:
    """Unpaid with its expiry after ``now_ms``: counts against its user's limit."""
    return and_(UNPAID_PREDICATE, orders_table.c.expires_at_ms > now_ms)


def due_at(cutoff_ms: int | ColumnElement[Any]) -> ColumnElement[bool]:
    """Unpaid with its expiry at or before ``cutoff_ms``: the sweep closes it."""
    return and_(UNPAID_PREDICATE, orders_table.c.expires_at_ms <= cutoff_ms)


#: No incident pause is open: the close and reminder statements carry it, so a pause holds
#: from the first statement that starts after it commits, on every host, with no extra read.
PAUSED = exists().where(pauses_table.c.open_marker.is_not(None))
NOT_PAUSED = ~PAUSED


def closable_at(cutoff_ms: int | ColumnElement[Any]) -> ColumnElement[bool]:
    """Due at ``cutoff_ms`` and no pause open: what a close by expiry may close."""
    return and_(due_at(cutoff_ms), NOT_PAUSED)


#: An unpaid order with a reminder still to write, as the partial index over them states it.
REMINDER_DUE_PREDICATE = and_(UNPAID_PREDICATE, orders_table.c.remind_at_ms.is_not(None))


def reminder_due_at(cutoff_ms: int | ColumnElement[Any]) -> ColumnElement[bool]:
    """Unpaid, its reminder due at or before ``cutoff_ms`` and its expiry after it (an order
    due for closing is closed, not reminded): the partial index over due reminders serves it."""
    return and_(
        REMINDER_DUE_PREDICATE,
        orders_table.c.remind_at_ms <= cutoff_ms,
        orders_table.c.expires_at_ms > cutoff_ms,
    )
