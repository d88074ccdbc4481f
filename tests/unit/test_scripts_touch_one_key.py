"""Every Lua script touches exactly one key, its KEYS[1]: on a Redis Cluster a script may
only touch keys of one slot, and one key a script is what lets each user's key live on any
node. The cluster suites run the scripts for real; a cluster refuses a script that touches
a key of another node (tests/integration/test_redis_cluster.py)."""

from __future__ import annotations

import re
from importlib import resources

import pytest

SCRIPTS = sorted(
    path.name.removesuffix(".lua")
    for path in resources.files("orders.index").joinpath("lua").iterdir()
    if path.name.endswith(".lua")
)
CALL = re.compile(r"redis\.p?call\(\s*'([A-Z]+)'\s*,\s*([^,)]+)")


def code_of(name: str) -> str:
    text = resources.files("orders.index").joinpath("lua", f"{name}.lua").read_text("utf-8")
    return "\n".join(line.split("--", 1)[0] for line in text.splitlines())  # no comments


def test_the_scripts_are_all_found() -> None:
    assert SCRIPTS == ["admit", "heartbeat", "lease", "lease_release", "reconcile"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_names_one_key_and_every_command_uses_it(name: str) -> None:
    code = code_of(name)

    assert re.findall(r"KEYS\[[^\]]*\]", code) == ["KEYS[1]"]
    assert "local key = KEYS[1]" in code
    calls = CALL.findall(code)
    assert calls, "no redis.call found: the pattern no longer matches the scripts"
    assert {key for _command, key in calls} == {"key"}, calls
    # Every redis.call is one the pattern read (none with a key built some other way).
    assert len(calls) == len(re.findall(r"redis\.p?call\(", code))
