"""orders.index.pipeline's plain commands packed by hand, against a real Redis."""

from __future__ import annotations

import pytest
import redis

from orders.index.pipeline import run_per_key

pytestmark = pytest.mark.every_server


def test_run_per_key_runs_the_command_on_each_key_and_returns_replies_in_key_order(
    redis_client: redis.Redis,
) -> None:
    redis_client.zadd("k1", {"old": 1, "new": 100})
    redis_client.zadd("k2", {"a": 1, "b": 2, "c": 3})
    keys = [b"k2", b"missing", b"k1"]

    replies = run_per_key(redis_client, b"ZREMRANGEBYSCORE", keys, (b"-inf", b"50"))

    assert replies == [3, 0, 1]
    assert redis_client.zrange("k1", 0, -1) == [b"new"]
    assert redis_client.exists("k2") == 0


def test_run_per_key_with_no_keys_sends_nothing(redis_client: redis.Redis) -> None:
    assert run_per_key(redis_client, b"ZREMRANGEBYSCORE", [], (b"-inf", b"1")) == []


def test_run_per_key_runs_every_call_then_raises_the_first_error_reply(
    redis_client: redis.Redis,
) -> None:
    redis_client.set("text", "not a sorted set")
    redis_client.zadd("after", {"old": 1})

    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        run_per_key(redis_client, b"ZREMRANGEBYSCORE", [b"text", b"after"], (b"-inf", b"5"))

    assert redis_client.exists("after") == 0
    # The connection went back to the pool with no reply left on it.
    assert redis_client.ping() is True


def test_run_per_key_packs_keys_and_arguments_of_any_bytes(redis_client: redis.Redis) -> None:
    key = "ключ\r\n$3".encode()
    value = b"*1\r\n\x00"

    assert run_per_key(redis_client, b"SET", [key], (value,)) == [b"OK"]

    assert redis_client.get(key) == value
