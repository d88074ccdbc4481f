"""Every SQL statement the dashboard sends is served by an index, on PostgreSQL.

The statements are not listed here by hand: a listener on the engine records what
``read_overview`` and ``compare_user`` actually send, and each is planned the way the
driver runs it (prepared, generic plan, sequential scans off: ``tests.support.plans.explain_sql``),
so a partial index counts only where a literal in the SQL lets it serve. A plan may read
tables only through named indexes. The number of statements is pinned too: one added to
the dashboard later is planned here without anyone listing it, and one that escaped the
listener fails the count. SQLite is left out: its plans are checked by the stats tests.

The data is small; what matters is which plans PostgreSQL *can* use. The sizes at 10**6
orders, with the plans it then picks, are in docs/bench/dashboard-1e6.md
(scripts/dashboard_at_scale.py).
"""

from __future__ import annotations

import re

import pytest
from sqlalchemy import Engine

from orders.dashboard.snapshot import compare_user, read_overview
from orders.errors import OrderClosed
from orders.events.consumer import EventConsumer
from orders.index.nodes import RedisClient
from orders.service import OrderService
from orders.sql.models import (
    cursors_table,
    pauses_table,
    refusals_table,
    retries_table,
    user_limits_table,
)
from tests.support.clocks import ManualClock
from tests.support.doubles import Poison
from tests.support.plans import Statement, captured, explain_sql

pytestmark = pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)

#: Per overview: five statements of read_stats, the latest closes, and list_consumers'
#: positions, failure counts and names, then two per consumer (lag count, oldest unread),
#: then the refunds owed (their capped count with the oldest, the newest listed), then the
#: resources running out (the ranked ones, the first free units of the one named resource
#: shown, whether more exist), the longest waiting lists, then the open pause.
OVERVIEW_STATEMENTS = 6 + 3 + 2 * 1 + 2 + 3 + 1 + 1
#: The user's unpaid rows, then the rows of the members SQL did not return.
COMPARE_STATEMENTS = 2
#: Plan nodes that read a table through an index, or read no table at all.
INDEX_NODES = {"Index Scan", "Index Only Scan", "Bitmap Index Scan", "Bitmap Heap Scan"}
NO_TABLE_NODES = {"Subquery Scan"}
#: Tables the consumers' part reads whole, each a few rows (a finding of this test, see
#: docs/bench/dashboard-1e6.md): event_cursors has one row per consumer, and list_consumers
#: reads it without an ORDER BY an index could serve, so even its plan is a Seq Scan;
#: event_retries has one row per failing event (retrying or parked), counted whole;
#: user_limits has one row per user with a limit of their own, counted whole (its primary
#: key would serve the count; on a few rows PostgreSQL reads the table).
READ_WHOLE = {
    cursors_table.name,
    retries_table.name,
    user_limits_table.name,
    pauses_table.name,  # one row per incident pause
}
SCAN = re.compile(r"(\w+(?: \w+)*? Scan)(?: Backward)?(?: using (\w+))? on (\w+)")
UNPAID_INDEX = "WHERE ((status)::text = 'unpaid'::text)"
PENDING_INDEX = "ix_oes_payment_refusals_pending_refused_at_ms"
#: The resources running out: a range of the primary key; a named one's first free units: a
#: range of the units' (resource, state, position) index; the waiting lists: the first
#: entries of the queues' partial index.
RESOURCES_PK = "pk_oes_resources"
FREE_UNITS_INDEX = "ix_oes_units_resource_id_state_position"
QUEUE_INDEX = "ix_oes_waiting_queue"


def index_reads(plan: str, indexes: dict[str, tuple[str, str]]) -> set[str]:
    """The indexes ``plan`` reads; AssertionError naming a node that reads more than a
    bounded part of a table.

    A node that reads a table must go through an index (no Seq Scan, no Tid Scan, ...), and
    either read a range of it (an Index Cond), or all of a partial index over unpaid orders
    (the open ones and the backlog, whatever the table's size), or the first rows of an
    index under a Limit. Tables of READ_WHOLE are exempt. ``indexes``: name -> (table, DDL).
    """
    lines = plan.splitlines()
    nodes = [i for i, line in enumerate(lines) if SCAN.search(line)]
    assert len(nodes) == len(re.findall(r"\bScan\b", plan)), f"a scan not understood:\n{plan}"
    used = set()
    for at in nodes:
        node, index, target = SCAN.findall(lines[at])[0]
        table = indexes[target][0] if node == "Bitmap Index Scan" else target
        index = target if node == "Bitmap Index Scan" else index
        if table in READ_WHOLE:
            used.add(index or f"table:{table}")
            continue
        assert node in INDEX_NODES | NO_TABLE_NODES, f"{node} on {table}:\n{plan}"
        if not index:
            continue  # a Bitmap Heap Scan's index is its child's, a subquery reads none
        used.add(index)
        details = []
        for line in lines[at + 1 :]:
            if "->" in line or line.strip().startswith(("InitPlan", "SubPlan")):
                break
            details.append(line)
        ranged = any("Index Cond:" in line for line in details)
        limited = at > 0 and lines[at - 1].strip().lstrip("-> ").startswith("Limit")
        unpaid = UNPAID_INDEX in indexes[index][1]
        assert ranged or limited or unpaid, f"all of {index} read:\n{plan}"
    return used


def all_indexes(engine: Engine) -> dict[str, tuple[str, str]]:
    with engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT indexname, tablename, indexdef FROM pg_indexes WHERE schemaname = 'public'"
        ).all()
    return {name: (table, ddl) for name, table, ddl in rows}


def dashboard_statements(
    service: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> tuple[list[Statement], list[Statement]]:
    """What read_overview and compare_user send, on stores that give every statement rows
    to find: each status, a due order, a consumer behind with a parked event, and a user
    whose index holds a member with no row and one whose row is paid."""
    paid = service.create_unpaid_order("u", order_id="paid")
    service.mark_paid(paid.id, payment_ref="p")
    service.create_unpaid_order("u", order_id="open")
    service.create_unpaid_order("v", order_id="cancelled")
    service.cancel_order("cancelled")
    for ref in ("refund-owed", "refund-handled"):
        with pytest.raises(OrderClosed):
            service.mark_paid("cancelled", payment_ref=ref)
    service.mark_refund_handled("cancelled", "refund-handled")
    for n, capacity in enumerate((3, 5, 0)):
        service.set_capacity(f"sku:{n}", capacity)
    service.create_unpaid_order("x", order_id="held", holds={"sku:0": 2, "sku:1": 1})
    service.create_unpaid_order("x", order_id="sold", holds={"sku:0": 1})
    service.mark_paid("sold", payment_ref="s")
    service.set_units("seat:0", ["A-1", "A-2", "A-3"])
    service.create_unpaid_order("y", order_id="seat", holds={"seat:0": ["A-2"]})
    service.wait_for("z", "sku:0")
    service.create_unpaid_order("w", ttl_s=10, order_id="due")
    EventConsumer(
        engine, "stock", Poison("due"), clock=clock, max_attempts=1, start="oldest"
    ).run_once()
    clock.advance(s=11)
    assert service.sweep_expired().closed == 1
    redis_client.zadd(service.index.key("u"), {"ghost": clock() + 5000, "paid": clock() + 1})
    read_overview(service)  # the engine's first connection sends its own set-up queries
    with captured(engine) as overview:
        shown = read_overview(service)
    with captured(engine) as compare:
        user = compare_user(service, "u")
    assert "error" not in shown["sql"], shown
    assert "error" not in shown["consumers"], shown
    assert [c["parked"] for c in shown["consumers"]] == [1]
    assert [r["payment_ref"] for r in shown["refunds"]["newest"]] == ["refund-owed"]
    listed = shown["resources"]["running_out"]
    assert [(r["id"], r["free"]) for r in listed] == [("sku:0", 0), ("seat:0", 2), ("sku:1", 4)]
    assert listed[1]["first_free"] == ["A-1", "A-3"]
    assert [(q["resource_id"], q["entries"]) for q in shown["waiting"]["longest"]] == [("sku:0", 1)]
    assert {r["order_id"]: r["state"] for r in user["rows"]} == {
        "open": "same",
        "ghost": "no_row",
        "paid": "terminal_in_sql",
    }
    return overview, compare


def test_every_dashboard_statement_reads_through_an_index(
    service: OrderService, engine: Engine, redis_client: RedisClient, clock: ManualClock
) -> None:
    overview, compare = dashboard_statements(service, engine, redis_client, clock)
    assert (len(overview), len(compare)) == (OVERVIEW_STATEMENTS, COMPARE_STATEMENTS)
    indexes = all_indexes(engine)
    read: set[str] = set()
    for sql, params in overview + compare:
        plan = explain_sql(engine, sql, params)
        short = re.sub(r"\s+", " ", sql)[:120]
        used = index_reads(plan, indexes)
        assert used, f"no index read by {short}:\n{plan}"
        read |= used
    # The refunds owed read the partial index over the pending refusals alone: its size is
    # the refunds owed, not every refusal ever recorded.
    of_refusals = {name for name, (table, _) in indexes.items() if table == refusals_table.name}
    assert read & of_refusals == {PENDING_INDEX}
    assert {RESOURCES_PK, FREE_UNITS_INDEX, QUEUE_INDEX} <= read
