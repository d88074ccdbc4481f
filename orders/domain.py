"""Order states, the Order value, and the pure rules for input: no I/O here.

Every ``check_*`` function either returns the value in its canonical form or raises
:class:`~orders.errors.InvalidInput` without echoing the offending value.
"""

from __future__ import annotations

import json
import math
import os
import threading
import unicodedata
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal, InvalidOperation
from enum import StrEnum
from typing import Any

from orders.errors import InvalidInput

Clock = Callable[[], int]
"""Returns the current time in integer milliseconds since the Unix epoch."""

#: Every expiry must stay an exact integer in a Redis score (a double): below 2**53.
MAX_TIMESTAMP_MS = 2**53 - 1
#: Characters refused in user ids: Redis Cluster hash tags and SCAN/KEYS glob syntax.
KEY_UNSAFE = frozenset("{}*?[]")


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
        return self.status is OrderStatus.UNPAID and self.expires_at_ms > self.read_at_ms


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


# --- input rules -------------------------------------------------------------------------


def _check_text(name: str, value: object, max_length: int, *, key_safe: bool) -> str:
    if isinstance(value, bool) or value is None:
        raise InvalidInput(name, "must be a string")
    if isinstance(value, int):
        if abs(value) >= 10**max_length:
            raise InvalidInput(name, f"must be at most {max_length} characters")
        value = str(value)
    if not isinstance(value, str):
        raise InvalidInput(name, "must be a string")
    if not value or value.isspace():
        raise InvalidInput(name, "must not be empty or blank")
    if len(value) > max_length:
        raise InvalidInput(name, f"must be at most {max_length} characters")
    if value != value.strip():
        raise InvalidInput(name, "must not start or end with white space")
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cs", "Cn", "Zl", "Zp"):
            raise InvalidInput(name, "must not contain control or unassigned characters")
        if key_safe and ch in KEY_UNSAFE:
            raise InvalidInput(name, "must not contain any of {}*?[]")
    return value


def check_user_id(value: object, max_length: int) -> str:
    """A user id as a string; an int becomes its decimal string, so 7 and "7" are one user."""
    return _check_text("user_id", value, max_length, key_safe=True)


def check_order_id(value: object, max_length: int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        raise InvalidInput("order_id", "must be a string (ids above 2**53 break in JSON)")
    return _check_text("order_id", value, max_length, key_safe=True)


def check_optional_text(name: str, value: object, max_length: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, int):
        raise InvalidInput(name, "must be a string")
    return _check_text(name, value, max_length, key_safe=False)


def check_ttl_ms(ttl_s: object, max_ttl_ms: int) -> int:
    """A TTL given in seconds, as whole milliseconds (at least 1 ms, at most the maximum)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float | Decimal):
        raise InvalidInput("ttl_s", "must be a number of seconds")
    if isinstance(ttl_s, Decimal) and not ttl_s.is_finite():
        raise InvalidInput("ttl_s", "must be finite")
    if isinstance(ttl_s, float) and not math.isfinite(ttl_s):
        raise InvalidInput("ttl_s", "must be finite")
    if ttl_s <= 0:
        raise InvalidInput("ttl_s", "must be positive")
    if ttl_s > max_ttl_ms / 1000:
        raise InvalidInput(
            "ttl_s", f"must be at most {max_ttl_ms // 1000} s (is it in milliseconds?)"
        )
    ttl_ms = round(ttl_s * 1000)
    if ttl_ms < 1:
        raise InvalidInput("ttl_s", "must be at least 0.001 s")
    return int(ttl_ms)


def check_limit(limit: object) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise InvalidInput("limit", "must be an integer")
    if not 1 <= limit <= 1000:
        raise InvalidInput("limit", "must be between 1 and 1000")
    return limit


MAX_AMOUNT_DIGITS = 20
MAX_AMOUNT_PLACES = 8


def check_amount(value: object) -> Decimal | None:
    """A money amount: Decimal, int or decimal string; floats are refused as inexact."""
    if value is None:
        return None
    if isinstance(value, bool | float):
        raise InvalidInput("amount", "must be a Decimal, an int or a decimal string, not a float")
    if isinstance(value, int):
        amount = Decimal(value)
    elif isinstance(value, Decimal):
        amount = value
    elif isinstance(value, str):
        if len(value) > 64:
            raise InvalidInput("amount", "is too long")
        try:
            amount = Decimal(value.strip())
        except InvalidOperation:
            raise InvalidInput("amount", "is not a decimal number") from None
    else:
        raise InvalidInput("amount", "must be a Decimal, an int or a decimal string")
    if not amount.is_finite():
        raise InvalidInput("amount", "must be finite")
    if amount < 0:
        raise InvalidInput("amount", "must not be negative")
    _, digits, exponent = amount.as_tuple()
    assert isinstance(exponent, int)  # finite, checked above
    if -exponent > MAX_AMOUNT_PLACES:
        raise InvalidInput("amount", f"must have at most {MAX_AMOUNT_PLACES} decimal places")
    if len(digits) + max(exponent, 0) > MAX_AMOUNT_DIGITS:
        raise InvalidInput("amount", f"must have at most {MAX_AMOUNT_DIGITS} digits")
    return amount


def amount_to_text(amount: Decimal | None) -> str | None:
    return None if amount is None else format(amount, "f")


def check_currency(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 3 or not value.isascii():
        raise InvalidInput("currency", "must be a three-letter ISO 4217 code")
    if not value.isalpha() or not value.isupper():
        raise InvalidInput("currency", "must be three upper-case letters, like EUR")
    return value


def check_metadata(value: object, max_bytes: int) -> dict[str, Any]:
    """JSON-able mapping with string keys, at most ``max_bytes`` once encoded."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidInput("metadata", "must be a mapping")
    try:
        encoded = json.dumps(value, allow_nan=False, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        raise InvalidInput("metadata", "must hold only JSON values (no NaN, no objects)") from None
    if len(encoded.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidInput("metadata", f"must encode to at most {max_bytes} bytes of JSON")
    try:
        encoded.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput("metadata", "must be valid Unicode (no lone surrogates)") from None
    decoded: dict[str, Any] = json.loads(encoded)
    if decoded != dict(value):
        raise InvalidInput(
            "metadata", "must hold only JSON types (str keys, lists not tuples) to round-trip"
        )
    return decoded


# --- order ids ---------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


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

    def __call__(self) -> str:
        with self._lock:
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
        chars = []
        for _ in range(26):
            chars.append(_CROCKFORD[value & 31])
            value >>= 5
        return "".join(reversed(chars))
