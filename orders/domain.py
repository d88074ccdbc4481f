"""Order states, the Order value, and the rules about them: no I/O here.

Input checks live in :mod:`orders.validation`; this module says what an order is, when it
counts against its user, and which error a caller gets when a transition finds it terminal.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from orders.errors import OrderAlreadyPaid, OrderClosed, OrderConflict, OrdersError

Clock = Callable[[], int]
"""Returns the current time in integer milliseconds since the Unix epoch."""


class OrderStatus(StrEnum):
    UNPAID = "unpaid"
    PAID = "paid"
    CANCELLED = "cancelled"
    CLOSED = "closed"

    @property
    def is_terminal(self) -> bool:
        return self is not OrderStatus.UNPAID


class EventKind(StrEnum):
    CREATED = "created"
    PAID = "paid"
    CANCELLED = "cancelled"
    CLOSED = "closed"
    EXTENDED = "extended"


@dataclass(frozen=True, slots=True)
class Order:
    """An order as the database held it at ``read_at_ms``. A value, never a live ORM row.

    Timestamps are integer milliseconds since the epoch (``*_ms``); the ``*_at`` properties
    give the same instants as UTC-aware datetimes.
    """

    id: str
    user_id: str
    status: OrderStatus
    created_at_ms: int
    expires_at_ms: int
    read_at_ms: int
    amount: Decimal | None = None
    currency: str | None = None
    paid_at_ms: int | None = None
    closed_at_ms: int | None = None
    close_reason: str | None = None
    payment_ref: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    #: How often the expiry was moved (extend_order, the pre-close check).
    extensions: int = 0

    @property
    def created_at(self) -> datetime:
        return ms_to_datetime(self.created_at_ms)

    @property
    def expires_at(self) -> datetime:
        return ms_to_datetime(self.expires_at_ms)

    @property
    def paid_at(self) -> datetime | None:
        return None if self.paid_at_ms is None else ms_to_datetime(self.paid_at_ms)

    @property
    def closed_at(self) -> datetime | None:
        return None if self.closed_at_ms is None else ms_to_datetime(self.closed_at_ms)

    @property
    def time_left_ms(self) -> int:
        """Milliseconds until expiry as of ``read_at_ms``; 0 once expired or terminal."""
        if self.status is not OrderStatus.UNPAID:
            return 0
        return max(0, self.expires_at_ms - self.read_at_ms)

    @property
    def time_left_s(self) -> float:
        return self.time_left_ms / 1000

    @property
    def is_open(self) -> bool:
        """Unpaid and not yet expired: counts against the user's limit."""
        return is_open(self.status, self.expires_at_ms, self.read_at_ms)


def is_open(status: str, expires_at_ms: int, now_ms: int) -> bool:
    """The one rule of what counts against a user's limit: unpaid, with its expiry ahead.

    SQL says the same in :func:`orders.sql.models.open_at`, Redis in ``admit.lua``.
    """
    return status == OrderStatus.UNPAID and expires_at_ms > now_ms


def same_order(order: Order, user_id: str, amount: Decimal | None, currency: str | None) -> Order:
    """``order`` if a create with these arguments is a retry of it; else OrderConflict."""
    if order.user_id != user_id:
        raise OrderConflict(order.id, "this order id belongs to another user")
    if order.amount != amount or order.currency != currency:
        raise OrderConflict(order.id, "this order id exists with another amount or currency")
    return order


def refusal(order: Order) -> OrdersError:
    """The error for a transition out of ``unpaid`` that found ``order`` already terminal."""
    if order.status is OrderStatus.PAID:
        return OrderAlreadyPaid(order.id, order.payment_ref)
    return OrderClosed(order.id, order.status.value)


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one :meth:`~orders.service.OrderService.sweep_expired` call did."""

    closed: int
    batches: int
    users: int
    cutoff_ms: int
    #: closed_at - expires_at of the longest-overdue order closed, in ms (None if none).
    max_lag_ms: int | None
    redis_errors: int = 0


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).replace(microsecond=(ms % 1000) * 1000)


def system_clock() -> int:
    """Wall-clock time in integer milliseconds (the default clock)."""
    import time  # noqa: PLC0415

    return time.time_ns() // 1_000_000


# --- order ids ---------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: Two Crockford characters per 10 bits: an id is 13 look-ups, not 26 shifts.
_CROCKFORD_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]


class OrderIdGenerator:
    """Unique, time-ordered ids: 48 bits of milliseconds then 80 random bits (a ULID).

    Ids made by one generator sort in creation order even within one millisecond (the
    random part is incremented); across processes they sort by millisecond.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_rand = 0

    def __call__(self, now_ms: int | None = None) -> str:
        """A new id; ``now_ms``: the caller's reading of the clock (read here if None)."""
        with self._lock:
            if now_ms is None:
                now_ms = self._clock()
            if now_ms <= self._last_ms:
                now_ms = self._last_ms
                self._last_rand += 1
                if self._last_rand >= 1 << 80:  # pragma: no cover - 2**80 ids in one ms
                    raise RuntimeError("order id space for this millisecond exhausted")
            else:
                self._last_ms = now_ms
                self._last_rand = int.from_bytes(os.urandom(10), "big") >> 1
            value = (now_ms << 80) | self._last_rand
        # 26 characters of 5 bits hold the 128 bits (the top two are 0), 10 bits at a time.
        pairs = _CROCKFORD_PAIRS
        return "".join([pairs[(value >> shift) & 1023] for shift in range(120, -1, -10)])
