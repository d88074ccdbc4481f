"""``orders waiting add|show|leave``: waiting lists from the shell, on both engines; bad
input is exit 2 on one line with nothing written, an unknown resource or entry exit 3."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import Engine, select

from orders.sql.inventory_tables import waiting_table

#: The keys of an entry in ``--json``.
ENTRY_KEYS = {
    "id",
    "resource_id",
    "user_id",
    "quantity",
    "status",
    "order_id",
    "created_at_ms",
    "created_at",
    "until_ms",
    "until",
    "ended_at_ms",
    "ended_at",
}


def waiting_rows(engine: Engine) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(select(waiting_table))]


def assert_one_error_line(result: Any, exit_code: int, words: str) -> None:
    assert (result.exit_code, result.stderr.count("\n")) == (exit_code, 1), result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert words in result.stderr
    assert result.stdout == ""


def test_add_show_and_leave_name_the_operator(run: Any, engine: Engine) -> None:
    assert run("resource", "set", "ev:1", "--capacity", "1").exit_code == 0
    assert run("create", "u0", "--hold", "ev:1=1").exit_code == 0  # sold out
    added = run("--actor", "anna", "waiting", "add", "u1", "ev:1", "--json")
    assert added.exit_code == 0, added.output
    entry = json.loads(added.stdout)
    assert set(entry) == ENTRY_KEYS
    assert (entry["user_id"], entry["quantity"], entry["status"]) == ("u1", 1, "waiting")
    later = run("waiting", "add", "u2", "ev:1", "--until", "2999-01-01T00:00+01:00")
    assert later.exit_code == 0, later.output
    assert later.stdout.startswith("#")
    assert "u2: 1 of ev:1, waiting" in later.stdout

    shown = run("waiting", "show", "ev:1", "--json")
    assert [e["user_id"] for e in json.loads(shown.stdout)] == ["u1", "u2"]
    assert json.loads(shown.stdout)[1]["until"] == "2998-12-31T23:00:00+00:00"
    text = run("waiting", "show", "ev:1").stdout.splitlines()
    assert [line.split()[1] for line in text] == ["u1:", "u2:"]
    with engine.connect() as conn:
        row = conn.execute(select(waiting_table).where(waiting_table.c.user_id == "u1")).one()
    assert (row.added_by_kind, row.added_by) == ("operator", "anna")

    left = run("waiting", "leave", str(entry["id"]))
    assert left.exit_code == 0, left.output
    assert "left" in left.stdout
    assert [e["user_id"] for e in json.loads(run("waiting", "show", "ev:1", "--json").stdout)] == [
        "u2"
    ]


def test_a_capacity_raised_from_the_shell_serves_the_queue(run: Any) -> None:
    assert run("resource", "set", "ev:1", "--capacity", "0").exit_code == 0
    assert run("waiting", "add", "u1", "ev:1").exit_code != 0  # quantity above capacity 0
    assert run("resource", "set", "ev:1", "--capacity", "1").exit_code == 0

    served = json.loads(run("waiting", "add", "u1", "ev:1", "--json").stdout)

    assert (served["status"], served["order_id"]) == ("served", f"waiting-{served['id']}")
    assert run("waiting", "show", "ev:1").stdout == "nobody waits for ev:1\n"


def test_bad_input_is_one_line_and_a_nonzero_exit_with_nothing_written(
    run: Any, engine: Engine
) -> None:
    assert run("resource", "set", "ev:1", "--capacity", "2").exit_code == 0
    cases = [
        (("waiting", "add", "u1", "ev:1", "--quantity", "0"), 2, "quantity"),
        (("waiting", "add", "u1", "ev:1", "--quantity", "-1"), 2, "quantity"),
        (("waiting", "add", "u1", "ev:1", "--quantity", "3"), 2, "capacity"),
        (("waiting", "add", "u1", "ev:1", "--quantity", "x"), 2, "integer"),
        (("waiting", "add", "u1", "ev:1", "--until", "tomorrow"), 2, "ISO 8601"),
        (("waiting", "add", "u1", "ev:1", "--until", "2999-01-01T00:00"), 2, "time zone"),
        (("waiting", "add", "u1", "ev:1", "--until", "2000-01-01T00:00Z"), 2, "ahead"),
        (("waiting", "add", "u1", "ev:404"), 3, "no resource"),
        (("waiting", "show", "ev:404"), 3, "no resource"),
        (("waiting", "leave", "404"), 3, "no waiting-list entry"),
        (("waiting", "leave", "abc"), 2, "integer"),
        (("waiting", "leave", "0"), 2, "entry_id"),
    ]
    for args, code, words in cases:
        assert_one_error_line(run(*args), code, words)
    assert waiting_rows(engine) == []
