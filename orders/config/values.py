"""Single setting values: the text of an ``ORDERS_*`` variable read as its field's type,
and the values with a syntax of their own (a create rate, event kinds, handler paths).
:mod:`orders.config` checks how the values of a :class:`~orders.config.Settings` fit
together; everything here looks at one value at a time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

from orders.config.urls import SecretUrl
from orders.domain import EventKind
from orders.errors import InvalidInput
from orders.policies import parse_policies

#: The bounds of ``Settings.create_rate``: creates per window, and the window.
CREATE_RATE_MAX_COUNT = 10**6
CREATE_RATE_MAX_WINDOW_S = 30 * 24 * 3600
_CREATE_RATE = re.compile(r"([0-9]{1,9})/([0-9]{1,9}(?:\.[0-9]{1,3})?)")


class CreateRate(NamedTuple):
    """At most ``creates`` per user in any ``window_ms`` (a sliding window)."""

    creates: int
    window_ms: int


def parse_create_rate(text: str) -> CreateRate:
    """``"10/3600"`` (creates/seconds) as a :class:`CreateRate`, or :class:`InvalidInput`."""
    found = _CREATE_RATE.fullmatch(text.strip()) if isinstance(text, str) else None
    if found is None:
        raise InvalidInput("create_rate", "must be COUNT/SECONDS, e.g. 10/3600")
    count, window_ms = int(found[1]), round(float(found[2]) * 1000)
    if not 1 <= count <= CREATE_RATE_MAX_COUNT:
        raise InvalidInput("create_rate", f"count must be between 1 and {CREATE_RATE_MAX_COUNT}")
    if not 1 <= window_ms <= CREATE_RATE_MAX_WINDOW_S * 1000:
        raise InvalidInput(
            "create_rate", f"window must be above 0 and at most {CREATE_RATE_MAX_WINDOW_S} s"
        )
    return CreateRate(count, window_ms)


def parse_event_kinds(name: str, text: object) -> frozenset[EventKind] | None:
    """Comma-separated event kinds ("closed, paid") as a set; None for "" (every kind)."""
    if not isinstance(text, str):
        raise InvalidInput(name, "must be event kinds, comma-separated")
    parts = [part.strip() for part in text.split(",") if part.strip()]
    known = {kind.value for kind in EventKind}
    if any(part not in known for part in parts):
        raise InvalidInput(name, f"must name event kinds among {', '.join(sorted(known))}")
    return frozenset(EventKind(part) for part in parts) or None


#: ``package.module:function`` or ``package.module.function``, as the scheduler loads it.
_HANDLER_PATH = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*[:.][^\W\d]\w*")


def check_handler_paths(name: str, value: object) -> None:
    """Only the shape: whether each handler imports is known when the scheduler loads it."""
    if not isinstance(value, str) or not all(
        _HANDLER_PATH.fullmatch(part.strip()) for part in value.split(",") if part.strip()
    ):
        raise InvalidInput(name, "must name handlers as package.module:function, comma-separated")


def parse_env_value(name: str, type_name: object, raw: str) -> Any:
    """The text of ``ORDERS_<NAME>`` as the field's type (named by ``type_name``, the
    dataclass field's annotation), or :class:`InvalidInput` naming the variable."""
    kind = str(type_name)
    var = f"ORDERS_{name.upper()}"
    try:
        if kind in ("bool", "bool | None"):
            lowered = raw.strip().lower()
            if kind == "bool | None" and lowered in ("", "auto"):
                return None
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind in ("float", "float | None"):
            return float(raw)
        if kind == "Path":
            return Path(raw)
        if kind == "Mapping[str, ExpiryPolicy]":
            return parse_policies(raw)
    except ValueError:
        raise InvalidInput(var, f"cannot be read as {kind}") from None
    return raw


def secret_url(name: str, value: object) -> SecretUrl | None:
    """A URL setting as a :class:`SecretUrl` (None when unset or empty)."""
    if value is None or value == "":
        return None
    if isinstance(value, SecretUrl):
        return None if value.reveal() == "" else value
    if isinstance(value, str):
        return SecretUrl(value)
    raise InvalidInput(name, "must be a URL string")
