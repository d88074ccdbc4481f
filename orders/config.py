"""Settings: one frozen value, read from ``ORDERS_*`` environment variables or built in code.

Nothing here connects to anything; :func:`orders.bootstrap.build_service` does that.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from orders.errors import InvalidInput

DEFAULT_KEY_PREFIX = "UnpaidOrder-"


@dataclass(frozen=True, slots=True, repr=False)
class Settings:
    """How the service behaves. Every field has an ``ORDERS_<FIELD>`` environment variable.

    ``database_url`` None means the embedded SQLite file under ``home``; ``redis_url`` None
    means the embedded Redis server for ``home``.
    """

    database_url: str | None = None
    redis_url: str | None = None
    home: Path = Path(".orders")
    unpaid_limit: int = 3
    ttl_s: float = 1800.0
    max_ttl_s: float = 7 * 24 * 3600.0
    key_prefix: str = DEFAULT_KEY_PREFIX
    #: A user's key lives this long past its latest expiry, so abandoned keys free themselves.
    key_margin_s: float = 60.0
    max_user_id_length: int = 128
    max_order_id_length: int = 64
    max_metadata_bytes: int = 16_384
    #: Refuse (and close) a payment that arrives after ``expires_at`` but before the sweep.
    strict_expiry: bool = False
    #: When Redis is unreachable, admit orders through the SQL limit guard alone (still
    #: exact, just slower) instead of refusing them with StoreUnavailable.
    create_without_redis: bool = False
    sweep_batch_size: int = 500
    #: Dotted paths (module:function or module.function), comma-separated, of handlers the
    #: scheduler calls for each closed order, e.g. "shop.stock:release_closed_order".
    on_closed: str = ""
    #: An event consumer tries a failing event this many times in all, then parks it
    #: (kept, not retried again until ``orders events requeue``).
    event_max_attempts: int = 10
    #: extend_order and the pre-close check never move an expiry past created_at + this.
    max_lifetime_s: float = 7 * 24 * 3600.0
    #: The pre-close check (a hook asked before an expired order is closed) gets this long
    #: for each sweep batch, and may add at most max_extension_s, once per order.
    pre_close_timeout_s: float = 1.0
    max_extension_s: float = 600.0
    #: The scheduler sweeps at least this often, and sooner when an order is due sooner.
    sweep_interval_s: float = 1.0
    #: How long the active scheduler's lease lasts without renewal (failover time).
    lease_ttl_s: float = 5.0
    #: The active scheduler rebuilds the Redis index from SQL this often (and at once when
    #: Redis lost its data).
    reconcile_interval_s: float = 600.0
    #: Per Redis call; with one retry, a dead Redis is noticed within about twice this.
    redis_socket_timeout_s: float = 0.5
    sql_pool_size: int = 5
    sql_max_overflow: int = 10
    sql_pool_timeout_s: float = 10.0
    #: PostgreSQL: the server cancels a statement running longer (0 = no limit).
    sql_statement_timeout_s: float = 30.0
    #: SQLite: how long a writer waits for the write lock before giving up.
    sql_busy_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        check_int_range("unpaid_limit", self.unpaid_limit, 1, 1000)
        for name in (
            "ttl_s",
            "max_ttl_s",
            "key_margin_s",
            "redis_socket_timeout_s",
            "sweep_interval_s",
            "lease_ttl_s",
            "reconcile_interval_s",
            "max_lifetime_s",
            "pre_close_timeout_s",
            "max_extension_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise InvalidInput(name, "must be a number of seconds")
            if not math.isfinite(value) or value <= 0:
                raise InvalidInput(name, "must be a positive finite number of seconds")
        if self.ttl_s > self.max_ttl_s:
            raise InvalidInput("ttl_s", "is above max_ttl_s")
        check_int_range("max_user_id_length", self.max_user_id_length, 1, 512)
        check_int_range("max_order_id_length", self.max_order_id_length, 1, 128)
        check_int_range("max_metadata_bytes", self.max_metadata_bytes, 0, 1 << 20)
        check_int_range("sweep_batch_size", self.sweep_batch_size, 1, 10_000)
        check_int_range("event_max_attempts", self.event_max_attempts, 1, 1000)
        check_int_range("sql_pool_size", self.sql_pool_size, 1, 1000)
        check_int_range("sql_max_overflow", self.sql_max_overflow, 0, 1000)
        for name in ("sql_pool_timeout_s", "sql_statement_timeout_s", "sql_busy_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidInput(name, "must be a number of seconds")
            if not math.isfinite(value) or value < 0:
                raise InvalidInput(name, "must be a finite number of seconds, 0 or more")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}*?[] \r\n\0"):
            raise InvalidInput("key_prefix", "must be non-empty, without spaces, {} or globs")

    @property
    def ttl_ms(self) -> int:
        return round(self.ttl_s * 1000)

    @property
    def max_ttl_ms(self) -> int:
        return round(self.max_ttl_s * 1000)

    @property
    def key_margin_ms(self) -> int:
        return round(self.key_margin_s * 1000)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``ORDERS_<FIELD>`` variables; keyword ``overrides`` win over them."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = env.get(f"ORDERS_{f.name.upper()}")
            if raw is None or raw == "":
                continue
            values[f.name] = _parse(f.name, f.type, raw)
        values.update(overrides)
        return cls(**values)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={value!r}" for name, value in self.describe().items())
        return f"Settings({shown})"

    def describe(self) -> dict[str, str]:
        """The settings as text, URLs with their passwords hidden (safe to log)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_url") and value is not None:
                value = redact_url(value)
            out[f.name] = str(value)
        return out


def check_int_range(name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(name, "must be an integer")
    if not low <= value <= high:
        raise InvalidInput(name, f"must be between {low} and {high}")
    return value


def _parse(name: str, type_name: object, raw: str) -> Any:
    kind = str(type_name)
    var = f"ORDERS_{name.upper()}"
    try:
        if kind == "bool":
            lowered = raw.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        if kind == "Path":
            return Path(raw)
    except ValueError:
        raise InvalidInput(var, f"cannot be read as {kind}") from None
    return raw


def redact_url(url: str) -> str:
    """``url`` with any password (in the user part or the query) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "<unparseable url>"
    if parts.password is None and "password" not in parts.query.lower():
        return url
    netloc = parts.netloc
    if parts.password is not None:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username or ''}:***@{host}" + ("" if port is None else f":{port}")
    query = "&".join(
        f"{key}=***" if "password" in key.lower() else f"{key}={value}"
        for key, value in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
