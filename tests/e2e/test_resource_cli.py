"""``orders resource set|show|list``: counted resources from the shell, on both engines; bad
input is exit 2 on one line with nothing written, an unknown resource exit 3 on one line."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.sql.inventory_tables import resources_table

#: The keys of ``orders resource show --json`` (and of each row of ``list --json``).
RESOURCE_KEYS = {
    "id",
    "capacity",
    "held",
    "sold",
    "free",
    "per_user",
    "named",
    "updated_at",
    "updated_at_ms",
}


def resource_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(resources_table))]


def assert_one_error_line(result: Any, exit_code: int, words: str) -> None:
    assert (result.exit_code, result.stderr.count("\n")) == (exit_code, 1), result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert words in result.stderr
    assert result.stdout == ""


def test_set_show_and_change_name_the_operator_in_sql(run: Any, engine: Engine) -> None:
    made = run("--actor", "anna", "resource", "set", "sku:42", "--capacity", "5", "--per-user", "2")
    assert made.exit_code == 0, made.output
    assert made.stdout.startswith("sku:42: capacity 5, held 0, sold 0, free 5, per user 2 (set ")

    shown = run("resource", "show", "sku:42", "--json")
    assert shown.exit_code == 0, shown.output
    found = json.loads(shown.stdout)
    assert set(found) == RESOURCE_KEYS
    assert (found["capacity"], found["free"], found["per_user"]) == (5, 5, 2)
    with engine.connect() as conn:
        row = conn.execute(select(resources_table)).one()
    assert (row.updated_by_kind, row.updated_by) == ("operator", "anna")

    changed = run("resource", "set", "sku:42", "--capacity", "0", "--json")
    assert changed.exit_code == 0, changed.output
    assert (json.loads(changed.stdout)["capacity"], json.loads(changed.stdout)["per_user"]) == (
        0,
        None,
    )


def test_list_pages_by_id(run: Any) -> None:
    assert run("resource", "list").stdout == "no resources\n"
    for name in ["sku:2", "coupon:SPRING", "sku:1"]:
        assert run("resource", "set", name, "--capacity", "1").exit_code == 0

    first = run("resource", "list", "--limit", "2")
    assert first.exit_code == 0, first.output
    assert [line.split(":")[0:2] for line in first.stdout.splitlines()] == [
        ["coupon", "SPRING"],
        ["sku", "1"],
    ]
    rest = json.loads(run("resource", "list", "--after", "sku:1", "--json").stdout)
    assert [r["id"] for r in rest] == ["sku:2"]
    assert set(rest[0]) == RESOURCE_KEYS


def test_show_of_an_unknown_resource_is_exit_3_on_one_line(run: Any) -> None:
    assert_one_error_line(run("resource", "show", "sku:404"), 3, "no resource with that id")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["set", "sku:1", "--capacity", "-1"], "invalid capacity: must be between 0 and"),
        (["set", "sku:1", "--capacity", "2.5"], "invalid capacity: must be an integer"),
        (["set", "sku:1", "--capacity", "many"], "invalid capacity: must be an integer"),
        (["set", "sku:1"], "--capacity"),
        (["set", "sku:1", "--capacity", "5", "--per-user", "0"], "invalid per_user"),
        (["set", "sku:1", "--capacity", "5", "--per-user", "6"], "invalid per_user"),
        (["set", "sku:1", "--capacity", "5", "--per-user", "x"], "invalid per_user"),
        (["set", "", "--capacity", "5"], "invalid resource_id"),
        (["set", "s" * 129, "--capacity", "5"], "invalid resource_id"),
        (["set", "sku:\x071", "--capacity", "5"], "invalid resource_id"),
        (["set", "sku:\n1", "--capacity", "5"], "invalid resource_id"),
        (["show", ""], "invalid resource_id"),
        (["show", "s" * 129], "invalid resource_id"),
        (["show", "sku:\x1b1"], "invalid resource_id"),
        (["list", "--limit", "0"], "invalid limit"),
        (["list", "--limit", "x"], "invalid limit"),
        (["list", "--after", "sku:\x001"], "invalid resource_id"),
    ],
)
def test_bad_input_is_exit_2_on_one_line_with_nothing_written(
    run: Any, engine: Engine, args: list[str], words: str
) -> None:
    assert_one_error_line(run("resource", *args), 2, words)
    assert resource_rows(engine) == []


def test_create_with_holds_shows_them_and_a_refused_hold_is_exit_13_on_one_line(
    run: Any, engine: Engine
) -> None:
    assert run("resource", "set", "sku:1", "--capacity", "3").exit_code == 0
    assert run("resource", "set", "coupon:X", "--capacity", "1").exit_code == 0
    made = run("create", "u1", "--hold", "sku:1=2", "--hold", "coupon:X=1", "--json")
    assert made.exit_code == 0, made.output
    assert json.loads(made.stdout)["holds"] == {"coupon:X": 1, "sku:1": 2}

    refused = run("create", "u2", "--hold", "sku:1=1", "--hold", "coupon:X=1")
    assert_one_error_line(refused, 13, "coupon:X: sold_out")
    as_json = run("create", "u2", "--hold", "coupon:X=1", "--json")
    assert as_json.exit_code == 13
    assert json.loads(as_json.stdout) == {
        "error": "hold_refused",
        "resource_id": "coupon:X",
        "reason": "sold_out",
        "requested": 1,
        "free": 0,
        "units": [],
    }
    shown = run("resource", "show", "sku:1", "--json")
    assert json.loads(shown.stdout)["held"] == 2  # the refused cart took nothing


@pytest.mark.parametrize(
    ("hold", "named"),
    [
        ("sku:1", "holds"),
        ("sku:1=", "holds"),
        ("sku:1=x", "holds"),
        ("sku:1=-1", "holds"),
        ("sku:1=0", "holds"),
        ("=2", "resource_id"),
    ],
)
def test_a_bad_hold_is_exit_2_on_one_line_before_anything_is_written(
    run: Any, engine: Engine, hold: str, named: str
) -> None:
    assert run("resource", "set", "sku:1", "--capacity", "3").exit_code == 0
    refused = run("create", "u1", "--hold", hold)
    assert_one_error_line(refused, 2, f"invalid {named}")
    assert json.loads(run("resource", "show", "sku:1", "--json").stdout)["held"] == 0


def test_units_from_the_shell_are_named_held_by_name_and_shown_by_state(
    run: Any, tmp_path: Any
) -> None:
    names = tmp_path / "seats.txt"
    names.write_text("A-3\nA-4\n")
    made = run("resource", "units", "ev7", "A-1", "A-2", "--file", str(names))
    assert made.exit_code == 0, made.output
    assert made.stdout.splitlines()[0].startswith("ev7: capacity 4, held 0, sold 0, free 4")

    held = run("create", "u1", "--hold", "ev7=A-2,A-3", "--json")
    assert held.exit_code == 0, held.output
    assert json.loads(held.stdout)["holds"] == {"ev7": ["A-2", "A-3"]}
    again = run("create", "u2", "--hold", "ev7=A-3", "--json")
    assert again.exit_code == 13, again.output
    assert json.loads(again.stdout)["units"] == ["A-3"]

    shown = run("resource", "show", "ev7", "--json")
    assert json.loads(shown.stdout)["units"] == {
        "free": ["A-1", "A-4"],
        "held": ["A-2", "A-3"],
        "sold": [],
    }
    text = run("resource", "show", "ev7").stdout
    assert "  held (2): A-2 A-3" in text


def test_bad_unit_lists_are_one_line_and_write_nothing(run: Any, engine: Engine) -> None:
    twice = run("resource", "units", "ev7", "A-1", "A-1")
    assert_one_error_line(twice, 2, "twice")
    none = run("resource", "units", "ev7")
    assert_one_error_line(none, 2, "1 to 100000")
    assert resource_rows(engine) == []
