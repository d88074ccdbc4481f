"""Expiry policies as settings: built in code or read from ``ORDERS_POLICIES`` (the default
one from ``ORDERS_TTL_S`` and the like), every bad one refused with :class:`InvalidInput`
naming the policy and its field; the policy a create and an existing order follow; absolute
deadlines as milliseconds."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from orders import ExpiryPolicy
from orders.config import Settings
from orders.errors import InvalidInput
from orders.policies import NEVER_EXPIRES_MS, check_deadline

BANK = {"ttl_s": 259_200, "remind_before_s": 86_400, "late_payment_window_s": 3600}


def test_policies_from_the_environment_equal_the_same_policies_in_code() -> None:
    env = {"ORDERS_POLICIES": json.dumps({"bank": BANK, "admin": {"expires": False}})}
    read = Settings.from_env(env)
    built = Settings(policies={"bank": ExpiryPolicy(**BANK), "admin": {"expires": False}})  # type: ignore[dict-item]
    assert (
        read.policies
        == built.policies
        == {
            "bank": ExpiryPolicy(ttl_s=259_200, remind_before_s=86_400, late_payment_window_s=3600),
            "admin": ExpiryPolicy(expires=False),
        }
    )
    assert read.reminds
    assert not Settings().reminds


def test_a_create_gets_the_policy_it_names_and_the_default_one_without_a_name() -> None:
    settings = Settings(policies={"bank": ExpiryPolicy(**BANK)}, default_policy=ExpiryPolicy(900))
    assert settings.policy("bank") == ExpiryPolicy(**BANK)
    assert settings.policy(None) == ExpiryPolicy(ttl_s=900)
    with pytest.raises(InvalidInput, match=r"known: bank"):
        settings.policy("wire")
    # An order of a policy no longer configured follows the default one.
    assert settings.order_policy("wire") == settings.order_policy(None) == ExpiryPolicy(900)
    assert settings.order_policy("bank") == ExpiryPolicy(**BANK)


def test_the_default_policy_reads_its_fields_from_the_environment_and_keywords() -> None:
    read = Settings.from_env(
        {"ORDERS_TTL_S": "900", "ORDERS_REMIND_BEFORE_S": "60", "ORDERS_MAX_LIFETIME_S": "3600"},
        late_payment_window_s=30,
    )
    assert read.default_policy == ExpiryPolicy(
        ttl_s=900,
        max_ttl_s=7 * 24 * 3600,  # not following the lifetime: as ORDERS_MAX_TTL_S was
        remind_before_s=60,
        late_payment_window_s=30,
        max_lifetime_s=3600,
    )
    assert Settings().default_policy.longest_ttl_s == 7 * 24 * 3600
    assert ExpiryPolicy(ttl_s=60, max_lifetime_s=120).longest_ttl_s == 120
    # A default policy with its own reminder turns the sweep's reminders on.
    assert read.reminds


@pytest.mark.parametrize(
    ("policies", "field"),
    [
        ({"bank": {"ttl_s": 0}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": -60}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": float("nan")}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": True}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": "3d"}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": 1e300}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": 600, "remind_before_s": 600}}, "policies.bank.remind_before_s"),
        ({"bank": {"ttl_s": 600, "remind_before_s": 0}}, "policies.bank.remind_before_s"),
        ({"bank": {"ttl_s": 600, "max_lifetime_s": 599}}, "policies.bank.ttl_s"),
        ({"bank": {"ttl_s": 600, "max_ttl_s": 599}}, "policies.bank.ttl_s"),
        ({"bank": {"max_ttl_s": 0}}, "policies.bank.max_ttl_s"),
        (
            {"bank": {"late_payment_window_s": 3601, "max_lifetime_s": 3600}},
            "policies.bank.late_payment_window_s",
        ),
        ({"bank": {"late_payment_window_s": -1}}, "policies.bank.late_payment_window_s"),
        ({"bank": {"expires": "no"}}, "policies.bank.expires"),
        ({"bank": {"ttl": 600}}, "policies.bank"),
        ({"bank": 600}, "policies.bank"),
        ({"bank transfer": {}}, "policies"),
        ({"": {}}, "policies"),
        ({"x" * 65: {}}, "policies"),
        ([("bank", {})], "policies"),
    ],
    ids=lambda value: str(value)[:40] if not isinstance(value, str) else value,
)
def test_a_bad_policy_is_invalid_input_naming_the_policy_and_its_field(
    policies: object, field: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings(policies=policies)  # type: ignore[arg-type]
    assert refused.value.field == field


@pytest.mark.parametrize("text", ["bank=3d", "[1, 2]", '{"bank": {"ttl_s": -1}}', "{"])
def test_a_bad_orders_policies_variable_is_invalid_input(text: str) -> None:
    with pytest.raises(InvalidInput, match=r"(?i)polic"):
        Settings.from_env({"ORDERS_POLICIES": text})


def test_never_expires_is_the_last_millisecond_a_datetime_holds_and_exact_as_a_double() -> None:
    last = datetime.max.replace(tzinfo=UTC)
    assert check_deadline(last) == NEVER_EXPIRES_MS
    assert NEVER_EXPIRES_MS < 2**53
    assert int(float(NEVER_EXPIRES_MS)) == NEVER_EXPIRES_MS


def test_a_deadline_is_its_instant_in_milliseconds_whatever_its_time_zone() -> None:
    utc = datetime(2026, 12, 24, 17, 0, 0, 123_999, tzinfo=UTC)
    same = utc.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert check_deadline(utc) == check_deadline(same) == 1_798_131_600_123
    with pytest.raises(InvalidInput, match="time zone"):
        check_deadline(utc.replace(tzinfo=None))
