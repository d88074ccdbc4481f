"""Every Lua script touches only the keys it is given, its KEYS[1] and, for the admission
scripts, the user's admissions hash as KEYS[2] (and, for ``admit.lua``, the user's own
limit as KEYS[3]): on a Redis Cluster a script may only touch
keys of one slot, and one user's keys a script is what lets each user live on any node.
The hash shares the set's slot by its name (tests/integration/test_index_keys.py); the
cluster suites run the scripts for real, and a cluster refuses a script that touches a key
of another slot (tests/integration/test_redis_cluster.py)."""

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
    assert SCRIPTS == ["abandon", "admit", "heartbeat", "lease", "lease_release", "reconcile"]


#: The scripts that also get the user's admissions hash.
WITH_ADMITS = ("abandon", "admit")


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_names_its_keys_once_and_every_command_uses_them(name: str) -> None:
    code = code_of(name)

    keys = ["KEYS[1]", "KEYS[2]"] if name in WITH_ADMITS else ["KEYS[1]"]
    if name == "admit":
        keys.append("KEYS[3]")
    assert re.findall(r"KEYS\[[^\]]*\]", code) == keys
    assert "local key = KEYS[1]" in code
    calls = CALL.findall(code)
    assert calls, "no redis.call found: the pattern no longer matches the scripts"
    used = {key for _command, key in calls}
    if name in WITH_ADMITS:
        assert "local admits = KEYS[2]" in code
        expected = {"key", "admits"}
        if name == "admit":
            assert "local limit_key = KEYS[3]" in code
            expected.add("limit_key")
        assert used == expected, calls
    else:
        assert used == {"key"}, calls
    # Every redis.call is one the pattern read (none with a key built some other way).
    assert len(calls) == len(re.findall(r"redis\.p?call\(", code))
