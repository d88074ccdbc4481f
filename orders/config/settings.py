"""Settings: one frozen value, read from ``ORDERS_*`` environment variables or built in code.

Nothing here connects to anything; :func:`orders.bootstrap.build_service` does that. The
connection URLs are held as :class:`~orders.config.urls.SecretUrl` (kept importable from here),
which cannot print its password; :mod:`orders.config.urls` checks them. redis-py and SQLAlchemy
are imported only to check a URL that was given, so reading settings (and ``orders
--help``) costs neither.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from orders.config.checks import check_lock_timeouts, check_rules_of_the_hold, check_webhook
from orders.config.urls import (
    Secret,
    SecretUrl,
    check_database_url,
    check_redis_url,
    check_secret,
)
from orders.config.values import (
    CreateRate,
    check_handler_paths,
    parse_create_rate,
    parse_env_value,
    secret_url,
)
from orders.errors import InvalidInput
from orders.policies import ExpiryPolicy
from orders.validation import ON_LIMIT_REFUSE, check_count, check_seconds

DEFAULT_KEY_PREFIX = "UnpaidOrder-"
#: How far apart the hosts' clocks may be when one host judges another's timestamps (a
#: create's start, read on the checkout host, compared by reconcile on the scheduler's).
CLOCK_SKEW_MARGIN_S = 5.0
#: The SQL wait a create is assumed to need at most when neither the statement timeout nor
#: the busy timeout bounds it (both set to 0).
UNBOUNDED_SQL_WAIT_S = 60.0
#: The default policy without ``ORDERS_TTL_S`` and the like: :class:`ExpiryPolicy`'s own
#: defaults, but the longest ``ttl_s`` a create may ask for stays 7 days whatever
#: ``ORDERS_MAX_LIFETIME_S`` says.
DEFAULT_POLICY = ExpiryPolicy(max_ttl_s=7 * 24 * 3600.0)


@dataclass(frozen=True, slots=True)
class Settings:
    """How the service behaves. Every field has an ``ORDERS_<FIELD>`` environment variable,
    but ``default_policy``, whose fields have theirs (``ORDERS_TTL_S``, ...; not ``expires``).

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
    #: How an order created without ``policy=`` expires: its time to pay, the longest one a
    #: create may ask for, its reminder (the sweep's ``expiring`` event, once per order),
    #: late-payment window and maximum lifetime (:class:`~orders.policies.ExpiryPolicy`).
    default_policy: ExpiryPolicy = DEFAULT_POLICY
    key_prefix: str = DEFAULT_KEY_PREFIX
    max_user_id_length: int = 128
    max_order_id_length: int = 64
    max_metadata_bytes: int = 16_384
    #: Refuse (and close) a payment that arrives after ``expires_at`` but before the sweep.
    strict_expiry: bool = False
    #: When Redis is unreachable, admit orders through the SQL limit guard alone (still
    #: exact, just slower) instead of refusing them with StoreUnavailable.
    create_without_redis: bool = False
    #: Concurrent creates of one process share one Redis round trip per node and one SQL
    #: commit (:mod:`orders.rules.combining`); a create alone never waits. None (the
    #: default): on SQLite, where it measured no slower at 1 and 8 callers and faster at
    #: 64, and off on PostgreSQL, where 8 callers ran slower combined (docs/bench.md).
    combine_creates: bool | None = None
    #: The same for payments, cancels and extensions, on SQLite only: one transaction
    #: and commit for those in flight together (:mod:`orders.rules.transition`).
    combine_transitions: bool = True
    sweep_batch_size: int = 500
    #: Dotted paths (module:function or module.function), comma-separated, of handlers the
    #: scheduler calls for each closed order, e.g. "shop.stock:release_closed_order".
    on_closed: str = ""
    #: The same for each refused payment (a refund owed), e.g. "shop.refunds:issue".
    on_payment_refused: str = ""
    #: An event consumer tries a failing event this many times in all, then parks it
    #: (kept, not retried again until ``orders events requeue``).
    event_max_attempts: int = 10
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
    #: orders.aio: the threads that run its calls (the SQL pool is at least this large).
    aio_threads: int = 8
    #: orders.aio: calls that may wait for a thread beyond those running; one more is
    #: refused at once with :class:`~orders.errors.Overloaded`.
    aio_queue: int = 1024
    #: At most COUNT creates per user in any SECONDS, a sliding window ("10/3600"); None:
    #: no rate. Kept in Redis only (:attr:`create_rate_limit` is the parsed value).
    create_rate: str | None = None
    #: At the limit, a create is refused ("refuse") or cancels the user's oldest unpaid
    #: order to take its place ("replace_oldest"); a create's ``on_limit`` overrides it.
    on_limit: str = ON_LIMIT_REFUSE
    #: Named expiry policies a create may pick (``policy=``), beside ``default_policy``;
    #: one may be for orders that do not expire. From the environment: a JSON object,
    #: ``{"bank_transfer": {"ttl_s": 259200, "remind_before_s": 86400}}``.
    policies: Mapping[str, ExpiryPolicy] = field(default_factory=dict)
    #: The active scheduler prunes paid, cancelled and closed orders (and their events)
    #: this many days after their last transition, keeping any still needed (a refund owed,
    #: an event a consumer has not read); None: never (``orders prune`` by hand).
    retention_days: float | None = None
    #: The scheduler POSTs events, signed, to this http(s) URL (orders.events.webhooks);
    #: None: no webhooks. Needs ``webhook_secret``.
    webhook_url: SecretUrl | None = None
    #: The HMAC-SHA256 key of the ``Orders-Signature`` header, 16 characters at least;
    #: held as a :class:`~orders.config.urls.Secret` (never printed).
    webhook_secret: Secret | None = None
    #: Comma-separated event kinds the webhook gets ("closed,payment_refused"); empty: all.
    webhook_kinds: str = ""
    #: How long a webhook POST may wait to connect, and for each read of the answer.
    webhook_timeout_s: float = 5.0
    #: The HMAC-SHA256 key of erasure pseudonyms (``erase_user``), 16 characters at least;
    #: held as a :class:`~orders.config.urls.Secret` (never printed). None: erasure is refused.
    erasure_key: Secret | None = None

    def __post_init__(self) -> None:
        # A frozen dataclass sets its own fields through object.__setattr__ too.
        object.__setattr__(self, "database_url", secret_url("database_url", self.database_url))
        object.__setattr__(self, "redis_url", secret_url("redis_url", self.redis_url))
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
            "redis_socket_timeout_s",
            "sweep_interval_s",
            "lease_ttl_s",
            "reconcile_interval_s",
            "pre_close_timeout_s",
            "max_extension_s",
            "sql_pool_timeout_s",
            "sql_statement_timeout_s",
            "sql_busy_timeout_s",
            "sql_connect_timeout_s",
        ):
            # A SQL wait of 0 is allowed: no limit (the statement, the connect) or no wait.
            check_seconds(name, getattr(self, name), allow_zero=name.startswith("sql_"))
        check_count("max_user_id_length", self.max_user_id_length, 1, 512)
        check_count("max_order_id_length", self.max_order_id_length, 1, 128)
        check_count("max_metadata_bytes", self.max_metadata_bytes, 0, 1 << 20)
        check_count("sweep_batch_size", self.sweep_batch_size, 1, 10_000)
        check_count("event_max_attempts", self.event_max_attempts, 1, 1000)
        check_count("sql_pool_size", self.sql_pool_size, 1, 1000)
        check_count("sql_max_overflow", self.sql_max_overflow, 0, 1000)
        check_count("aio_threads", self.aio_threads, 1, 256)
        check_count("aio_queue", self.aio_queue, 0, 1_000_000)
        check_lock_timeouts(
            self.sql_idle_in_transaction_timeout_s, self.sql_lock_timeout_s, self.lease_ttl_s
        )
        check_handler_paths("on_closed", self.on_closed)
        check_handler_paths("on_payment_refused", self.on_payment_refused)
        policies = check_rules_of_the_hold(
            self.create_rate, self.on_limit, self.default_policy, self.policies, self.retention_days
        )
        object.__setattr__(self, "policies", policies)
        if not self.key_prefix or any(c in self.key_prefix for c in "{}*?[] \r\n\0"):
            raise InvalidInput("key_prefix", "must be non-empty, without spaces, {} or globs")
        webhook = check_webhook(
            self.webhook_url, self.webhook_secret, self.webhook_kinds, self.webhook_timeout_s
        )
        object.__setattr__(self, "webhook_url", webhook[0])
        object.__setattr__(self, "webhook_secret", webhook[1])
        key = self.erasure_key
        object.__setattr__(
            self,
            "erasure_key",
            None if key is None or key == "" else check_secret("erasure_key", key),
        )

    def policy(self, name: str | None) -> ExpiryPolicy:
        """The policy a create names (None: the default one); :class:`InvalidInput` for a
        name the settings do not hold."""
        found = self.default_policy if name is None else self.policies.get(name)
        if found is None:
            known = ", ".join(sorted(self.policies)) or "none configured"
            raise InvalidInput("policy", f"is not a configured policy (known: {known[:200]})")
        return found

    def order_policy(self, name: str | None) -> ExpiryPolicy:
        """The policy an existing order follows: the one it names, or the default one when
        it names none or one no longer configured."""
        return self.policies.get(name, self.default_policy) if name else self.default_policy

    @property
    def create_rate_limit(self) -> CreateRate | None:
        """``create_rate`` parsed (checked when the settings were made), or None."""
        return None if self.create_rate is None else parse_create_rate(self.create_rate)

    @property
    def reminds(self) -> bool:
        """Whether the sweep writes reminders: the default policy or a named one sets one."""
        return any(
            policy.remind_before_s is not None
            for policy in (self.default_policy, *self.policies.values())
        )

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``ORDERS_<FIELD>`` variables, those of the default policy's fields too
        (``ORDERS_TTL_S``, ...); keyword ``overrides`` (``ttl_s=60`` too) win over them."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in (*fields(cls), *fields(ExpiryPolicy)):
            raw = env.get(f"ORDERS_{f.name.upper()}")
            if raw and f.name not in ("default_policy", "expires"):
                values[f.name] = parse_env_value(f.name, f.type, raw)
        values.update(overrides)
        own = {f.name: values.pop(f.name) for f in fields(ExpiryPolicy) if f.name in values}
        if own:
            values["default_policy"] = replace(values.get("default_policy", DEFAULT_POLICY), **own)
        return cls(**values)

    def describe(self) -> dict[str, str]:
        """The settings as text, URLs with their passwords hidden (safe to log)."""
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}
