"""Malformed connection settings are InvalidInput when Settings are built, and URLs are
held in a SecretUrl that gives its raw text only through ``reveal()``."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from orders.config import Settings
from orders.config.urls import SecretUrl
from orders.errors import InvalidInput


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("redis_url", "http://:hunter2@cache:6379/0", "redis://, rediss:// or unix://"),
        ("redis_url", "REDIS://:hunter2@cache", "redis://, rediss:// or unix://"),
        ("redis_url", "cache:6379", "redis://, rediss:// or unix://"),
        ("redis_url", "redis://:hunter2@cache:port/0", "bad port"),
        ("redis_url", "redis://cache/0?socket_timeout=soon&password=hunter2", "option"),
        # TLS options only on rediss://: a unix socket never speaks TLS, so redis-py would
        # connect without what they ask for.
        ("redis_url", "unix:///run/redis.sock?ssl_cert_reqs=required", "not start rediss://"),
        ("redis_url", "redis://:hunter2@cache/0?ssl_cert_reqs=none", "not start rediss://"),
        ("redis_url", "rediss://cache/0?ssl_keyfile=/no/such.key", "ssl_keyfile without"),
        ("database_url", "not a url", "not a SQLAlchemy URL"),
        ("database_url", "host=db password=hunter2", "not a SQLAlchemy URL"),
        ("database_url", "postgresql://app:hunter2@db:port/shop", "not a SQLAlchemy URL"),
        ("database_url", "nosuchdb://app:hunter2@db/shop", "called nosuchdb"),
        ("database_url", "postgresql+nope://app:hunter2@db/shop", "called postgresql+nope"),
        ("database_url", 42, "must be a URL string"),
    ],
)
def test_a_malformed_url_is_invalid_input_naming_the_field_not_the_password(
    field: str, value: object, words: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings(**{field: value})  # type: ignore[arg-type]

    assert refused.value.field == field
    assert words in str(refused.value)
    assert "hunter2" not in str(refused.value)
    assert refused.value.__cause__ is None  # the library's message may quote the URL
    assert "\n" not in str(refused.value)


def test_from_env_refuses_a_malformed_url_too() -> None:
    with pytest.raises(InvalidInput, match="redis_url"):
        Settings.from_env({"ORDERS_REDIS_URL": "http://cache:6379"})


def test_plain_strings_are_held_as_secret_urls_and_empty_means_unset() -> None:
    settings = Settings(
        database_url="postgresql://app:hunter2@db/shop", redis_url="unix:///run/redis.sock"
    )

    assert isinstance(settings.database_url, SecretUrl)
    assert settings.database_url.reveal() == "postgresql://app:hunter2@db/shop"
    assert settings.redis_url == SecretUrl("unix:///run/redis.sock")
    assert Settings(database_url="", redis_url=SecretUrl("")).database_url is None
    assert Settings(redis_url=SecretUrl("")).redis_url is None


def test_a_secret_url_is_immutable_and_survives_copies_without_showing_its_password() -> None:
    url = SecretUrl("rediss://:hunter2@cache:6380/0")

    with pytest.raises(AttributeError):
        url._raw = "redis://other"  # type: ignore[misc]
    for twin in (copy.copy(url), copy.deepcopy(url), pickle.loads(pickle.dumps(url))):
        assert twin == url
        assert twin.reveal() == url.reveal()
    assert hash(url) == hash(SecretUrl("rediss://:hunter2@cache:6380/0"))
    settings = Settings(redis_url=url)
    assert "hunter2" not in str(dataclasses.asdict(settings))
    assert "hunter2" not in str(dataclasses.replace(settings, unpaid_limit=4))


@pytest.mark.parametrize(
    "redis_url", [None, "unix:///run/redis.sock", "unix://:hunter2@/run/redis.sock"]
)
def test_a_cluster_needs_a_url_naming_a_node_over_tcp(redis_url: str | None) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings(redis_url=redis_url, redis_cluster=True)
    assert refused.value.field == "redis_cluster"
    assert "hunter2" not in str(refused.value)
    Settings(redis_url="redis://:hunter2@cache:7000", redis_cluster=True)  # well formed


def test_the_postgresql_idle_timeout_must_stay_below_the_lease() -> None:
    # A frozen sweeper must lose its locks before a standby takes its place (the bounds a
    # session gets: tests/integration/test_pool_ping.py).
    with pytest.raises(InvalidInput, match="below lease_ttl_s"):
        Settings(lease_ttl_s=2, sql_idle_in_transaction_timeout_s=2)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"remind_before_s": 0}, "positive"),
        ({"remind_before_s": -5}, "positive"),
        ({"remind_before_s": float("nan")}, "finite"),
        ({"remind_before_s": float("inf")}, "finite"),
        ({"remind_before_s": "60"}, "number of seconds"),
        ({"remind_before_s": 1800}, "below ttl_s"),  # the default time to pay
        ({"remind_before_s": 120, "ttl_s": 60}, "below ttl_s"),
    ],
)
def test_a_reminder_offset_not_positive_finite_and_below_the_time_to_pay_is_refused(
    overrides: dict[str, object], words: str
) -> None:
    with pytest.raises(InvalidInput, match=words) as caught:
        Settings.from_env({}, **overrides)
    assert caught.value.field == "remind_before_s"


def test_the_reminder_offset_is_off_by_default_and_read_from_the_environment() -> None:
    assert Settings().default_policy.remind_before_s is None
    given = Settings.from_env({"ORDERS_REMIND_BEFORE_S": "299.5"})
    assert given.default_policy.remind_before_s == 299.5
    with pytest.raises(InvalidInput, match="below ttl_s"):
        Settings.from_env({"ORDERS_REMIND_BEFORE_S": "1800"})
    with pytest.raises(InvalidInput) as caught:
        Settings.from_env({"ORDERS_REMIND_BEFORE_S": "soon"})
    assert caught.value.field == "ORDERS_REMIND_BEFORE_S"


@pytest.mark.parametrize(
    ("raw", "chosen"), [("auto", None), ("", None), ("true", True), ("off", False)]
)
def test_combine_creates_reads_auto_as_the_engines_choice(raw: str, chosen: bool | None) -> None:
    assert Settings.from_env({"ORDERS_COMBINE_CREATES": raw}).combine_creates is chosen
