"""What every table of the schema shares: the declarative base with its naming convention,
the widest ids the columns hold, the status predicates of the partial indexes, and the
partial index itself on both engines (``models`` and ``inventory_tables`` build on it).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, Integer, MetaData, text
from sqlalchemy.orm import DeclarativeBase

from orders.domain import EventKind, OrderStatus
from orders.validation import RESOURCE_ID_MAX_LENGTH, TEXT_MAX_LENGTH, USER_ID_MAX_LENGTH

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

#: The widest ids the schema holds; the configurable limits may only be lower.
USER_ID_COLUMN_LENGTH = USER_ID_MAX_LENGTH
ORDER_ID_COLUMN_LENGTH = 128
TEXT_COLUMN_LENGTH = TEXT_MAX_LENGTH
POLICY_NAME_COLUMN_LENGTH = 64
RESOURCE_ID_COLUMN_LENGTH = RESOURCE_ID_MAX_LENGTH

# SQLite only auto-increments an INTEGER PRIMARY KEY; elsewhere the key is a BIGINT.
EventId = BigInteger().with_variant(Integer(), "sqlite")


UNPAID_SQL = f"status = '{OrderStatus.UNPAID.value}'"
PAID_SQL = f"status = '{OrderStatus.PAID.value}'"
CANCELLED_SQL = f"status = '{OrderStatus.CANCELLED.value}'"
CLOSED_SQL = f"status = '{OrderStatus.CLOSED.value}'"
#: A payment refusal whose refund nobody has marked handled yet.
PENDING_SQL = "handled_at_ms IS NULL"
#: An unpaid order whose reminder is still to be written.
REMINDER_DUE_SQL = f"{UNPAID_SQL} AND remind_at_ms IS NOT NULL"
#: An order whose reminder was written.
REMINDED_SQL = "reminded_at_ms IS NOT NULL"
#: An event_retries row still being retried (not parked).
RETRYING_SQL = "parked_at_ms IS NULL"


def in_values(values: type[OrderStatus] | type[EventKind]) -> str:
    """The values as a SQL list of literals, for a CHECK constraint."""
    return ", ".join(f"'{v.value}'" for v in values)


def partial_index(name: str, *columns: str, where: str, unique: bool = False) -> Index:
    """An index over the rows ``where`` holds for, on both engines (each reads its own
    keyword; the other ignores it)."""
    return Index(
        name, *columns, unique=unique, postgresql_where=text(where), sqlite_where=text(where)
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
