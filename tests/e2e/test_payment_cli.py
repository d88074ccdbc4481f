"""The operator's side of refused payments and actors: ``--actor`` on every write,
``orders pay --amount``, ``orders payments refused`` and ``orders payments handled``."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from orders.domain import Actor, ActorKind, EventKind
from orders.errors import OrderClosed
from orders.service import OrderService
from tests.support.clocks import ManualClock

#: 2001-01-01T00:00:00Z: before the CLI's real clock, so orders made then are due for it.
Y2001_MS = 978_307_200_000
DAY_MS = 86_400_000
HOUR_MS = 3_600_000
#: The keys of one row of ``orders payments refused --json``.
REFUSAL_KEYS = {
    "order_id",
    "user_id",
    "payment_ref",
    "reason",
    "amount",
    "currency",
    "refused_at",
    "refused_at_ms",
    "event",
    "handled",
    "handled_at",
    "handled_at_ms",
    "handled_by",
}


def actors(service: OrderService, order_id: str) -> list[tuple[str, Actor | None]]:
    return [(e.kind, e.actor) for e in service.iter_events(limit=1000) if e.order_id == order_id]


def refused_for(service: OrderService, order_id: str, ref: str) -> None:
    """A payment ``ref`` for the cancelled (or closed) order, refused by the service."""
    with pytest.raises(OrderClosed):
        service.mark_paid(order_id, payment_ref=ref, amount="5.00", currency="EUR")


def refusals(run: Any, *args: str) -> list[dict[str, Any]]:
    listed = run("payments", "refused", "--json", *args)
    assert listed.exit_code == 0, listed.output
    rows: list[dict[str, Any]] = json.loads(listed.stdout)
    return rows


# --- who did it ----------------------------------------------------------------------------


@pytest.mark.parametrize("given", [None, "ann@ops"], ids=["default", "--actor"])
def test_every_write_through_the_cli_names_the_operator(
    run: Any,
    service: OrderService,
    clock: ManualClock,
    monkeypatch: pytest.MonkeyPatch,
    given: str | None,
) -> None:
    monkeypatch.setenv("LOGNAME", "ann")  # getpass.getuser() reads it first
    operator = Actor(ActorKind.OPERATOR, f"ann@{socket.gethostname()}" if given is None else given)
    actor_args = [] if given is None else ["--actor", given]

    def cli(*args: str) -> dict[str, Any]:
        done = run(*actor_args, *args, "--json")
        assert done.exit_code == 0, done.output
        result: dict[str, Any] = json.loads(done.stdout)
        return result

    paid = cli("create", "u1", "--ttl", "600")["id"]
    cli("extend", paid, "60")
    cli("pay", paid, "--ref", "psp-1")
    cancelled = cli("create", "u2")["id"]
    cli("cancel", cancelled)
    clock.set(Y2001_MS)  # made by the application, long due for the CLI's sweep
    swept = service.create_unpaid_order("u3", ttl_s=1).id
    assert cli("sweep")["closed"] == 1

    assert actors(service, paid) == [
        (EventKind.CREATED, operator),
        (EventKind.EXTENDED, operator),
        (EventKind.PAID, operator),
    ]
    assert actors(service, cancelled) == [
        (EventKind.CREATED, operator),
        (EventKind.CANCELLED, operator),
    ]
    assert actors(service, swept) == [
        (EventKind.CREATED, Actor(ActorKind.APPLICATION)),
        (EventKind.CLOSED, operator),
    ]


@pytest.mark.rotate("database_url")
@pytest.mark.parametrize(
    "bad", ["x" * 129, "ann\x07", " ann", ""], ids=["too-long", "control", "space", "empty"]
)
@pytest.mark.parametrize(
    "args",
    [
        ["create", "u9"],
        ["pay", "{order}", "--ref", "psp-9"],
        ["cancel", "{order}"],
        ["extend", "{order}", "60"],
        ["sweep"],
        ["payments", "handled", "{order}", "--ref", "psp-1"],
        ["events", "requeue", "stock", "1"],
        ["show", "{order}"],  # even a read: the option is checked before any command runs
    ],
    ids=lambda args: "-".join(a for a in args if not a.startswith("{"))[:30],
)
def test_a_refused_actor_is_exit_2_on_one_line_with_nothing_written(
    run: Any, service: OrderService, clock: ManualClock, bad: str, args: list[str]
) -> None:
    clock.set(Y2001_MS)  # due for the CLI's sweep, so a sweep would write if it ran
    order = service.create_unpaid_order("u1", ttl_s=1)
    service.cancel_order(service.create_unpaid_order("u2").id)
    before = service.iter_events(limit=1000)

    done = run("--actor", bad, *[a.format(order=order.id) for a in args])

    assert done.exit_code == 2, done.output
    assert done.stderr.startswith("error: invalid actor: ")
    assert done.stderr.count("\n") == 1
    assert done.stdout == ""
    assert service.iter_events(limit=1000) == before
    assert service.get_order(order.id) == order


def test_an_actor_at_the_length_limit_is_recorded_whole(run: Any, service: OrderService) -> None:
    name = "o" * 128
    created = run("--actor", name, "create", "u1", "--json")
    assert created.exit_code == 0, created.output
    order_id = json.loads(created.stdout)["id"]
    assert actors(service, order_id) == [(EventKind.CREATED, Actor(ActorKind.OPERATOR, name))]


# --- orders pay --amount ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("paid", "reason"),
    [
        (["--amount", "19.00", "--currency", "EUR"], "amount_mismatch"),
        (
            ["--amount", "19.90", "--currency", "USD"],
            "currency_mismatch",
        ),
    ],
)
def test_pay_with_another_amount_or_currency_exits_10_and_records_the_refund(
    run: Any, service: OrderService, paid: list[str], reason: str
) -> None:
    created = run("create", "u1", "--amount", "19.90", "--currency", "EUR", "--json")
    order_id = json.loads(created.stdout)["id"]

    refused = run("pay", order_id, "--ref", "psp-1", *paid)

    assert refused.exit_code == 10, refused.output
    assert refused.stderr.count("\n") == 1
    assert refused.stderr.startswith("error: the payment's ")
    [event] = [e for e in service.iter_events(limit=100) if e.kind == "payment_refused"]
    assert refused.stderr.endswith(f"refund owed: event {event.id}, see orders payments refused\n")
    assert service.get_order(order_id).status == "unpaid"
    [row] = refusals(run)
    assert (row["order_id"], row["reason"], row["handled"]) == (order_id, reason, False)
    assert (row["amount"], row["currency"]) == (paid[1], paid[3])
    assert row["event"]["event_id"] == event.id

    right = run("pay", order_id, "--ref", "psp-2", "--amount", "19.9", "--currency", "EUR")
    assert right.exit_code == 0, right.output
    assert service.get_order(order_id).status == "paid"


def test_pay_amount_is_compared_with_the_orders_as_a_number(
    run: Any, service: OrderService
) -> None:
    order_id = json.loads(run("create", "u1", "--amount", "10", "--json").stdout)["id"]
    assert run("pay", order_id, "--amount", "10.01").exit_code == 10
    assert run("pay", order_id, "--amount", "10.00").exit_code == 0
    assert service.get_order(order_id).status == "paid"


# --- orders payments refused / handled --------------------------------------------------------


@pytest.fixture
def two_refusals(service: OrderService, clock: ManualClock) -> tuple[str, str]:
    """Two cancelled orders, each with a refused payment: ``psp-1`` on 2001-01-01 00:00,
    ``psp-2`` on 2001-01-03 00:00 (UTC)."""
    first = service.create_unpaid_order("u1", amount="5.00", currency="EUR")
    second = service.create_unpaid_order("u2", amount="5.00", currency="EUR")
    service.cancel_order(first.id)
    service.cancel_order(second.id)
    clock.set(Y2001_MS)
    refused_for(service, first.id, "psp-1")
    clock.set(Y2001_MS + 2 * DAY_MS)
    refused_for(service, second.id, "psp-2")
    return first.id, second.id


def test_refused_lists_the_refunds_owed_as_json_oldest_first(
    run: Any, two_refusals: tuple[str, str]
) -> None:
    first, second = two_refusals
    rows = refusals(run)

    assert [(r["order_id"], r["payment_ref"]) for r in rows] == [
        (first, "psp-1"),
        (second, "psp-2"),
    ]
    assert all(set(r) == REFUSAL_KEYS for r in rows)
    assert rows[0] | {"event": None} == {
        "order_id": first,
        "user_id": "u1",
        "payment_ref": "psp-1",
        "reason": "cancelled",
        "amount": "5.00",
        "currency": "EUR",
        "refused_at": "2001-01-01T00:00:00+00:00",
        "refused_at_ms": Y2001_MS,
        "event": None,
        "handled": False,
        "handled_at": None,
        "handled_at_ms": None,
        "handled_by": None,
    }
    assert set(rows[0]["event"]) == {"txid", "event_id"}
    assert rows[0]["event"]["event_id"] < rows[1]["event"]["event_id"]
    assert [r["order_id"] for r in refusals(run, "--limit", "1")] == [first]
    cut = run("payments", "refused", "--limit", "1").stdout.splitlines()
    assert cut[-1] == "the oldest 1 shown: --since or --limit for the others"
    assert "the oldest" not in run("payments", "refused", "--limit", "3").stdout


@pytest.mark.parametrize(
    ("since", "listed"),
    [
        ("2001-01-02T00:00:00", ["psp-2"]),
        ("2001-01-02T01:00:00+01:00", ["psp-2"]),  # the same instant
        ("2001-01-01", ["psp-1", "psp-2"]),  # at or after
        ("2001-01-01T00:00:00.001Z", ["psp-2"]),
        ("2001-01-03T00:00:00.001Z", []),
    ],
)
def test_refused_since_an_iso_time_lists_those_refused_at_or_after_it(
    run: Any, two_refusals: tuple[str, str], since: str, listed: list[str]
) -> None:
    assert [r["payment_ref"] for r in refusals(run, "--since", since)] == listed


def test_refused_since_a_duration_counts_back_from_now(
    run: Any, service: OrderService, clock: ManualClock
) -> None:
    # The CLI reads the real clock: refusals 3 h and 1 h before it (hours of margin).
    now_ms = time.time_ns() // 1_000_000
    for ref, ago_ms in (("psp-3h", 3 * HOUR_MS), ("psp-1h", HOUR_MS)):
        order = service.create_unpaid_order(f"u-{ref}")
        service.cancel_order(order.id)
        clock.set(now_ms - ago_ms)
        refused_for(service, order.id, ref)

    def since(text: str) -> list[str]:
        return [r["payment_ref"] for r in refusals(run, "--since", text)]

    assert since("2h") == ["psp-1h"]
    assert since("120m") == ["psp-1h"]
    assert since("7200s") == ["psp-1h"]
    assert since("1d") == ["psp-3h", "psp-1h"]
    assert since("30m") == []
    assert since("999999999999d") == ["psp-3h", "psp-1h"]  # before 1970: everything


@pytest.mark.parametrize(
    "since", ["yesterday", "2 h", "-2h", "2H", "2w", "", "1.5h", "2001-13-01", "h"]
)
def test_refused_with_a_malformed_since_is_exit_2_on_one_line(run: Any, since: str) -> None:
    done = run("payments", "refused", "--since", since)
    assert done.exit_code == 2, done.output
    assert done.stderr == (
        "error: invalid since: must be a duration (30m, 2h, 7d) or an ISO-8601 time\n"
    )


def test_handled_marks_a_refund_and_it_leaves_the_pending_list(
    run: Any, two_refusals: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = two_refusals
    assert [r["order_id"] for r in refusals(run, "--pending")] == [first, second]

    marked = run("--actor", "ann@ops", "payments", "handled", first, "--ref", "psp-1", "--json")

    assert marked.exit_code == 0, marked.output
    row = json.loads(marked.stdout)
    assert set(row) == REFUSAL_KEYS
    assert (row["order_id"], row["payment_ref"], row["handled"]) == (first, "psp-1", True)
    assert row["handled_by"] == {"kind": "operator", "name": "ann@ops"}
    handled_at = datetime.fromisoformat(row["handled_at"])
    assert handled_at.tzinfo == UTC
    assert abs(row["handled_at_ms"] - time.time() * 1000) < HOUR_MS  # the CLI's real clock
    assert [r["order_id"] for r in refusals(run, "--pending")] == [second]
    assert [r["handled"] for r in refusals(run)] == [True, False]

    # Again, by someone else: the first handler is kept.
    again = run("--actor", "bob@ops", "payments", "handled", first, "--ref", "psp-1")
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith(f"refund of {first} (ref psp-1) marked handled: ")
    assert "operator:ann@ops" in again.stdout
    assert refusals(run)[0]["handled_by"] == {"kind": "operator", "name": "ann@ops"}

    monkeypatch.setenv("COLUMNS", "200")  # rich's table: one line per row
    table = run("payments", "refused").stdout
    [first_line] = [line for line in table.splitlines() if first in line]
    [second_line] = [line for line in table.splitlines() if second in line]
    assert "operator:ann@ops" in first_line
    assert "owed" not in first_line
    assert "owed" in second_line
    assert "5.00 EUR" in second_line
    assert "2001-01-03 00:00:00" in second_line
    pending = run("payments", "refused", "--pending").stdout
    assert first not in pending
    assert second in pending


@pytest.mark.parametrize(
    "args",
    [["--ref", "psp-2"], [], ["--ref", "nope"]],
    ids=["another-orders-ref", "no-ref", "unknown-ref"],
)
def test_handled_for_no_such_refusal_is_exit_2_and_marks_nothing(
    run: Any, two_refusals: tuple[str, str], args: list[str]
) -> None:
    first, _ = two_refusals
    done = run("payments", "handled", first, *args)
    assert done.exit_code == 2, done.output
    assert done.stderr == (
        "error: invalid payment_ref: no refused payment of that order has this reference\n"
    )
    assert [r["handled"] for r in refusals(run)] == [False, False]


def test_a_payment_for_a_missing_order_is_exit_3_and_listed_as_owed_with_no_user(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    paid = run("pay", "o-gone", "--ref", "psp-1", "--amount", "5.00", "--currency", "EUR")
    assert (paid.exit_code, paid.stderr.count("\n")) == (3, 1), paid.output

    [row] = refusals(run, "--pending")
    assert (row["order_id"], row["reason"], row["user_id"], row["event"]) == (
        "o-gone",
        "unknown_order",
        None,
        None,
    )
    monkeypatch.setenv("COLUMNS", "200")  # rich's table: one line per row
    [line] = [line for line in run("payments", "refused").stdout.splitlines() if "o-gone" in line]
    assert "unknown_order" in line
    assert "owed" in line
