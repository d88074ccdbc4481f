"""Store and webhook URLs: checking one before anything connects, and showing one (or a
secret) without its secrets.

A database or Redis URL is held as :class:`SecretUrl`, whose ``str``, ``repr`` and
``format`` never include a password; :func:`check_redis_url` (TLS options included) and
:func:`check_database_url` refuse what redis-py or SQLAlchemy would refuse, with messages
that never echo the URL. redis-py and SQLAlchemy are imported only when a URL is checked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn
from urllib.parse import SplitResult, parse_qsl, urlsplit

from orders.errors import InvalidInput

if TYPE_CHECKING:
    from sqlalchemy.engine import URL

REDIS_SCHEMES = ("redis", "rediss", "unix")
HIDDEN = "***"


class Secret:
    """A secret string that never prints: ``str``, ``repr`` and ``format`` show ``***``.

    :meth:`reveal` is the one way to the raw text. :class:`SecretUrl` is one that shows
    the harmless parts of its URL instead.
    """

    __slots__ = ("_raw", "_shown")
    _raw: str
    _shown: str

    def __init__(self, raw: str) -> None:
        if not isinstance(raw, str):
            raise TypeError(f"{type(self).__name__} holds a str")
        object.__setattr__(self, "_raw", raw)
        object.__setattr__(self, "_shown", self.rendering(raw))

    @staticmethod
    def rendering(raw: str) -> str:
        """What ``str`` shows for ``raw``."""
        return HIDDEN

    def reveal(self) -> str:
        """The raw text: only for the code that must use it (a driver, an HMAC)."""
        return self._raw

    def __str__(self) -> str:
        return self._shown

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._shown!r})"

    def __format__(self, spec: str) -> str:
        return format(self._shown, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and type(other) is type(self) and other._raw == self._raw

    def __hash__(self) -> int:
        return hash((type(self), self._raw))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __reduce__(self) -> tuple[type[Secret], tuple[str]]:
        return type(self), (self._raw,)


class SecretUrl(Secret):
    """A connection URL (or libpq ``key=value`` DSN) that never prints its secrets.

    ``str``, ``repr`` and ``format`` show a rendering built only from whitelisted parts:
    scheme, user, host, port and path of a URL, the keys (never the values) of its query;
    host, port, dbname and user of a DSN. A part that does not look like what it should
    (a password typed without percent-encoding spills into the path) is shown as ``***``.
    :meth:`reveal` is the one way to the raw text, for handing it to a driver.
    """

    __slots__ = ()

    @staticmethod
    def rendering(raw: str) -> str:
        return _safe_rendering(raw)


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


#: The shortest HMAC key accepted (the webhook secret, the erasure key): 16 characters (a
#: key guessed offline from one signed body or one pseudonym must not be within reach).
SECRET_MIN_LENGTH = 16
WEBHOOK_SCHEMES = ("http", "https")


def check_webhook_url(raw: str) -> SecretUrl:
    """An ``http://`` or ``https://`` URL with a host and no user or password (the
    signature authenticates the sender), as a :class:`SecretUrl`; else InvalidInput."""
    if not isinstance(raw, str):
        raise InvalidInput("webhook_url", "must be a URL string")
    try:
        parts = urlsplit(raw)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        raise InvalidInput("webhook_url", "has a bad host or port") from None
    if parts.scheme not in WEBHOOK_SCHEMES:
        raise InvalidInput("webhook_url", "must start with http:// or https://")
    if not parts.hostname or not port_ok or any(c.isspace() for c in raw):
        raise InvalidInput("webhook_url", "must name a host (and a port from 1), without spaces")
    if parts.username is not None or parts.password is not None:
        raise InvalidInput("webhook_url", "must not carry a user or password")
    return SecretUrl(raw)


def check_secret(name: str, raw: object) -> Secret:
    """An HMAC key (setting ``name``): a string of at least :data:`SECRET_MIN_LENGTH`
    characters, held as a :class:`Secret`."""
    if isinstance(raw, Secret):
        raw = raw.reveal()
    if not isinstance(raw, str) or len(raw) < SECRET_MIN_LENGTH:
        raise InvalidInput(name, f"must be at least {SECRET_MIN_LENGTH} characters")
    return Secret(raw)


def check_webhook_secret(raw: object) -> Secret:
    """The HMAC key of webhook signatures (:func:`check_secret`)."""
    return check_secret("webhook_secret", raw)


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
