"""Settings: one frozen value, read from ``ORDERS_*`` environment variables or built in code.

Nothing here connects to anything; :func:`orders.bootstrap.build_service` does that. The
connection URLs are held as :class:`SecretUrl`, which cannot print its password. redis-py
and SQLAlchemy are imported only to check a URL that was given, so reading settings (and
``orders --help``) costs neither.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn
from urllib.parse import SplitResult, parse_qsl, urlsplit

from orders.errors import InvalidInput
from orders.validation import check_count, check_seconds

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

DEFAULT_KEY_PREFIX = "UnpaidOrder-"
#: How far apart the hosts' clocks may be when one host judges another's timestamps (a
#: create's start, read on the checkout host, compared by reconcile on the scheduler's).
CLOCK_SKEW_MARGIN_S = 5.0
#: The SQL wait a create is assumed to need at most when neither the statement timeout nor
#: the busy timeout bounds it (both set to 0).
UNBOUNDED_SQL_WAIT_S = 60.0
REDIS_SCHEMES = ("redis", "rediss", "unix")
HIDDEN = "***"


class SecretUrl:
    """A connection URL (or libpq ``key=value`` DSN) that never prints its secrets.

    ``str``, ``repr`` and ``format`` show a rendering built only from whitelisted parts:
    scheme, user, host, port and path of a URL, the keys (never the values) of its query;
    host, port, dbname and user of a DSN. A part that does not look like what it should
    (a password typed without percent-encoding spills into the path) is shown as ``***``.
    :meth:`reveal` is the one way to the raw text, for handing it to a driver.
    """

    __slots__ = ("_raw", "_shown")
    _raw: str
    _shown: str

    def __init__(self, raw: str) -> None:
        if not isinstance(raw, str):
            raise TypeError("SecretUrl holds a str")
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_shown", _safe_rendering(raw))

    def reveal(self) -> str:
        """The raw URL, password included: only for the driver that connects with it."""
        return self._raw

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"SecretUrl({self._shown!r})"

    def __format__(self, spec: str) -> str:
        return format(self._shown, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SecretUrl) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash((SecretUrl, self._raw))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("SecretUrl is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("SecretUrl is immutable")

    def __reduce__(self) -> tuple[type[SecretUrl], tuple[str]]:
        return SecretUrl, (self._raw,)


@dataclass(frozen=True, slots=True)
class Settings:
    """How the service behaves. Every field has an ``ORDERS_<FIELD>`` environment variable.

    ``database_url`` None means the embedded SQLite file under ``home``; ``redis_url`` None
    means the embedded Redis server for ``home``. Both may be given as plain strings: they
    are checked and held as :class:`SecretUrl` (an empty string means None).
    """

    database_url: SecretUrl | None = None
    redis_url: SecretUrl | None = None
    #: ``redis_url`` names one node of a Redis Cluster (any node: the client finds the rest).
    redis_cluster: bool = False
    home: Path = Path(".orders")
    unpaid_limit: int = 3
    ttl_s: float = 1800.0
    max_ttl_s: float = 7 * 24 * 3600.0
    key_prefix: str = DEFAULT_KEY_PREFIX
    #: Deprecated, unused: users' keys no longer expire (reconcile removes strays). Still
    #: accepted and checked, so deployments and code that set it keep working.
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
    #: PostgreSQL: how long opening a connection may take (0 = no limit; psycopg: >= 2 s).
    sql_connect_timeout_s: float = 10.0
    #: PostgreSQL: the server ends a session of the service's engine that sits inside a
    #: transaction this long without a statement (a process frozen mid-transaction), so its
    #: row locks go. None: half of ``lease_ttl_s``; it must stay below it; 0 = no limit.
    #: Only the service's own connections carry it, not a host's passed to a use case.
    sql_idle_in_transaction_timeout_s: float | None = None
    #: PostgreSQL: the longest a statement waits for a row lock (a payment behind a
    #: sweeper's batch) before it fails with StoreUnavailable. None: ``lease_ttl_s``, longer
    #: than the idle timeout above, so a frozen holder's locks go first; 0 = no limit.
    sql_lock_timeout_s: float | None = None

    def __post_init__(self) -> None:
        # A frozen dataclass sets its own fields through object.__setattr__ too.
        object.__setattr__(self, "database_url", _secret_url("database_url", self.database_url))
        object.__setattr__(self, "redis_url", _secret_url("redis_url", self.redis_url))
        if self.database_url is not None:
            check_database_url(self.database_url.reveal())
        if self.redis_url is not None:
            check_redis_url(self.redis_url.reveal())
        if self.redis_cluster and (
            self.redis_url is None or self.redis_url.reveal().startswith("unix://")
        ):
            raise InvalidInput(
                "redis_cluster", "needs ORDERS_REDIS_URL naming a cluster node (redis://host:port)"
            )
        check_count("unpaid_limit", self.unpaid_limit, 1, 1000)
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
            check_seconds(name, getattr(self, name))
        if self.ttl_s > self.max_ttl_s:
            raise InvalidInput("ttl_s", "is above max_ttl_s")
        check_count("max_user_id_length", self.max_user_id_length, 1, 512)
        check_count("max_order_id_length", self.max_order_id_length, 1, 128)
        check_count("max_metadata_bytes", self.max_metadata_bytes, 0, 1 << 20)
        check_count("sweep_batch_size", self.sweep_batch_size, 1, 10_000)
        check_count("event_max_attempts", self.event_max_attempts, 1, 1000)
        check_count("sql_pool_size", self.sql_pool_size, 1, 1000)
        check_count("sql_max_overflow", self.sql_max_overflow, 0, 1000)
        for name in (
            "sql_pool_timeout_s",
            "sql_statement_timeout_s",
            "sql_busy_timeout_s",
            "sql_connect_timeout_s",
        ):
            check_seconds(name, getattr(self, name), allow_zero=True)
        _check_lock_timeouts(self)
        check_handler_paths("on_closed", self.on_closed)
        if not self.key_prefix or any(c in self.key_prefix for c in "{}*?[] \r\n\0"):
            raise InvalidInput("key_prefix", "must be non-empty, without spaces, {} or globs")

    @property
    def ttl_ms(self) -> int:
        return round(self.ttl_s * 1000)

    @property
    def max_ttl_ms(self) -> int:
        return round(self.max_ttl_s * 1000)

    @property
    def max_lifetime_ms(self) -> int:
        return round(self.max_lifetime_s * 1000)

    @property
    def sql_idle_in_transaction_timeout_ms(self) -> int:
        """The PostgreSQL setting in ms (0: none); see ``sql_idle_in_transaction_timeout_s``."""
        idle_s = self.sql_idle_in_transaction_timeout_s
        return round((self.lease_ttl_s / 2 if idle_s is None else idle_s) * 1000)

    @property
    def sql_lock_timeout_ms(self) -> int:
        """The PostgreSQL setting in ms (0: none); see ``sql_lock_timeout_s``."""
        lock_s = self.sql_lock_timeout_s
        return round((self.lease_ttl_s if lock_s is None else lock_s) * 1000)

    @property
    def admission_window_ms(self) -> int:
        """How long after its start a create may still be between its Redis and its SQL step.

        Past it, a member with no SQL row belongs to a create that is over (it failed, or
        its process died), so reconcile removes it. The bound adds up what a create waits
        for at most: the admission script (connect and reply, each under the Redis socket
        timeout, with one retry), then SQL (a pooled connection, opening it, and two
        statements' waits on a lock: the insert and the slot repair before its retry),
        plus :data:`CLOCK_SKEW_MARGIN_S`. 87 s with the defaults. A create slower than this
        loses its member early; the SQL guard still holds the limit, and the next reconcile
        (or the next create refused by SQL) writes the member back.
        """
        redis_s = 4 * self.redis_socket_timeout_s
        lock_wait_s = max(self.sql_statement_timeout_s, self.sql_busy_timeout_s)
        sql_s = (
            self.sql_pool_timeout_s
            + self.sql_connect_timeout_s
            + 2 * (lock_wait_s or UNBOUNDED_SQL_WAIT_S)
        )
        return round((redis_s + sql_s + CLOCK_SKEW_MARGIN_S) * 1000)

    @property
    def key_margin_ms(self) -> int:
        """Deprecated, unused (see ``key_margin_s``)."""
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

    def describe(self) -> dict[str, str]:
        """The settings as text, URLs with their passwords hidden (safe to log)."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}


def _check_lock_timeouts(settings: Settings) -> None:
    """The two PostgreSQL lock bounds: seconds or None; the idle timeout below the lease."""
    for name in ("sql_idle_in_transaction_timeout_s", "sql_lock_timeout_s"):
        if getattr(settings, name) is not None:
            check_seconds(name, getattr(settings, name), allow_zero=True)
    idle_s = settings.sql_idle_in_transaction_timeout_s
    if idle_s is not None and idle_s >= settings.lease_ttl_s:
        # A frozen sweeper must lose its locks before a standby takes its place.
        raise InvalidInput("sql_idle_in_transaction_timeout_s", "must be below lease_ttl_s")


#: ``package.module:function`` or ``package.module.function``, as the scheduler loads it.
_HANDLER_PATH = re.compile(r"[^\W\d]\w*(\.[^\W\d]\w*)*[:.][^\W\d]\w*")


def check_handler_paths(name: str, value: object) -> None:
    """Only the shape: whether each handler imports is known when the scheduler loads it."""
    if not isinstance(value, str) or not all(
        _HANDLER_PATH.fullmatch(part.strip()) for part in value.split(",") if part.strip()
    ):
        raise InvalidInput(name, "must name handlers as package.module:function, comma-separated")


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
        if kind in ("float", "float | None"):
            return float(raw)
        if kind == "Path":
            return Path(raw)
    except ValueError:
        raise InvalidInput(var, f"cannot be read as {kind}") from None
    return raw


def _secret_url(name: str, value: object) -> SecretUrl | None:
    if value is None or value == "":
        return None
    if isinstance(value, SecretUrl):
        return None if value.reveal() == "" else value
    if isinstance(value, str):
        return SecretUrl(value)
    raise InvalidInput(name, "must be a URL string")


def check_redis_url(raw: str) -> None:
    """Refuse what redis-py would refuse, without its message (which may echo the URL)."""
    scheme, sep, _ = raw.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        raise InvalidInput("redis_url", "must start with redis://, rediss:// or unix://")
    import redis.connection  # noqa: PLC0415

    try:
        redis.connection.parse_url(raw)  # type: ignore[no-untyped-call]
    except ValueError:
        raise InvalidInput("redis_url", "has a bad port, database or option") from None
    check_tls_options(scheme, dict(parse_qsl(urlsplit(raw).query)))


#: The ``ssl_*`` query options a ``rediss://`` URL may carry (redis-py's ``from_url`` hands
#: them to its TLS connection): CA file or folder, client certificate and key (and the
#: key's password), how strictly to verify, the lowest TLS version, the ciphers.
TLS_OPTIONS = frozenset(
    (
        "ssl_ca_certs",
        "ssl_ca_path",
        "ssl_certfile",
        "ssl_keyfile",
        "ssl_password",
        "ssl_cert_reqs",
        "ssl_check_hostname",
        "ssl_min_version",
        "ssl_ciphers",
    )
)
CERT_REQS = ("none", "optional", "required")


def check_tls_options(scheme: str, query: Mapping[str, str]) -> None:
    """Refuse a Redis URL's TLS options that would only fail at the first connection (or,
    worse, connect without what they ask): unknown ``ssl_*`` names, TLS options on a URL
    that is not ``rediss://``, CA and certificate files that are missing or hold no
    certificate. Whether the server's certificate verifies is known at the handshake."""
    given = {name: value for name, value in query.items() if name.startswith("ssl_")}
    for name in given:
        if name not in TLS_OPTIONS:
            shown = name if re.fullmatch(r"ssl_[a-z_]{1,40}", name) else "ssl_..."
            raise InvalidInput("redis_url", f"has an unknown TLS option {shown}")
    if given and scheme != "rediss":
        raise InvalidInput("redis_url", "has TLS options (ssl_*) but does not start rediss://")
    if given.get("ssl_cert_reqs", "required") not in CERT_REQS:
        raise InvalidInput("redis_url", "ssl_cert_reqs must be none, optional or required")
    check_tls_files(given)


def check_tls_files(given: Mapping[str, str]) -> None:
    """The CA file (or folder), client certificate and key a URL names: present, and
    loading into a TLS context as redis-py will load them."""
    import ssl  # noqa: PLC0415

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca_file, ca_path = given.get("ssl_ca_certs"), given.get("ssl_ca_path")
    if ca_file is not None and not Path(ca_file).is_file():
        raise InvalidInput("redis_url", "its ssl_ca_certs file does not exist")
    if ca_path is not None and not Path(ca_path).is_dir():
        raise InvalidInput("redis_url", "its ssl_ca_path folder does not exist")
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (ssl.SSLError, OSError):
            raise InvalidInput(
                "redis_url", "its ssl_ca_certs file holds no PEM certificate"
            ) from None
    certfile, keyfile = given.get("ssl_certfile"), given.get("ssl_keyfile")
    if keyfile is not None and certfile is None:
        raise InvalidInput("redis_url", "has ssl_keyfile without ssl_certfile")
    if certfile is not None:
        for name, path in (("ssl_certfile", certfile), ("ssl_keyfile", keyfile)):
            if path is not None and not Path(path).is_file():
                raise InvalidInput("redis_url", f"its {name} file does not exist")
        try:
            context.load_cert_chain(certfile, keyfile, given.get("ssl_password"))
        except (ssl.SSLError, OSError):
            raise InvalidInput(
                "redis_url", "its ssl_certfile and ssl_keyfile hold no certificate and its key"
            ) from None


def check_database_url(raw: str) -> URL:
    """The parsed URL, if it names a dialect and driver SQLAlchemy knows (else InvalidInput).

    Whether the driver's module is installed is only known when the engine is built.
    """
    from sqlalchemy.engine import make_url  # noqa: PLC0415
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError  # noqa: PLC0415

    try:
        url = make_url(raw)
    except (ArgumentError, ValueError):
        # from None: the parser's message may quote the URL, password included.
        raise InvalidInput(
            "database_url", "is not a SQLAlchemy URL (dialect+driver://user:pass@host/db)"
        ) from None
    try:
        url.get_dialect()
    except NoSuchModuleError:
        name = url.drivername if re.fullmatch(r"[a-z0-9_+]{1,40}", url.drivername) else "it"
        raise InvalidInput(
            "database_url", f"SQLAlchemy has no dialect or driver called {name}"
        ) from None
    return url


def redact_url(url: str) -> str:
    """``url`` as :class:`SecretUrl` shows it: safe to log."""
    return str(SecretUrl(url))


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}")
_HOST = re.compile(r"[a-z0-9._-]{1,253}|[0-9a-f:.]{2,45}")
#: A user, a path or a DSN value is shown only when made of these (and never a password).
_PLAIN = re.compile(r"[A-Za-z0-9._~/+-]{0,255}")
_QUERY_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
#: One libpq ``key = value`` pair; a value is 'quoted' or runs to whitespace, \ escapes.
_DSN_PAIR = re.compile(r"\s*([A-Za-z_]+)\s*=\s*('(?:[^'\\]|\\.)*'|(?:[^\s'\\]|\\.)*)(?=\s|$)", re.S)
_DSN_SHOWN = ("host", "port", "dbname", "user")


def _safe_rendering(raw: str) -> str:
    scheme, sep, _ = raw.partition("://")
    if not sep:
        return _safe_dsn(raw) if "=" in raw else HIDDEN
    if not _SCHEME.fullmatch(scheme):
        return HIDDEN
    try:
        parts = urlsplit(raw)
        netloc = _safe_netloc(parts)
    except ValueError:
        return f"{scheme}://{HIDDEN}"
    path = parts.path if _PLAIN.fullmatch(parts.path) else f"/{HIDDEN}"
    keys = [key for key, _ in parse_qsl(parts.query, keep_blank_values=True)]
    query = "&".join(f"{k if _QUERY_KEY.fullmatch(k) else HIDDEN}={HIDDEN}" for k in keys)
    return f"{scheme}://{netloc}{path}" + (f"?{query}" if query else "")


def _safe_netloc(parts: SplitResult) -> str:
    port = parts.port  # ValueError when it is not a number
    host = parts.hostname or ""
    if not _HOST.fullmatch(host):
        host = HIDDEN if host else ""
    elif ":" in host:
        host = f"[{host}]"
    shown = host + ("" if port is None else f":{port}")
    if "@" not in parts.netloc:
        return shown
    user = parts.username or ""
    user = user if _PLAIN.fullmatch(user) and "/" not in user else HIDDEN
    password = "" if parts.password is None else f":{HIDDEN}"
    return f"{user}{password}@{shown}"


def _safe_dsn(raw: str) -> str:
    shown, pos = [], 0
    while raw[pos:].strip():
        pair = _DSN_PAIR.match(raw, pos)
        if pair is None:
            return HIDDEN
        key, value = pair[1], pair[2]
        value = re.sub(r"\\(.)", r"\1", value[1:-1] if value.startswith("'") else value)
        if key in _DSN_SHOWN and value and _PLAIN.fullmatch(value):
            shown.append(f"{key}={value}")
        pos = pair.end()
    return " ".join(shown) or HIDDEN
