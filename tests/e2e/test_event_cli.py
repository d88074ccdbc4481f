"""``orders events``: consumers, parked, requeue, discard, in process with CliRunner."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from sqlalchemy import Engine

from orders.domain import Actor, ActorKind, EventKind
from orders.events.consumer import EventConsumer
from orders.service import OrderService
from tests.support.clocks import ManualClock
from tests.support.doubles import Poison

HOUR_S = 3600


@pytest.fixture
def stock(service: OrderService, engine: Engine, clock: ManualClock) -> Poison:
    """Consumer "stock": event 1 parked (a long, two-line error), event 2 retrying."""
    handler = Poison(service.create_unpaid_order("u1", order_id="o-" + "x" * 60).id)
    consumer = EventConsumer(engine, "stock", handler, clock=clock, max_attempts=2, start="oldest")
    consumer.run_once()
    clock.advance(s=HOUR_S)
    consumer.run_once()
    handler.order_ids.add(service.create_unpaid_order("u2").id)
    consumer.run_once()
    return handler


def test_consumers_json_and_text_show_lag_retrying_and_parked(
    run: Any,
    stock: Poison,
    service: OrderService,
) -> None:
    for i in range(3):
        service.create_unpaid_order(f"n{i}")

    listed = run("events", "consumers", "--json")

    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.stdout)
    assert (row["name"], row["lag_events"], row["retrying"], row["parked"]) == ("stock", 3, 1, 1)
    assert row["position"]["event_id"] == 2
    assert isinstance(row["oldest_unread_age_ms"], int)
    text = run("events", "consumers").stdout.splitlines()
    assert text[1].split()[:3] == ["stock", "2", "3"]
    assert text[1].split()[-2:] == ["1", "1"]


def test_parked_shows_each_entry_on_one_line_with_the_error_cut(
    run: Any,
    stock: Poison,
) -> None:
    listed = run("events", "parked", "--consumer", "stock", "--json")
    assert listed.exit_code == 0, listed.output
    [row] = json.loads(listed.stdout)
    assert (row["consumer"], row["event_id"], row["kind"], row["attempts"]) == (
        "stock",
        1,
        "created",
        2,
    )
    assert row["last_error"] == "RuntimeError: no stock row for o-" + "x" * 60

    lines = run("events", "parked").stdout.splitlines()
    assert len(lines) == 2  # the header and one entry: the error's second line is not kept
    assert lines[1].startswith("stock  1  o-xxx")
    assert lines[1].endswith("…")
    assert "RuntimeError: no stock row" in lines[1]


#: Each action on a parked event: what it says, and the consumer's (retrying, parked) after.
DONE = {"requeue": ("requeued", (2, 0)), "discard": ("discarded", (1, 0))}


@pytest.mark.parametrize("action", sorted(DONE))
def test_requeue_and_discard_take_the_entry_off_the_parked_list(
    run: Any, stock: Poison, action: str
) -> None:
    said, counts = DONE[action]
    done = run("events", action, "stock", "1")
    assert done.exit_code == 0, done.output
    assert done.stdout == f"{said} event 1 of stock\n"
    assert json.loads(run("events", "parked", "--json").stdout) == []
    [row] = json.loads(run("events", "consumers", "--json").stdout)
    assert (row["retrying"], row["parked"]) == counts


def test_a_requeued_event_is_run_by_the_consumer_and_then_has_nothing_to_discard(
    run: Any, stock: Poison, engine: Engine, clock: ManualClock
) -> None:
    assert run("events", "requeue", "stock", "1").exit_code == 0

    stock.order_ids.clear()
    consumer = EventConsumer(engine, "stock", stock, clock=clock, max_attempts=2, start="oldest")
    clock.advance(s=HOUR_S)
    assert consumer.run_once().retried_ok == 2  # the requeued one and the retrying one

    stock.order_ids.add("nothing")
    assert run("events", "discard", "stock", "1").exit_code == 2  # nothing parked any more


#: The event each action on a parked event records.
RECORDED = {"requeue": EventKind.REQUEUED, "discard": EventKind.DISCARDED}


@pytest.mark.parametrize("action", sorted(RECORDED))
@pytest.mark.parametrize("given", [None, "night shift"], ids=["default", "--actor"])
def test_requeue_and_discard_record_the_operator_who_ran_them(
    run: Any,
    stock: Poison,
    service: OrderService,
    monkeypatch: pytest.MonkeyPatch,
    action: str,
    given: str | None,
) -> None:
    monkeypatch.setenv("LOGNAME", "ann")  # getpass.getuser() reads it first
    actor_args = [] if given is None else ["--actor", given]

    done = run(*actor_args, "events", action, "stock", "1")

    assert done.exit_code == 0, done.output
    [recorded] = [e for e in service.iter_events(limit=100) if e.kind == RECORDED[action]]
    name = f"ann@{socket.gethostname()}" if given is None else given
    assert recorded.actor == Actor(ActorKind.OPERATOR, name)
    assert recorded.data == {"consumer": "stock", "event_id": 1}


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["requeue", "nope", "1"], "invalid consumer: no consumer with that name"),
        (["discard", "nope", "1"], "invalid consumer: no consumer with that name"),
        (
            ["requeue", "stock", "999"],
            "invalid event_id: no parked event with that id for this consumer",
        ),
        (
            ["discard", "stock", "999"],
            "invalid event_id: no parked event with that id for this consumer",
        ),
        (["requeue", "stock", "2"], "invalid event_id: is retrying, not parked"),
        (["requeue", "stock", "x"], "invalid event_id: not a valid integer"),
        (["parked", "--consumer", "nope"], "invalid consumer: no consumer with that name"),
    ],
)
def test_what_is_not_a_parked_event_exits_2_with_one_line(
    run: Any,
    stock: Poison,
    args: list[str],
    words: str,
) -> None:
    result = run("events", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {words}\n"
