"""Every check of caller input, once: each returns the value in its canonical form or raises
:class:`~orders.errors.InvalidInput`, naming the parameter and never echoing the value.

Nothing here does I/O or knows about the stores; the service calls these before it writes.
"""

from __future__ import annotations

import functools
import json
import math
import re
import unicodedata
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from orders.errors import InvalidInput

#: Every expiry must stay an exact integer in a Redis score (a double): below 2**53.
MAX_TIMESTAMP_MS = 2**53 - 1
#: The widest user id the schema holds; the configurable limit may only be lower.
USER_ID_MAX_LENGTH = 512
#: The longest free text (a payment reference, a reason) the schema holds.
TEXT_MAX_LENGTH = 256
#: Characters refused in user ids: Redis Cluster hash tags and SCAN/KEYS glob syntax.
KEY_UNSAFE = frozenset("{}*?[]")


def _check_text(name: str, value: object, max_length: int, *, key_safe: bool) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
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
    _check_characters(name, value, key_safe=key_safe)
    return value


def _check_characters(name: str, value: str, *, key_safe: bool) -> None:
    # Printable ASCII is in none of the categories refused below: only an unsafe character
    # is left to find, and the loop finds it (most ids are plain ASCII: the loop is skipped).
    if value.isascii() and value.isprintable() and (not key_safe or KEY_UNSAFE.isdisjoint(value)):
        return
    for ch in value:
        if unicodedata.category(ch) in ("Cc", "Cs", "Cn", "Zl", "Zp"):
            raise InvalidInput(name, "must not contain control or unassigned characters")
        if key_safe and ch in KEY_UNSAFE:
            raise InvalidInput(name, "must not contain any of {}*?[]")


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


#: The widest resource id (``sku:42``, ``coupon:SPRING``, ``slot:2027-01-05T10:00``).
RESOURCE_ID_MAX_LENGTH = 128
#: The most units one hold may ask for, and the most resources one cart may name.
HOLD_QUANTITY_MAX = 1_000_000
HOLDS_PER_ORDER_MAX = 100
#: A resource's named units at most, and the longest name of one.
UNITS_MAX = 100_000
UNIT_NAME_MAX_LENGTH = 64
#: The largest capacity a resource may have.
CAPACITY_MAX = 10**12


def check_resource_id(value: object) -> str:
    """A resource id, checked like a user id (its Redis key carries it as a hash tag)."""
    return _check_text("resource_id", value, RESOURCE_ID_MAX_LENGTH, key_safe=True)


def check_holds(value: object) -> tuple[tuple[str, int], ...]:
    """A create's ``holds``: resource id -> units (a count, or a list of unit names), as
    (id, units) pairs sorted by id (the order every store takes them in). None or empty: no
    holds. The names themselves: :func:`check_hold_names`."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise InvalidInput("holds", "must be a mapping of resource id to a number of units")
    if len(value) > HOLDS_PER_ORDER_MAX:
        raise InvalidInput("holds", f"must name at most {HOLDS_PER_ORDER_MAX} resources")
    pairs: dict[str, int] = {}
    for resource_id, units in value.items():
        rid = check_resource_id(resource_id)
        if rid in pairs:
            raise InvalidInput("holds", "names a resource twice")
        if isinstance(units, list | tuple):
            pairs[rid] = len(check_unit_names("holds", units, HOLD_QUANTITY_MAX))
        else:
            pairs[rid] = check_count("holds", units, 1, HOLD_QUANTITY_MAX)
    return tuple(sorted(pairs.items()))


def check_hold_names(value: object) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The named units a create's ``holds`` (checked by :func:`check_holds`) asks for:
    (resource id, unit names sorted), sorted by resource id."""
    if not isinstance(value, Mapping):
        return ()
    named = [
        (str(rid), tuple(sorted(check_unit_names("holds", units, HOLD_QUANTITY_MAX))))
        for rid, units in value.items()
        if isinstance(units, list | tuple)
    ]
    return tuple(sorted(named))


def check_unit_names(name: str, value: object, most: int) -> list[str]:
    """A list of unit names (a seat, a numbered space): 1 to ``most``, each distinct, not
    empty, at most ``UNIT_NAME_MAX_LENGTH`` characters, without control characters."""
    if not isinstance(value, list | tuple):
        raise InvalidInput(name, "must be a list of unit names")
    if not 1 <= len(value) <= most:
        raise InvalidInput(name, f"must name 1 to {most} units")
    names = [_check_text(name, unit, UNIT_NAME_MAX_LENGTH, key_safe=False) for unit in value]
    seen: set[str] = set()
    for unit in names:
        if unit in seen:
            raise InvalidInput(name, f"names the unit {unit!r} twice")
        seen.add(unit)
    return names


def check_capacity(capacity: object, per_user: object) -> tuple[int, int | None]:
    """A resource's capacity (0 or more) and its ``per_user`` cap (None, or 1..capacity)."""
    cap = check_count("capacity", capacity, 0, CAPACITY_MAX)
    if per_user is None:
        return cap, None
    return cap, check_count("per_user", per_user, 1, max(cap, 1))


def check_ttl_ms(ttl_s: object, max_ttl_s: float) -> int:
    """A TTL given in seconds, as whole milliseconds (at least 1 ms, at most the maximum)."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float | Decimal):
        raise InvalidInput("ttl_s", "must be a number of seconds")
    if isinstance(ttl_s, Decimal) and not ttl_s.is_finite():
        raise InvalidInput("ttl_s", "must be finite")
    if isinstance(ttl_s, float) and not math.isfinite(ttl_s):
        raise InvalidInput("ttl_s", "must be finite")
    if ttl_s <= 0:
        raise InvalidInput("ttl_s", "must be positive")
    if ttl_s > max_ttl_s:
        raise InvalidInput("ttl_s", f"must be at most {int(max_ttl_s)} s (is it in milliseconds?)")
    ttl_ms = round(ttl_s * 1000)
    if ttl_ms < 1:
        raise InvalidInput("ttl_s", "must be at least 0.001 s")
    return int(ttl_ms)


#: The highest per-user limit (``set_user_limit``; the schema's check says the same).
USER_LIMIT_MAX = 1_000_000


def check_user_limit(limit: object) -> int:
    """A user's own unpaid limit: an integer from 0 (no unpaid order at all) to
    :data:`USER_LIMIT_MAX`; bools refused."""
    return check_count("limit", limit, 0, USER_LIMIT_MAX)


#: What a create does at its user's limit (``on_limit``): refuse it, or cancel the user's
#: oldest unpaid order to make room (:mod:`orders.rules.creating`).
ON_LIMIT_REFUSE = "refuse"
ON_LIMIT_REPLACE_OLDEST = "replace_oldest"
ON_LIMIT_CHOICES = (ON_LIMIT_REFUSE, ON_LIMIT_REPLACE_OLDEST)


def check_on_limit(value: object) -> str:
    if value not in ON_LIMIT_CHOICES:
        raise InvalidInput("on_limit", f"must be one of {', '.join(ON_LIMIT_CHOICES)}")
    return str(value)


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
    amount = _parse_amount(value)
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


def _parse_amount(value: object) -> Decimal:
    if isinstance(value, bool | float):
        raise InvalidInput("amount", "must be a Decimal, an int or a decimal string, not a float")
    if isinstance(value, Decimal):
        return value
    if isinstance(value, int):
        return Decimal(value)
    if not isinstance(value, str):
        raise InvalidInput("amount", "must be a Decimal, an int or a decimal string")
    if len(value) > 64:
        raise InvalidInput("amount", "is too long")
    try:
        return Decimal(value.strip())
    except InvalidOperation:
        raise InvalidInput("amount", "is not a decimal number") from None


def amount_to_text(amount: Decimal | None) -> str | None:
    return None if amount is None else format(amount, "f")


def check_currency(value: object) -> str | None:
    """An ISO 4217 currency code in use today (pycountry's list), like EUR."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) != 3 or not value.isascii():
        raise InvalidInput("currency", "must be a three-letter ISO 4217 code")
    if not value.isalpha() or not value.isupper():
        raise InvalidInput("currency", "must be three upper-case letters, like EUR")
    if value not in iso_4217_codes():
        raise InvalidInput("currency", "is not an ISO 4217 currency code in use")
    return value


@functools.cache
def iso_4217_codes() -> frozenset[str]:
    """The ISO 4217 codes, loaded on first use (pycountry reads its data then: ~60 ms)."""
    import pycountry  # noqa: PLC0415

    return frozenset(currency.alpha_3 for currency in pycountry.currencies)


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


def check_expiry_ms(now_ms: int, ttl_ms: int) -> int:
    """``now_ms + ttl_ms``, refused when it would not be exact as a Redis score."""
    expires_at_ms = now_ms + ttl_ms
    if expires_at_ms > MAX_TIMESTAMP_MS:
        raise InvalidInput("ttl_s", "puts the expiry beyond 2**53 ms")
    return expires_at_ms


def check_currency_needs_amount(amount: Decimal | None, currency: str | None) -> None:
    if currency is not None and amount is None:
        raise InvalidInput("currency", "given without an amount")


def check_cutoff(now_ms: object, clock_now: int) -> int:
    """A sweep cutoff: integer ms, not negative, and never ahead of the clock."""
    if isinstance(now_ms, bool) or not isinstance(now_ms, int):
        raise InvalidInput("now_ms", "must be integer milliseconds")
    if now_ms > clock_now:
        raise InvalidInput("now_ms", "must not be ahead of the clock (it would close open orders)")
    if now_ms < 0:
        raise InvalidInput("now_ms", "must not be negative")
    return now_ms


def check_count(name: str, value: object, low: int, high: int | None = None) -> int:
    """An integer in ``low..high`` (no upper bound when ``high`` is None); bools refused."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(name, "must be an integer")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise InvalidInput(name, f"must be {bound}")
    return value


def check_row_id(name: str, value: object) -> int:
    """A row's id in a BIGINT identity column: a positive integer below 2**63."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise InvalidInput(name, "must be a positive integer")
    return value


def check_seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A positive (or, with ``allow_zero``, not negative) finite number of seconds (int or
    float; bools refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(name, "must be a number of seconds")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        qualifier = "0 or more" if allow_zero else "positive"
        raise InvalidInput(name, f"must be a finite number of seconds, {qualifier}")
    return float(value)


def check_token(name: str, value: object) -> str:
    """An opaque token the caller made (a lease or heartbeat owner): a non-empty string."""
    if not isinstance(value, str) or not value:
        raise InvalidInput(name, "must be a non-empty string")
    return value


#: A duration back from now or an age: a whole number and its unit (``30m``, ``2h``, ``7d``).
DURATION = re.compile(r"([0-9]{1,12})([smhd])")
UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def duration_ms(text: str) -> int | None:
    """``90s``, ``30m``, ``2h``, ``7d`` in milliseconds, or None when ``text`` is not one."""
    found = DURATION.fullmatch(text.strip())
    return None if found is None else int(found[1]) * UNIT_MS[found[2]]


def check_age_ms(name: str, text: object) -> int:
    """An age such as ``90d`` (units s, m, h, d), above 0, in milliseconds."""
    age_ms = duration_ms(text) if isinstance(text, str) else None
    if age_ms is None:
        raise InvalidInput(name, "must be a whole number and a unit (s, m, h, d), e.g. 90d")
    if age_ms <= 0:
        raise InvalidInput(name, "must be above 0")
    return age_ms
