"""``orders erase-user``: a user's erasure from the shell, on both engines."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.errors import OrderClosed
from orders.service import OrderService
from orders.sql.models import events_table, orders_table
from tests.support.clocks import ManualClock

KEY = "erasure-key-of-the-cli-tests"


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORDERS_ERASURE_KEY", KEY)


def test_erase_user_names_the_operator_and_a_second_run_says_already(
    run: Any, keyed: None, service: OrderService, engine: Engine
) -> None:
    assert run("create", "u1").exit_code == 0
    assert run("--actor", "anna", "limit", "set", "u1", "2").exit_code == 0

    erased = run("--actor", "anna", "erase-user", "u1", "--json")

    assert erased.exit_code == 0, erased.output
    shown = json.loads(erased.stdout)
    assert shown["pseudonym"].startswith("erased-")
    assert (shown["already"], shown["orders"], shown["cancelled"]) == (False, 1, 1)
    assert shown["limit_removed"] is True
    with engine.connect() as conn:
        users = set(conn.scalars(select(orders_table.c.user_id)))
        actors = set(conn.execute(select(events_table.c.actor_kind, events_table.c.actor)))
    assert users == {shown["pseudonym"]}
    assert ("operator", "anna") in actors
    again = run("erase-user", "u1")
    assert again.exit_code == 0, again.output
    assert again.stdout == f"already erased as {shown['pseudonym']}; 0 Redis keys deleted now\n"
    assert service.user_limit("u1").own is False


@pytest.mark.parametrize("case", ["refund_owed", "unknown_user", "no_key"])
def test_a_refused_erasure_is_one_line_with_its_exit_code_and_nothing_written(
    run: Any,
    monkeypatch: pytest.MonkeyPatch,
    make_service: Any,
    clock: ManualClock,
    engine: Engine,
    case: str,
) -> None:
    shop = make_service()
    order = shop.create_unpaid_order("u1", ttl_s=60)
    if case == "refund_owed":
        clock.advance(s=61)
        shop.sweep_expired()
        with pytest.raises(OrderClosed):
            shop.mark_paid(order.id, payment_ref="psp-1")
    if case == "no_key":
        monkeypatch.delenv("ORDERS_ERASURE_KEY", raising=False)
    else:
        monkeypatch.setenv("ORDERS_ERASURE_KEY", KEY)
    with engine.connect() as conn:
        before = conn.execute(select(orders_table)).all()
    user, code, words = {
        "refund_owed": ("u1", 12, "not yet marked handled"),
        "unknown_user": ("nobody", 3, "no order, limit or erasure"),
        "no_key": ("u1", 2, "invalid erasure_key"),
    }[case]

    refused = run("erase-user", user)

    assert refused.exit_code == code, refused.output
    assert refused.stderr.startswith("error: ")
    assert words in refused.stderr
    assert refused.stderr.count("\n") == 1
    with engine.connect() as conn:
        assert conn.execute(select(orders_table)).all() == before
