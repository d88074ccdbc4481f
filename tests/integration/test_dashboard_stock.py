"""The dashboard's resource panels on real stores (issue 44): the longest waiting lists, and
a named resource running out with its first free seats. Time moves with the service's
ManualClock. The page that renders them is tested in tests/e2e/test_dashboard_browser.py,
their plans in tests/integration/test_dashboard_plans.py."""

from __future__ import annotations

from typing import Any

from orders.dashboard.snapshot import read_overview
from orders.dashboard.stock import FREE_NAMES, LONGEST_QUEUES
from orders.service import OrderService
from tests.support.clocks import ManualClock

#: A resource id is caller text: the JSON carries it as it came.
HOSTILE_ID = "<img src=x onerror=alert(3)>"
SEATS = [f"A-{n:02}" for n in range(1, 15)]


def sold_out(service: OrderService, resource_id: str, capacity: int) -> list[str]:
    """A counted resource of ``capacity`` units, every one held by an order of its own."""
    service.set_capacity(resource_id, capacity)
    return [
        service.create_unpaid_order(f"holder-{resource_id}-{i}", holds={resource_id: 1}).id
        for i in range(capacity)
    ]


def queues(service: OrderService) -> list[tuple[str, int, int, int, int]]:
    waiting = read_overview(service)["waiting"]
    assert "error" not in waiting, waiting
    assert waiting["capped"] is False
    return [
        (q["resource_id"], q["entries"], q["units"], q["oldest_age_ms"], q["free"])
        for q in waiting["longest"]
    ]


def test_the_waiting_lists_are_the_longest_first_and_follow_serves_and_leaves(
    service: OrderService, clock: ManualClock
) -> None:
    assert queues(service) == []
    tea = sold_out(service, "sku:tea", 3)
    sold_out(service, HOSTILE_ID, 1)
    service.set_capacity("sku:plenty", 5)
    first = service.wait_for("anna", "sku:tea", quantity=2)
    clock.advance(s=2)
    service.wait_for("ben", HOSTILE_ID)
    service.wait_for("carl", "sku:tea")
    service.wait_for("dora", HOSTILE_ID)
    clock.advance(s=3)
    last = service.wait_for("emil", "sku:tea", quantity=3)
    service.wait_for("fay", "sku:plenty")  # free units: served at once, never queued
    assert service.waiting("sku:plenty") == []

    assert queues(service) == [
        ("sku:tea", 3, 6, 5_000, 0),  # anna queued five seconds ago
        (HOSTILE_ID, 2, 2, 3_000, 0),
    ]

    # A cancel frees one unit of tea: anna (2) does not fit, carl (1) is served.
    service.cancel_order(tea[0])
    clock.advance(s=1)
    assert queues(service) == [(HOSTILE_ID, 2, 2, 4_000, 0), ("sku:tea", 2, 5, 6_000, 0)]
    service.leave_waiting(first.id)
    service.leave_waiting(last.id)
    service.set_capacity("sku:tea", 10)  # nobody waits for tea now: its free units stay
    assert queues(service) == [(HOSTILE_ID, 2, 2, 4_000, 0)]


def test_the_waiting_lists_rank_a_bounded_part_and_say_so(service: OrderService) -> None:
    for n in range(LONGEST_QUEUES + 2):
        sold_out(service, f"ev:{n:02}", 1)
    for n in range(LONGEST_QUEUES + 2):
        for user in range(1 + n % 3):  # queues of 1, 2, 3, 1, 2, 3, ...
            service.wait_for(f"u{user}", f"ev:{n:02}")
    waiting = read_overview(service)["waiting"]
    listed = [(q["resource_id"], q["entries"]) for q in waiting["longest"]]
    assert len(listed) == LONGEST_QUEUES
    assert listed[:4] == [("ev:02", 3), ("ev:05", 3), ("ev:08", 3), ("ev:11", 3)]
    # Four of three, four of two, then two of the four of one: ev:06 and ev:09 sort later.
    assert listed[-2:] == [("ev:00", 1), ("ev:03", 1)]
    assert waiting["capped"] is False

    # The bound: only the first entries by resource, then arrival, are read.
    records = service.waiting_list.records
    few = records.longest_queues(2, among=4)  # ev:00 (1), ev:01 (2), ev:02 (1 of its 3)
    assert [(q.resource_id, q.entries) for q in few.queues] == [("ev:01", 2), ("ev:00", 1)]
    assert few.capped is True
    total = sum(1 + n % 3 for n in range(LONGEST_QUEUES + 2))
    assert records.longest_queues(1, among=total).capped is False
    assert records.longest_queues(1, among=total - 1).capped is True


def resource_rows(service: OrderService) -> dict[str, dict[str, Any]]:
    resources = read_overview(service)["resources"]
    assert "error" not in resources, resources
    return {row["id"]: row for row in resources["running_out"]}


def test_a_named_resource_running_out_shows_its_free_seats_and_the_first_names(
    service: OrderService, clock: ManualClock
) -> None:
    service.set_units("ev7", SEATS)
    service.set_units("ev8", ["B-1", "B-2"])
    service.set_capacity("sku:tea", 10)
    held = service.create_unpaid_order("a", ttl_s=60, holds={"ev7": ["A-01", "A-03"]})
    service.create_unpaid_order("b", order_id="b-1", holds={"ev8": 2, "sku:tea": 1})
    service.mark_paid("b-1", payment_ref="p")

    rows = resource_rows(service)
    ev7 = rows["ev7"]
    assert (ev7["named"], ev7["free"], ev7["sold_out"]) == (True, len(SEATS) - 2, False)
    # The lowest free in the resource's order, FREE_NAMES of them.
    assert ev7["first_free"] == ["A-02", *SEATS[3 : FREE_NAMES + 2]]
    assert len(ev7["first_free"]) == FREE_NAMES
    assert (rows["ev8"]["named"], rows["ev8"]["sold_out"], rows["ev8"]["first_free"]) == (
        True,
        True,
        [],
    )
    assert (rows["sku:tea"]["named"], rows["sku:tea"]["first_free"]) == (False, None)
    assert list(rows) == ["ev8", "ev7", "sku:tea"]  # sold out first

    service.cancel_order(held.id)  # are free again, first in line
    assert resource_rows(service)["ev7"]["first_free"] == SEATS[:FREE_NAMES]
    assert resource_rows(service)["ev7"]["free"] == len(SEATS)
