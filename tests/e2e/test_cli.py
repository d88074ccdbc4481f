"""The ``orders`` command, in process (CliRunner) and as real processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from orders.cli import main
from orders.embedded.server import redis_status
from orders.sql.migrate import head_revision
from tests.support.processes import KEPT_ENV, child_env, run_orders, run_python


def test_create_show_pay_round_trip_with_json(run: Any) -> None:
    created = run("create", "u1", "--ttl", "60", "--amount", "19.90", "--currency", "EUR", "--json")
    assert created.exit_code == 0, created.output
    order = json.loads(created.stdout)
    assert (order["user_id"], order["status"], order["amount"]) == ("u1", "unpaid", "19.90")
    assert 59 < order["time_left_s"] <= 60

    listed = json.loads(run("user", "u1", "--json").stdout)
    assert [o["id"] for o in listed] == [order["id"]]

    paid = run("pay", order["id"], "--ref", "psp-1", "--json")
    assert paid.exit_code == 0, paid.output
    assert json.loads(paid.stdout)["payment_ref"] == "psp-1"
    shown = json.loads(run("show", order["id"], "--json").stdout)
    assert shown["status"] == "paid"
    assert json.loads(run("user", "u1", "--json").stdout) == []


def test_limit_reached_exits_4_with_the_retry_after_on_one_line(run: Any) -> None:
    for _ in range(3):
        assert run("create", "u1", "--ttl", "30").exit_code == 0
    refused = run("create", "u1")
    assert refused.exit_code == 4
    assert refused.stderr.count("\n") == 1
    assert "limit reached: 3 open of 3; retry in 30 s" in refused.stderr


def test_on_limit_replace_oldest_cancels_the_oldest_instead_of_exiting_4(run: Any) -> None:
    oldest = json.loads(run("create", "u1", "--limit", "1", "--json").stdout)
    created = run("create", "u1", "--limit", "1", "--on-limit", "replace_oldest", "--json")
    assert created.exit_code == 0, created.output
    shown = json.loads(run("show", oldest["id"], "--json").stdout)
    assert shown["status"] == "cancelled"
    listed = json.loads(run("user", "u1", "--json").stdout)
    assert [o["id"] for o in listed] == [json.loads(created.stdout)["id"]]


def test_create_rate_reached_exits_11_with_the_retry_after_on_one_line(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORDERS_CREATE_RATE", "2/60")
    for _ in range(2):
        created = json.loads(run("create", "u1", "--json").stdout)
        assert run("cancel", created["id"], "--reason", "test").exit_code == 0
    refused = run("create", "u1", "--json")
    assert refused.exit_code == 11
    assert refused.stderr.count("\n") == 1
    assert "create rate reached: 2 creates in 60 s; retry in 60 s" in refused.stderr
    refusal = json.loads(refused.stdout)
    assert (refusal["error"], refusal["limit"], refusal["window_s"]) == ("rate_limited", 2, 60)


def test_create_with_a_policy_or_a_deadline_and_their_bad_input_on_one_line(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    policies = {"card": {"ttl_s": 600, "max_lifetime_s": 7200}, "admin": {"expires": False}}
    monkeypatch.setenv("ORDERS_POLICIES", json.dumps(policies))
    card = json.loads(run("create", "u1", "--policy", "card", "--json").stdout)
    assert card["policy"] == "card"
    assert card["expires_at_ms"] - card_created_ms(card) == 600_000
    deadline = "2099-01-01T12:00:00.250+01:00"
    capped = json.loads(
        run("create", "u2", "--policy", "card", "--expires-at", deadline, "--json").stdout
    )
    assert capped["expires_at_ms"] == card_created_ms(capped) + 7_200_000
    held = run("create", "u3", "--policy", "admin")
    assert (held.exit_code, held.stdout.rstrip().endswith("policy admin, does not expire")) == (
        0,
        True,
    ), held.output
    for args, words in [
        (["--policy", "wire"], "invalid policy: is not a configured policy (known: admin, card)"),
        (["--expires-at", "2099-01-01T12:00:00"], "invalid expires_at: must carry a time zone"),
        (["--expires-at", "next friday"], "invalid expires_at: must be an ISO 8601 time"),
        (["--expires-at", "2001-01-01T00:00Z"], "invalid expires_at: is not in the future"),
    ]:
        refused = run("create", "u4", *args)
        assert (refused.exit_code, refused.stderr.count("\n")) == (2, 1), refused.output
        assert words in refused.stderr
    assert run("user", "u4", "--json").stdout.strip() == "[]"


def card_created_ms(shown: dict[str, Any]) -> int:
    """An order's creation in ms, from ``--json``'s ``created_at``."""
    created = datetime.fromisoformat(shown["created_at"])
    return (created - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["show", "nope"], 3, "no order"),
        (["create", "a*b"], 2, "user_id"),
        (["create", "u1", "--ttl", "-5"], 2, "ttl_s"),
        (["create", "u1", "--amount", "abc"], 2, "amount"),
        (["pay", ""], 2, "order_id"),
    ],
)
def test_errors_print_one_line_and_exit_with_their_code(
    run: Any, args: list[str], code: int, words: str
) -> None:
    result = run(*args)
    assert result.exit_code == code, result.output
    assert result.stderr.startswith("error: ")
    assert words in result.stderr
    assert result.stderr.count("\n") == 1


def test_paying_a_cancelled_order_exits_5(run: Any) -> None:
    order = json.loads(run("create", "u1", "--json").stdout)
    assert run("cancel", order["id"], "--reason", "test").exit_code == 0
    result = run("pay", order["id"])
    assert result.exit_code == 5
    assert "order is cancelled" in result.stderr


def test_paying_a_paid_order_with_another_reference_exits_6_on_one_line(run: Any) -> None:
    order = json.loads(run("create", "u1", "--json").stdout)
    assert run("pay", order["id"], "--ref", "psp-1").exit_code == 0
    result = run("pay", order["id"], "--ref", "psp-2")
    assert result.exit_code == 6, result.output
    assert result.stderr.startswith("error: order is already paid with another payment reference; ")
    assert result.stderr.endswith("refund owed: event 3, see orders payments refused\n")
    # The same reference again is a repeat, not a conflict.
    assert run("pay", order["id"], "--ref", "psp-1").exit_code == 0


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        (["u2"], "this order id belongs to another user"),
        (["u1", "--amount", "20.00"], "this order id exists with another amount or currency"),
    ],
)
def test_reusing_an_order_id_for_another_order_exits_7_on_one_line(
    run: Any, second: list[str], problem: str
) -> None:
    first = run("create", "u1", "--order-id", "checkout-1", "--amount", "19.90")
    assert first.exit_code == 0, first.output
    result = run("create", *second, "--order-id", "checkout-1")
    assert result.exit_code == 7, result.output
    assert result.stderr == f"error: invalid order_id: {problem}\n"
    # The same create again is a retry: it returns the order.
    retried = run("create", "u1", "--order-id", "checkout-1", "--amount", "19.90")
    assert retried.exit_code == 0, retried.output


def test_sweep_dry_run_counts_and_sweep_closes(run: Any, service: Any, clock: Any) -> None:
    # Orders made with the test clock lie 2027 ahead of the real one, so expire them by
    # making ones whose expiry is already in the past for the CLI's real clock.
    clock.set(1_000_000_000_000)  # 2001
    due = service.create_unpaid_order("u1", ttl_s=1)
    dry = run("sweep", "--dry-run", "--json")
    assert json.loads(dry.stdout) == {"due": 1}
    assert service.get_order(due.id).status == "unpaid"
    swept = run("sweep", "--json")
    assert json.loads(swept.stdout)["closed"] == 1
    assert service.get_order(due.id).status == "closed"


def test_sweep_max_batches_stops_early(run: Any, service: Any, clock: Any) -> None:
    clock.set(1_000_000_000_000)  # 2001: due for the CLI's real clock
    due = [service.create_unpaid_order(f"u{i}", ttl_s=1) for i in range(3)]
    swept = run("sweep", "--batch-size", "1", "--max-batches", "2", "--json")
    assert json.loads(swept.stdout)["closed"] == 2
    statuses = sorted(service.get_order(order.id).status.value for order in due)
    assert statuses == ["closed", "closed", "unpaid"]
    assert run("sweep", "--once").exit_code == 2  # the flag that meant nothing is gone


def test_version_comes_from_the_package_metadata() -> None:
    from importlib.metadata import version  # noqa: PLC0415

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"orders {version('orders')}"


def test_db_upgrade_creates_the_schema_and_other_commands_ask_for_it(tmp_path: Path) -> None:
    env = {"ORDERS_DATABASE_URL": f"sqlite:///{tmp_path}/fresh.db", "ORDERS_REDIS_URL": ""}
    runner = CliRunner()
    missing = runner.invoke(main, ["show", "x"], env=env)
    assert missing.exit_code == 8
    assert "orders db upgrade" in missing.stderr
    upgraded = runner.invoke(main, ["db", "upgrade"], env=env)
    assert upgraded.exit_code == 0, upgraded.output
    current = runner.invoke(main, ["db", "current"], env=env)
    assert current.stdout.strip() == f"database: {head_revision()}, code: {head_revision()}"


def test_help_names_the_environment_variables() -> None:
    runner = CliRunner()
    top = runner.invoke(main, ["--help"]).stdout
    for var in ("ORDERS_HOME", "ORDERS_DATABASE_URL", "ORDERS_REDIS_URL"):
        assert var in top
    assert "ORDERS_SWEEP_INTERVAL_S" in runner.invoke(main, ["scheduler", "--help"]).stdout
    assert "ORDERS_LEASE_TTL_S" in runner.invoke(main, ["scheduler", "--help"]).stdout
    assert "ORDERS_TTL_S" in runner.invoke(main, ["create", "--help"]).stdout
    assert "ORDERS_SWEEP_BATCH_SIZE" in runner.invoke(main, ["sweep", "--help"]).stdout


# --- real processes on the embedded default --------------------------------------------


def orders_process(
    home: Path, *args: str, extra_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return run_orders(*args, env=child_env(ORDERS_HOME=str(home), **(extra_env or {})))


def test_the_embedded_default_is_shared_by_processes_and_stopped_on_request(home: Path) -> None:
    created = orders_process(home, "create", "u1", "--ttl", "600", "--json")
    assert created.returncode == 0, created.stderr
    order_id = json.loads(created.stdout)["id"]
    assert (home / "orders.db").is_file()
    running = redis_status(home)
    assert running is not None  # the server outlived the process that started it

    listed = orders_process(home, "user", "u1", "--json")
    assert [o["id"] for o in json.loads(listed.stdout)] == [order_id]
    status = orders_process(home, "server", "status")
    assert status.returncode == 0
    assert f"pid {running.pid}" in status.stdout

    stopped = orders_process(home, "server", "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert redis_status(home) is None
    assert orders_process(home, "server", "status").returncode == 1


def test_reconcile_command_restores_the_index_and_reports_its_fixes(
    run: Any, service: Any, redis_client: Any
) -> None:
    service.create_unpaid_order("u1", ttl_s=600)
    service.create_unpaid_order("u2", ttl_s=600)
    redis_client.flushdb()

    dry = run("reconcile", "--dry-run", "--json")
    assert json.loads(dry.stdout)["added"] == 2
    assert redis_client.dbsize() == 0
    done = run("reconcile")
    assert done.exit_code == 0, done.output
    assert "2 added" in done.stdout
    assert len(service.index.members("u1")) == len(service.index.members("u2")) == 1


def test_extend_and_stats_commands(run: Any) -> None:
    order = json.loads(run("create", "u1", "--ttl", "60", "--json").stdout)
    extended = run("extend", order["id"], "30", "--json")
    assert extended.exit_code == 0, extended.output
    assert json.loads(extended.stdout)["expires_at_ms"] == order["expires_at_ms"] + 30_000
    found = json.loads(run("stats", "--json").stdout)
    assert found["by_status"]["unpaid"] == 1
    assert found["open_unpaid"] == 1
    shown = run("stats")
    assert shown.exit_code == 0, shown.output
    assert "backlog" in shown.stdout


#: A password in each malformed setting that must never be printed.
SECRET = "hunter2-e2e"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ORDERS_REDIS_URL", f"http://:{SECRET}@cache:6379/0"),
        ("ORDERS_REDIS_URL", f"redis://:{SECRET}@cache:port/0"),
        ("ORDERS_REDIS_URL", f"redis://:{SECRET}@cache:6379/0?socket_timeout=soon"),
        ("ORDERS_DATABASE_URL", "not a url"),
        ("ORDERS_DATABASE_URL", f"host=db password={SECRET} dbname=shop"),
        ("ORDERS_DATABASE_URL", f"nosuchdb://app:{SECRET}@db/shop"),
        ("ORDERS_DATABASE_URL", f"postgresql+nosuchdriver://app:{SECRET}@db/shop"),
        ("ORDERS_DATABASE_URL", f"postgresql://app:{SECRET}@db:port/shop"),
        ("ORDERS_DATABASE_URL", f"mysql+mysqldb://app:{SECRET}@db/shop"),
        ("ORDERS_UNPAID_LIMIT", "three"),
        ("ORDERS_UNPAID_LIMIT", "0"),
        ("ORDERS_TTL_S", "soon"),
        ("ORDERS_STRICT_EXPIRY", "maybe"),
        ("ORDERS_ON_LIMIT", "replace_newest"),
        ("ORDERS_POLICIES", '{"bank": {"ttl_s": 600, "remind_before_s": 600}}'),
        ("ORDERS_POLICIES", "bank=3d"),
    ],
)
def test_a_malformed_setting_exits_2_with_one_line_and_writes_nothing(
    home: Path, variable: str, value: str
) -> None:
    """In process (a process of its own costs a second or two each on a loaded machine):
    the one case below shows the same in a real process."""
    if value.startswith("mysql") and importlib.util.find_spec("MySQLdb") is not None:
        pytest.skip("the case needs a driver that is not installed, and MySQLdb is")
    others: dict[str, str | None] = {
        name: None for name in os.environ if name.startswith("ORDERS_") and name not in KEPT_ENV
    }

    shown = CliRunner().invoke(
        main, ["show", "x"], env={**others, "ORDERS_HOME": str(home), variable: value}
    )

    assert shown.exit_code == 2, shown.output
    assert shown.stderr.startswith("error: invalid "), shown.stderr
    assert shown.stderr.count("\n") == 1, shown.stderr
    assert "Traceback" not in shown.output
    assert SECRET not in shown.output
    assert list(home.iterdir()) == []  # refused before anything was created


def test_a_malformed_setting_in_a_real_process_is_one_line_on_stderr_and_exit_2(
    home: Path,
) -> None:
    url = f"postgresql://app:{SECRET}@db:port/shop"
    shown = orders_process(home, "show", "x", extra_env={"ORDERS_DATABASE_URL": url})

    assert (shown.returncode, shown.stdout) == (2, ""), shown.stderr
    assert shown.stderr.startswith("error: invalid database_url: "), shown.stderr
    assert shown.stderr.count("\n") == 1, shown.stderr
    assert SECRET not in shown.stderr
    assert list(home.iterdir()) == []


def test_the_cli_starts_without_importing_the_benchmark() -> None:
    """The bench is a package no other command needs: neither start-up nor --help loads it."""
    probe = (
        "import sys; from click.testing import CliRunner; from orders.cli import main; "
        "r = CliRunner().invoke(main, ['--help']); "
        "print(r.exit_code, 'bench' in r.output, 'orders.bench' in sys.modules)"
    )
    done = run_python("-c", probe, env=child_env())
    assert done.stdout.split() == ["0", "True", "False"], done.stderr


def test_pause_resume_and_pauses_on_one_line_each_and_their_refusals(run: Any) -> None:
    assert run("pauses").stdout == "never paused\n"
    refused = run("resume")
    assert (refused.exit_code, refused.stderr) == (2, "error: invalid resume: nothing is paused\n")
    paused = run("--actor", "anna", "pause", "--reason", "psp down")
    assert paused.exit_code == 0, paused.output
    assert paused.stdout.startswith("paused since ")
    assert paused.stdout.endswith(" by operator:anna: psp down\n")
    again = run("pause", "--reason", "twice")
    assert (again.exit_code, again.stderr.count("\n")) == (2, 1)
    assert "a pause is open already (since " in again.stderr
    assert "by operator:anna" in again.stderr
    created = run("create", "u1", "--json")
    assert created.exit_code == 0  # creates go on while paused
    resumed = json.loads(run("resume", "--json").stdout)
    assert (resumed["open"], resumed["shifted"], resumed["reason"]) == (False, 1, "psp down")
    listed = json.loads(run("pauses", "--json").stdout)
    assert [p["id"] for p in listed] == [resumed["id"]]
    no_reason = run("pause")
    assert no_reason.exit_code == 2


def test_prune_dry_run_counts_and_a_bad_age_is_one_line(run: Any) -> None:
    created = json.loads(run("create", "u1", "--json").stdout)
    assert run("pay", created["id"]).exit_code == 0
    counted = run("prune", "--older-than", "1s", "--dry-run")
    assert counted.exit_code == 0, counted.output
    assert counted.stdout.startswith("would delete 0 orders and 0 events last changed before ")
    for age in ("0d", "90", "ninety days"):
        refused = run("prune", "--older-than", age)
        assert (refused.exit_code, refused.stderr.count("\n")) == (2, 1), refused.output
        assert refused.stderr.startswith("error: invalid older_than: ")
    assert json.loads(run("show", created["id"], "--json").stdout)["status"] == "paid"
