"""Pure rules: input checks, order ids, settings. No servers."""

from __future__ import annotations

import json
import logging
import math
from decimal import Decimal

import pytest

from orders.config import Settings
from orders.config.urls import redact_url
from orders.domain import Order, OrderIdGenerator, OrderStatus, ms_to_datetime
from orders.errors import InvalidInput
from orders.logs import JsonFormatter
from orders.validation import (
    check_amount,
    check_currency,
    check_limit,
    check_metadata,
    check_order_id,
    check_ttl_ms,
    check_user_id,
)

MAX_TTL_S = 7 * 24 * 3600


def test_int_user_id_becomes_its_decimal_string() -> None:
    assert check_user_id(7, 128) == "7"
    assert check_user_id("7", 128) == "7"


@pytest.mark.parametrize(
    "bad",
    [
        None,
        True,
        False,
        "",
        "   ",
        " padded",
        "x" * 129,
        "a\x00b",
        "a\r\nSET x 1",
        "a\x1bb",
        "{tag}",
        "a*",
        "a?",
        "[a]",
        "\ud800",
        3.0,
        b"bytes",
    ],
)
def test_bad_user_ids_are_refused_without_echoing_them(bad: object) -> None:
    with pytest.raises(InvalidInput) as info:
        check_user_id(bad, 128)
    assert info.value.field == "user_id"
    if isinstance(bad, str) and len(bad.strip()) > 1:
        assert bad.strip() not in str(info.value)


def test_unicode_user_ids_are_kept_exactly() -> None:
    for value in ["ünïcödé", "e\u0301", "\u00e9", "👩‍💻", "用户"]:
        assert check_user_id(value, 128) == value


def test_order_ids_must_be_strings() -> None:
    assert check_order_id("123456789012345678", 64) == "123456789012345678"
    with pytest.raises(InvalidInput):
        check_order_id(123456789012345678, 64)


@pytest.mark.parametrize(
    ("ttl_s", "expected_ms"), [(1, 1000), (0.001, 1), (1.5, 1500), (Decimal("2.25"), 2250)]
)
def test_ttl_seconds_become_whole_milliseconds(ttl_s: float, expected_ms: int) -> None:
    assert check_ttl_ms(ttl_s, MAX_TTL_S) == expected_ms


@pytest.mark.parametrize(
    "bad", [0, -1, math.nan, math.inf, -math.inf, 1e-7, True, "10", None, 1_800_000_000_000]
)
def test_bad_ttls_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInput) as info:
        check_ttl_ms(bad, MAX_TTL_S)
    assert info.value.field == "ttl_s"


def test_a_ttl_given_in_milliseconds_by_mistake_is_caught_by_the_maximum() -> None:
    with pytest.raises(InvalidInput, match="milliseconds"):
        check_ttl_ms(1_800_000, MAX_TTL_S)


@pytest.mark.parametrize("bad", [0, -3, 1001, True, 2.0, "3", None])
def test_limits_outside_1_to_1000_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInput):
        check_limit(bad)


def test_amounts_are_exact_decimals() -> None:
    assert check_amount("19.90") == Decimal("19.90")
    assert check_amount(5) == Decimal(5)
    assert check_amount(Decimal("0.00000001")) == Decimal("0.00000001")
    assert check_amount(None) is None


@pytest.mark.parametrize(
    "bad", [19.9, "-1", "NaN", "Infinity", "1e30", "0.000000001", "abc", True, [1]]
)
def test_bad_amounts_are_refused(bad: object) -> None:
    with pytest.raises(InvalidInput) as info:
        check_amount(bad)
    assert info.value.field == "amount"


@pytest.mark.parametrize("bad", ["eur", "EURO", "E1R", 978, "ÉUR"])
def test_currencies_are_three_upper_case_letters(bad: object) -> None:
    assert check_currency("EUR") == "EUR"
    with pytest.raises(InvalidInput):
        check_currency(bad)


def test_metadata_must_round_trip_through_json() -> None:
    assert check_metadata({"cart": [1, 2], "note": "é"}, 1000) == {"cart": [1, 2], "note": "é"}
    for bad in [{"x": math.nan}, {1: "int key"}, {"t": (1, 2)}, {"o": object()}, ["list"]]:
        with pytest.raises(InvalidInput):
            check_metadata(bad, 1000)
    with pytest.raises(InvalidInput, match="bytes"):
        check_metadata({"big": "x" * 2000}, 1000)


def test_generated_ids_are_unique_and_time_ordered_within_one_millisecond() -> None:
    now = [1_800_000_000_000]
    make = OrderIdGenerator(lambda: now[0])
    same_ms = [make() for _ in range(1000)]
    now[0] += 1
    later = make()
    assert len(set(same_ms)) == 1000
    assert same_ms == sorted(same_ms)
    assert later > same_ms[-1]
    assert all(len(i) == 26 for i in [*same_ms, later])


def test_order_time_left_and_datetimes() -> None:
    order = Order(
        id="o",
        user_id="u",
        status=OrderStatus.UNPAID,
        created_at_ms=1_800_000_000_000,
        expires_at_ms=1_800_000_001_500,
        read_at_ms=1_800_000_000_250,
    )
    assert order.time_left_ms == 1250
    assert order.is_open
    assert order.expires_at == ms_to_datetime(1_800_000_001_500)
    assert order.expires_at.tzinfo is not None
    assert order.expires_at.microsecond == 500_000


def test_settings_from_env_reads_orders_variables() -> None:
    settings = Settings.from_env(
        {
            "ORDERS_UNPAID_LIMIT": "5",
            "ORDERS_TTL_S": "90.5",
            "ORDERS_STRICT_EXPIRY": "yes",
            "ORDERS_KEY_PREFIX": "Unpaid:",
            "ORDERS_HOME": "/tmp/x",
        }
    )
    assert settings.unpaid_limit == 5
    assert settings.default_policy.ttl_s == 90.5
    assert settings.strict_expiry is True
    assert settings.key_prefix == "Unpaid:"
    assert str(settings.home) == "/tmp/x"


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("ORDERS_UNPAID_LIMIT", "three"),
        ("ORDERS_UNPAID_LIMIT", "0"),
        ("ORDERS_TTL_S", "nan"),
        ("ORDERS_TTL_S", "-5"),
        ("ORDERS_STRICT_EXPIRY", "maybe"),
        ("ORDERS_KEY_PREFIX", "bad{prefix}"),
    ],
)
def test_bad_settings_are_refused(var: str, value: str) -> None:
    with pytest.raises(InvalidInput):
        Settings.from_env({var: value})


def test_passwords_are_hidden_in_urls() -> None:
    assert redact_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("postgresql://app:s3cret@db/orders") == "postgresql://app:***@db/orders"
    assert redact_url("redis://host:6379/0?password=s3cret") == "redis://host:6379/0?password=***"
    assert redact_url("unix:///tmp/redis.sock") == "unix:///tmp/redis.sock"
    described = Settings(
        database_url="postgresql://app:s3cret@db/orders", redis_url="rediss://u:s3cret@r:6380"
    ).describe()
    assert "s3cret" not in repr(described)


def test_json_log_lines_merge_json_messages_and_order_fields() -> None:
    formatter = JsonFormatter()
    plain = logging.LogRecord("orders.service", logging.WARNING, "", 0, "redis down", None, None)
    plain.order_id = "o1"
    plain.user_id = "u1"
    event = logging.LogRecord(
        "orders.sweeper", logging.INFO, "", 0, '{"event": "sweep", "closed": 3}', None, None
    )
    first = json.loads(formatter.format(plain))
    second = json.loads(formatter.format(event))
    assert (first["message"], first["order_id"], first["user_id"]) == ("redis down", "o1", "u1")
    assert (second["event"], second["closed"], second["level"]) == ("sweep", 3, "info")
