"""``orders limit set|show|clear``: a user's own limit from the shell, on both engines."""

from __future__ import annotations

import json
from typing import Any

import pytest

from orders.service import OrderService

#: The keys of ``orders limit show --json``.
LIMIT_KEYS = {"user_id", "limit", "own", "updated_at", "actor_kind", "actor"}


def refused_create(run: Any, user: str) -> str:
    """``orders create USER`` at the limit: exit 4, one line on stderr, which is returned."""
    refused = run("create", user)
    assert (refused.exit_code, refused.stderr.count("\n")) == (4, 1), refused.output
    return str(refused.stderr)


def test_set_show_clear_round_trip_names_the_operator(run: Any) -> None:
    shown = run("limit", "show", "u1", "--json")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout) == {
        "user_id": "u1",
        "limit": 3,
        "own": False,
        "updated_at": None,
        "actor_kind": None,
        "actor": None,
    }

    set_ = run("--actor", "anna", "limit", "set", "u1", "1")
    assert set_.exit_code == 0, set_.output
    assert set_.stdout.startswith("u1: limit 1 (own, set ")
    assert set_.stdout.rstrip().endswith("UTC by operator:anna)")
    own = json.loads(run("limit", "show", "u1", "--json").stdout)
    assert set(own) == LIMIT_KEYS
    assert (own["limit"], own["own"], own["actor_kind"], own["actor"]) == (
        1,
        True,
        "operator",
        "anna",
    )
    assert run("create", "u1").exit_code == 0
    assert "1 open of 1" in refused_create(run, "u1")

    cleared = run("limit", "clear", "u1")
    assert cleared.exit_code == 0, cleared.output
    assert cleared.stdout == "u1: limit 3 (the settings' limit)\n"
    assert run("create", "u1").exit_code == 0


def test_limit_zero_refuses_creates_with_exit_4_saying_so(run: Any) -> None:
    assert run("limit", "set", "u1", "0").exit_code == 0
    assert "may hold no unpaid orders" in refused_create(run, "u1")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["limit", "set", "u1", "-1"], "invalid limit: must be between 0 and 1000000"),
        (["limit", "set", "u1", "1000001"], "invalid limit: must be between 0 and 1000000"),
        (["limit", "set", "u1", "abc"], "invalid limit: must be an integer"),
        (["limit", "set", "u1", "2.5"], "invalid limit: must be an integer"),
        (["limit", "set", "a*b", "2"], "invalid user_id"),
        (["limit", "show", "a*b"], "invalid user_id"),
    ],
)
def test_bad_input_is_exit_2_on_one_line_with_nothing_written(
    run: Any, service: OrderService, args: list[str], words: str
) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: ")
    assert words in result.stderr
    assert result.stderr.count("\n") == 1
    assert service.user_limit("u1").own is False


def test_history_lists_each_set_and_clear_newest_first_with_the_operator(run: Any) -> None:
    assert run("limit", "history", "u1").stdout == "u1: no own limit was ever set\n"
    assert run("--actor", "anna", "limit", "set", "u1", "1").exit_code == 0
    assert run("--actor", "ben", "limit", "clear", "u1").exit_code == 0

    shown = run("limit", "history", "u1")
    assert shown.exit_code == 0, shown.output
    newest, oldest = shown.stdout.splitlines()
    assert newest.endswith("UTC  u1: cleared by operator:ben")
    assert oldest.endswith("UTC  u1: set to 1 by operator:anna")
    rows = json.loads(run("limit", "history", "u1", "--json").stdout)
    assert [(r["limit"], r["actor_kind"], r["actor"]) for r in rows] == [
        (None, "operator", "ben"),
        (1, "operator", "anna"),
    ]
    assert set(rows[0]) == {
        "user_id",
        "limit",
        "changed_at",
        "changed_at_ms",
        "actor_kind",
        "actor",
    }


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["limit", "history", "a*b"], "invalid user_id"),
        (["limit", "history", "u1", "--limit", "0"], "invalid limit"),
    ],
)
def test_a_bad_history_request_is_exit_2_on_one_line(run: Any, args: list[str], words: str) -> None:
    result = run(*args)
    assert (result.exit_code, result.stderr.count("\n")) == (2, 1), result.output
    assert result.stderr.startswith("error: ")
    assert words in result.stderr
