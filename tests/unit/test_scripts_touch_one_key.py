"""Every Lua script touches only the keys it is given, its KEYS[1] and, for the admission
scripts, the user's admissions hash as KEYS[2], own limit (``admit.lua``'s KEYS[3]) and
rate set (``admit.lua``'s KEYS[4], ``abandon.lua``'s KEYS[3]): on a Redis Cluster a script
may only touch keys of one slot, and one user's keys a script is what lets each user live
on any node. These share the set's slot by their names (tests/integration/test_index_keys.py);
the cluster suites run the scripts for real, and a cluster refuses a script that touches a
key of another slot (tests/integration/test_redis_cluster.py)."""

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
    assert SCRIPTS == [
        "abandon",
        "admit",
        "heartbeat",
        "lease",
        "lease_release",
        "rebuild_part",
        "rebuild_swap",
        "rebuild_units",
        "reconcile",
        "release",
        "reserve",
        "set_capacity",
    ]


#: Each script's locals for its keys, where it has more than the user's set.
KEYS_OF = {
    "abandon": {"key": "KEYS[1]", "admits": "KEYS[2]", "rate_key": "KEYS[3]"},
    "admit": {
        "key": "KEYS[1]",
        "admits": "KEYS[2]",
        "limit_key": "KEYS[3]",
        "rate_key": "KEYS[4]",
    },
    # A resource's hash and holds set share its slot (orders.index.keys.resource_keys); the
    # per-cart scripts take a pair per resource of one slot (orders.index.resources).
    "reserve": {
        "res": "KEYS[3 * i - 2]",
        "holds": "KEYS[3 * i - 1]",
        "units_key": "KEYS[3 * i]",
    },
    "release": {"res": "KEYS[i]", "holds": "KEYS[i + 1]", "units_key": "KEYS[i + 2]"},
    "rebuild_part": {"res": "KEYS[1]", "holds": "KEYS[2]"},
    "rebuild_units": {"units_key": "KEYS[1]"},
    "rebuild_swap": {
        "build": "KEYS[1]",
        "build_holds": "KEYS[2]",
        "build_units": "KEYS[3]",
        "res": "KEYS[4]",
        "holds": "KEYS[5]",
        "units_key": "KEYS[6]",
    },
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_names_its_keys_once_and_every_command_uses_them(name: str) -> None:
    code = code_of(name)

    keys = KEYS_OF.get(name, {"key": "KEYS[1]"})
    assert re.findall(r"KEYS\[[^\]]*\]", code) == list(keys.values())
    for local, key in keys.items():
        assert f"local {local} = {key}" in code
    calls = CALL.findall(code)
    assert calls, "no redis.call found: the pattern no longer matches the scripts"
    assert {key for _command, key in calls} == set(keys), calls
    # Every redis.call is one the pattern read (none with a key built some other way).
    assert len(calls) == len(re.findall(r"redis\.p?call\(", code))
