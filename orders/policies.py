"""Expiry policies: how long an order may stay unpaid, and what follows from it.

:class:`~orders.config.Settings` holds one default policy (read from ``ORDERS_TTL_S``,
``ORDERS_MAX_TTL_S``, ``ORDERS_REMIND_BEFORE_S``, ``ORDERS_LATE_PAYMENT_WINDOW_S`` and
``ORDERS_MAX_LIFETIME_S``) and the named ones a create may pick
(``create_unpaid_order(..., policy="bank_transfer")``). An order remembers its policy's name
(its ``policy`` column; None: the default), so everything later decided about it reads the
same policy: its reminder (placed at create), the cap on its extensions (``extend_order``
and the pre-close check) and the window in which a late payment is still accepted.

A policy that does not expire gives its orders the latest instant a ``datetime`` holds
(:data:`NEVER_EXPIRES_MS`, 9999-12-31T23:59:59.999Z), which is still an exact Redis score:
the order holds its user's slot until it is paid or cancelled, and the sweep never sees it.

No I/O here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from orders.errors import InvalidInput
from orders.validation import MAX_TIMESTAMP_MS, check_seconds

#: The expiry of an order whose policy does not expire: the last millisecond a datetime
#: holds (below 2**53, so exact as a Redis score).
NEVER_EXPIRES_MS = 253_402_300_799_999
#: A policy's name: what the orders' ``policy`` column (64 characters) holds.
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)


@dataclass(frozen=True, slots=True)
class ExpiryPolicy:
    """One way for an order to expire, in seconds: the settings' default or a named one.

    ``ttl_s``: the time to pay; ``max_ttl_s``: the longest ``ttl_s`` a create may ask for
    (None: ``max_lifetime_s``); ``remind_before_s``: the sweep's ``expiring`` event this
    long ahead of the expiry (None: none); ``late_payment_window_s``: a payment this long
    after the expiry of an order closed by it still turns it paid (0: refused);
    ``max_lifetime_s``: no extension, and no ``expires_at``, moves the expiry past
    ``created_at`` plus this; ``expires``: False for orders that wait until they are paid
    or cancelled (the other fields then do not apply).
    """

    ttl_s: float = 1800.0
    max_ttl_s: float | None = None
    remind_before_s: float | None = None
    late_payment_window_s: float = 0.0
    max_lifetime_s: float = 7 * 24 * 3600.0
    expires: bool = True

    @property
    def longest_ttl_s(self) -> float:
        """The longest ``ttl_s`` a create may ask for: ``max_ttl_s``, else the lifetime."""
        return self.max_lifetime_s if self.max_ttl_s is None else self.max_ttl_s

    def check(self, where: str = "") -> None:
        """:class:`InvalidInput` naming ``<where><field>`` for what is wrong (``where``:
        ``"policies.<name>."`` for a named policy, empty for the default one)."""
        if not isinstance(self.expires, bool):
            raise InvalidInput(f"{where}expires", "must be true or false")
        for name, value in (("ttl_s", self.ttl_s), ("max_lifetime_s", self.max_lifetime_s)):
            _check_seconds(f"{where}{name}", value)
        for name, optional in (
            ("max_ttl_s", self.max_ttl_s),
            ("remind_before_s", self.remind_before_s),
        ):
            if optional is not None:
                _check_seconds(f"{where}{name}", optional)
        _check_seconds(f"{where}late_payment_window_s", self.late_payment_window_s, zero=True)
        if self.ttl_s > self.longest_ttl_s:
            raise InvalidInput(f"{where}ttl_s", "is above max_ttl_s (max_lifetime_s without it)")
        if self.remind_before_s is not None and self.remind_before_s >= self.ttl_s:
            raise InvalidInput(f"{where}remind_before_s", "must be below ttl_s (the time to pay)")
        if self.late_payment_window_s > self.max_lifetime_s:
            raise InvalidInput(f"{where}late_payment_window_s", "is above max_lifetime_s")

    def expiry_ms(self, created_at_ms: int, ttl_ms: int, deadline_ms: int | None) -> int:
        """The expiry of an order created at ``created_at_ms``: ``NEVER_EXPIRES_MS`` under
        a policy that does not expire, else the deadline capped at the maximum lifetime, or
        ``ttl_ms`` after the creation. :class:`InvalidInput` for a deadline not ahead."""
        if not self.expires:
            return NEVER_EXPIRES_MS
        if deadline_ms is None:
            return created_at_ms + ttl_ms
        if deadline_ms <= created_at_ms:
            raise InvalidInput("expires_at", "is not in the future")
        return min(deadline_ms, created_at_ms + round(self.max_lifetime_s * 1000))

    def remind_at_ms(self, created_at_ms: int, expires_at_ms: int) -> int | None:
        """When the sweep reminds of the order: ``remind_before_s`` ahead of its expiry, if
        that is after its creation (an order created inside that window gets none)."""
        if self.remind_before_s is None or not self.expires:
            return None
        remind_at_ms = expires_at_ms - round(self.remind_before_s * 1000)
        return remind_at_ms if remind_at_ms > created_at_ms else None


def check_policy_name(value: object) -> str:
    """A policy's name as a create or the settings give it."""
    if not isinstance(value, str) or not POLICY_NAME.fullmatch(value):
        raise InvalidInput(
            "policy",
            "must be 1-64 letters, digits, '_', '.' or '-', starting with one of the first two",
        )
    return value


def check_deadline(value: object, name: str = "expires_at") -> int:
    """``expires_at`` (or the input ``name``): an aware datetime, as epoch milliseconds
    (rounded down)."""
    if not isinstance(value, datetime):
        raise InvalidInput(name, "must be a datetime")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidInput(name, "must carry a time zone (an aware datetime)")
    return (value - _EPOCH) // _ONE_MS


def checked_policies(value: object) -> dict[str, ExpiryPolicy]:
    """The settings' ``policies``: a mapping of names to :class:`ExpiryPolicy` (or to
    mappings of its fields, as JSON gives them), each checked."""
    if not isinstance(value, Mapping):
        raise InvalidInput("policies", "must map policy names to policies")
    policies: dict[str, ExpiryPolicy] = {}
    for name, given in value.items():
        try:
            check_policy_name(name)
        except InvalidInput:
            raise InvalidInput("policies", f"has a bad policy name {str(name)[:70]!r}") from None
        policy = given if isinstance(given, ExpiryPolicy) else _policy_from_mapping(name, given)
        policy.check(f"policies.{name}.")
        policies[name] = policy
    return policies


def parse_policies(text: str) -> dict[str, ExpiryPolicy]:
    """``ORDERS_POLICIES``: a JSON object, e.g.
    ``{"bank_transfer": {"ttl_s": 259200, "remind_before_s": 86400}}``."""
    try:
        loaded = json.loads(text)
    except ValueError:
        raise InvalidInput("ORDERS_POLICIES", "is not valid JSON") from None
    return checked_policies(loaded)


def _policy_from_mapping(name: str, given: object) -> ExpiryPolicy:
    if not isinstance(given, Mapping):
        raise InvalidInput(f"policies.{name}", "must be an object of the policy's fields")
    known = {f.name for f in fields(ExpiryPolicy)}
    unknown = sorted(str(key) for key in given if key not in known)
    if unknown:
        raise InvalidInput(f"policies.{name}", f"has unknown field(s) {', '.join(unknown)[:120]}")
    values: dict[str, Any] = dict(given)
    return ExpiryPolicy(**values)


def _check_seconds(name: str, value: object, *, zero: bool = False) -> None:
    """Seconds as the settings take them, and few enough to stay exact in milliseconds."""
    if check_seconds(name, value, allow_zero=zero) > MAX_TIMESTAMP_MS / 1000:
        raise InvalidInput(name, "is too large")
