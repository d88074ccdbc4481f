"""``orders cancel`` and ``orders extend`` by filter, in process against the test's stores."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from orders.cli import bulk_commands
from orders.rules.bulk import DEFAULT_BATCH_SIZE
from orders.sql.models import events_table, orders_table


def create(run: Any, user: str, *args: str) -> dict[str, Any]:
    created = run("create", user, "--ttl", "600", "--json", *args)
    assert created.exit_code == 0, created.output
    return dict(json.loads(created.stdout))


def stored(database_url: str) -> tuple[list[Any], list[Any]]:
    """The order rows and the events, as SQL holds them."""
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            found = list(conn.execute(select(orders_table).order_by(orders_table.c.id)))
            written = list(conn.execute(select(events_table).order_by(events_table.c.id)))
    finally:
        engine.dispose()
    return found, written


def test_cancel_by_user_cancels_its_orders_names_the_operator_and_sums_up(
    run: Any, database_url: str
) -> None:
    mine = [create(run, "u1")["id"] for _ in range(3)]
    other = create(run, "u2")["id"]

    done = run(
        "--actor", "ops@box", "cancel", "--user", "u1", "--reason", "fraud", "--batch-size", "2"
    )

    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[-1] == (
        "cancel: 3 matched, 3 changed, 0 skipped (paid, closed or cancelled first), 0 refused"
    )
    assert "batch 2: 3 matched" in done.stdout  # no terminal: a plain line per batch
    for oid in mine:
        assert json.loads(run("show", oid, "--json").stdout)["status"] == "cancelled"
    assert json.loads(run("show", other, "--json").stdout)["status"] == "unpaid"
    _, written = stored(database_url)
    cancels = [e for e in written if e.kind == "cancelled"]
    assert sorted(e.order_id for e in cancels) == sorted(mine)
    assert {(e.actor_kind, e.actor) for e in cancels} == {("operator", "ops@box")}


def test_dry_run_prints_ids_users_and_expiries_and_changes_nothing(
    run: Any, database_url: str
) -> None:
    order = create(run, "u1")
    before = stored(database_url)

    done = run("extend", "--user", "u1", "--dry-run", "120")

    assert done.exit_code == 0, done.output
    line = next(line for line in done.stdout.splitlines() if line.startswith(order["id"]))
    assert "user u1" in line
    assert "->" in line  # the expiry now and after the extension
    assert done.stdout.splitlines()[-1] == "extend: dry run, nothing changed: 1 matched"
    assert stored(database_url) == before


def test_dry_run_json_lists_the_orders(run: Any) -> None:
    order = create(run, "u1")
    done = run("cancel", "--user", "u1", "--dry-run", "--json")
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout)
    assert (summary["matched"], summary["changed"], summary["dry_run"]) == (1, 0, True)
    assert [(o["id"], o["user_id"]) for o in summary["orders"]] == [(order["id"], "u1")]


def test_extend_by_expiring_before_moves_each_matching_expiry(run: Any) -> None:
    order = create(run, "u1")
    done = run("extend", "--expiring-before", "2100-01-01T00:00:00+00:00", "60", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["changed"] == 1
    shown = json.loads(run("show", order["id"], "--json").stdout)
    assert 659 < shown["time_left_s"] <= 660


def test_a_filter_matching_nothing_exits_0_and_says_0_matched(run: Any) -> None:
    create(run, "u1")
    done = run("cancel", "--user", "u1", "--metadata", "shop=eu")
    assert done.exit_code == 0, done.output
    assert done.stdout.splitlines()[-1].startswith("cancel: 0 matched, 0 changed")


def test_single_order_forms_work_as_before(run: Any) -> None:
    order = create(run, "u1")
    extended = run("extend", order["id"], "60", "--json")
    assert extended.exit_code == 0, extended.output
    assert json.loads(extended.stdout)["id"] == order["id"]
    cancelled = run("cancel", order["id"], "--json")
    assert cancelled.exit_code == 0, cancelled.output
    assert json.loads(cancelled.stdout)["status"] == "cancelled"


BAD: list[tuple[str, list[str], str]] = [
    ("cancel_without_order_or_filter", ["cancel"], "invalid filter"),
    ("extend_without_filter", ["extend", "60"], "invalid filter"),
    ("order_and_filter", ["cancel", "{order}", "--user", "u1"], "not both"),
    ("extend_order_and_filter", ["extend", "{order}", "60", "--user", "u1"], "not both"),
    ("dry_run_with_order", ["cancel", "{order}", "--dry-run"], "go with a filter"),
    ("bad_date", ["cancel", "--created-before", "yesterday"], "invalid created_before"),
    ("naive_date", ["cancel", "--expiring-before", "2027-01-01T00:00"], "invalid expiring_before"),
    ("metadata_without_equals", ["cancel", "--metadata", "shop"], "invalid metadata"),
    ("batch_size_zero", ["cancel", "--user", "u1", "--batch-size", "0"], "invalid batch_size"),
    ("batch_size_huge", ["extend", "--user", "u1", "--batch-size", "10001", "5"], "batch_size"),
    ("seconds_not_a_number", ["extend", "--user", "u1", "soon"], "invalid seconds"),
    ("three_arguments", ["extend", "{order}", "60", "70"], "invalid arguments"),
]


@pytest.mark.rotate("database_url")  # CI time: each case on one engine (both: --full)
@pytest.mark.parametrize(("args", "says"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_exits_2_on_one_line_and_writes_nothing(
    run: Any, database_url: str, args: list[str], says: str
) -> None:
    order = create(run, "u1")
    before = stored(database_url)
    done = run(*[a.format(order=order["id"]) for a in args])
    assert done.exit_code == 2, done.output
    assert done.stderr.count("\n") == 1
    assert says in done.stderr
    assert stored(database_url) == before


def test_the_cli_default_batch_size_is_the_services() -> None:
    assert bulk_commands.DEFAULT_BATCH_SIZE == DEFAULT_BATCH_SIZE
