"""How the settings' fields fit together: the checks that read more than one field, or
turn a field into the value :class:`~orders.config.settings.Settings` keeps.

Each takes the fields it needs and returns what Settings stores, so nothing here knows the
Settings class; a wrong combination is :class:`~orders.errors.InvalidInput` naming the
field to change.
"""

from __future__ import annotations

from collections.abc import Mapping

from orders.config.urls import Secret, SecretUrl, check_webhook_secret, check_webhook_url
from orders.config.values import parse_create_rate, parse_event_kinds
from orders.errors import InvalidInput
from orders.policies import ExpiryPolicy, checked_policies
from orders.validation import check_on_limit, check_seconds


def check_rules_of_the_hold(
    create_rate: str | None,
    on_limit: str,
    default_policy: object,
    policies: Mapping[str, ExpiryPolicy],
    retention_days: float | None,
) -> Mapping[str, ExpiryPolicy]:
    """The create rate, the action at the limit and the retention; the policies checked
    (the default one names its fields as they are, ``ttl_s``: ``ORDERS_TTL_S``)."""
    if create_rate is not None:
        parse_create_rate(create_rate)
    check_on_limit(on_limit)
    if not isinstance(default_policy, ExpiryPolicy):
        raise InvalidInput("default_policy", "must be an ExpiryPolicy")
    default_policy.check()
    checked = checked_policies(policies)
    if retention_days is not None:
        check_seconds("retention_days", retention_days)
    return checked


def check_webhook(
    url: object, secret: object, kinds: str, timeout_s: float
) -> tuple[SecretUrl | None, Secret | None]:
    """The webhook's URL and secret come together (an unsigned webhook, or a secret that
    signs nothing, is a mistake); its kinds name event kinds. Returned as
    :class:`SecretUrl` and :class:`Secret`, which never print the secret."""
    raw_url = url.reveal() if isinstance(url, Secret) else url
    checked_url = None if raw_url is None or raw_url == "" else check_webhook_url(raw_url)  # type: ignore[arg-type]
    checked_secret = None if secret is None or secret == "" else check_webhook_secret(secret)
    if (checked_url is None) != (checked_secret is None):
        missing = "webhook_secret" if checked_secret is None else "webhook_url"
        raise InvalidInput(missing, "is needed: webhook_url and webhook_secret go together")
    parse_event_kinds("webhook_kinds", kinds)
    check_seconds("webhook_timeout_s", timeout_s)
    return checked_url, checked_secret


def check_lock_timeouts(idle_s: float | None, lock_s: float | None, lease_ttl_s: float) -> None:
    """The two PostgreSQL lock bounds: seconds or None; the idle timeout below the lease."""
    for name, value in (
        ("sql_idle_in_transaction_timeout_s", idle_s),
        ("sql_lock_timeout_s", lock_s),
    ):
        if value is not None:
            check_seconds(name, value, allow_zero=True)
    if idle_s is not None and idle_s >= lease_ttl_s:
        # A frozen sweeper must lose its locks before a standby takes its place.
        raise InvalidInput("sql_idle_in_transaction_timeout_s", "must be below lease_ttl_s")
