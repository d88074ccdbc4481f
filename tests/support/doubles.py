"""Test doubles built on the real parts: they run the real Redis scripts and SQL, and let a
test observe or pace the steps in between (composition: the service takes them as-is); and
an event handler that fails on the orders it is told to (:class:`Poison`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from orders.errors import OrdersError
from orders.events.consumer import OrderEvent
from orders.index.admissions import AdmitRequest, AdmitResult
from orders.index.unpaid import UnpaidIndex
from orders.service import OrderService
from tests.support.threads import outcomes_of_race


class PausingIndex(UnpaidIndex):
    """The real admission index, calling ``after_admit(user_id, order_id)`` once the Redis
    step of a create has run and before its SQL insert."""

    def __init__(self, base: UnpaidIndex, after_admit: Callable[[str, str], None]) -> None:
        super().__init__(base.client, key_prefix=base.key_prefix)
        self.after_admit = after_admit

    def admit(self, request: AdmitRequest) -> AdmitResult:
        result = super().admit(request)
        self.after_admit(request.user_id, request.order_id)
        return result


def pausing_after_admit(
    service: OrderService, after_admit: Callable[[str, str], None]
) -> OrderService:
    """A service on the same stores as ``service`` whose creates pause after admission."""
    return OrderService(
        service.engine,
        service.index.client,
        service.settings,
        clock=service.clock,
        index=PausingIndex(service.index, after_admit),
    )


def gated_race(
    service: OrderService,
    calls: list[Callable[[], object]],
    before_open: Callable[[], None] = lambda: None,
) -> list[object]:
    """``calls`` at once, all queued behind a create of the user "gate" that holds the
    combiner (``Settings.combine_creates``) until every call waits: they run as one batch,
    once ``before_open`` has run. ``service``: from :func:`pausing_after_admit`. What each
    call returned or raised (an OrdersError), in order."""
    combiner = service.combiner
    assert combiner is not None, "not a combining service"
    opened = threading.Event()
    held = threading.Event()

    def hold_the_gate(user_id: str, _order_id: str) -> None:
        if user_id == "gate":
            held.set()
            assert opened.wait(30), "the gate was never opened"

    assert isinstance(service.index, PausingIndex)
    service.index.after_admit = hold_the_gate

    def pass_the_gate() -> None:
        with contextlib.suppress(OrdersError):  # what ``before_open`` broke may refuse it
            service.create_unpaid_order("gate", ttl_s=60)

    gate = threading.Thread(target=pass_the_gate)
    gate.start()
    racing: list[object] = []
    runner = threading.Thread(target=lambda: racing.extend(outcomes_of_race(calls)))
    try:
        assert held.wait(30), "the gate's create did not start"
        runner.start()
        deadline = time.monotonic() + 30
        while combiner.queued < len(calls):
            assert time.monotonic() < deadline, f"only {combiner.queued} creates queued"
            time.sleep(0.001)
        before_open()
    finally:
        opened.set()
        gate.join(30)
    runner.join(60)
    assert len(racing) == len(calls), "a racing create did not end"
    return racing


class Poison:
    """A handler that fails on the events of ``order_ids`` and records every call."""

    def __init__(self, *order_ids: str) -> None:
        self.order_ids = set(order_ids)
        self.calls: list[int] = []
        self.handled: list[str] = []

    def __call__(self, event: OrderEvent) -> None:
        self.calls.append(event.id)
        if event.order_id in self.order_ids:
            raise RuntimeError(f"no stock row for {event.order_id}\nsecond line")
        self.handled.append(event.order_id)
