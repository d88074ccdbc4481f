"""OpenTelemetry spans (orders/tracing.py), on both engines, through the SDK's in-memory
exporter on this process's global tracer provider (set once, cleared per test)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, SamplingResult
from opentelemetry.trace import StatusCode
from sqlalchemy import Engine

from orders import UnpaidOrderLimitReached
from orders.config import Settings
from orders.events.consumer import EventConsumer, read_events
from orders.service import OrderService
from tests.support.aio import LoopThread, new_async_service
from tests.support.clocks import ManualClock
from tests.support.processes import REPO

_EXPORTER = InMemorySpanExporter()


class Switch(Sampler):
    """Records spans only while a test of this module runs: the global provider outlives
    it, and other tests' spans (and created events) must stay as without an SDK."""

    on = False

    def should_sample(self, *args: Any, **kwargs: Any) -> SamplingResult:
        return (ALWAYS_ON if self.on else ALWAYS_OFF).should_sample(*args, **kwargs)

    def get_description(self) -> str:
        return "Switch"


_SWITCH = Switch()


@pytest.fixture(scope="session")
def provider() -> TracerProvider:
    """The process's global provider: the API lets it be set once only."""
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        return current
    made = TracerProvider(sampler=_SWITCH)
    made.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(made)
    return made


@pytest.fixture
def spans(provider: TracerProvider) -> Iterator[Callable[[], list[ReadableSpan]]]:
    _EXPORTER.clear()
    _SWITCH.on = True

    def orders_spans() -> list[ReadableSpan]:
        return [s for s in _EXPORTER.get_finished_spans() if s.name.startswith("orders.")]

    yield orders_spans
    _SWITCH.on = False
    _EXPORTER.clear()


def attributes(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def test_create_pay_cancel_and_sweep_give_their_spans(
    service: OrderService, clock: ManualClock, spans: Callable[[], list[ReadableSpan]]
) -> None:
    paid = service.create_unpaid_order("u1", ttl_s=60)
    service.mark_paid(paid.id, payment_ref="p-1")
    cancelled = service.create_unpaid_order("u1", ttl_s=60)
    service.cancel_order(cancelled.id)
    expired = service.create_unpaid_order("u2", ttl_s=60)
    clock.advance(s=61)
    assert service.sweep_expired().closed == 1

    def ids(order_id: str, user_id: str, outcome: str) -> dict[str, Any]:
        return {"orders.order_id": order_id, "orders.user_id": user_id, "orders.outcome": outcome}

    create = "orders.create_unpaid_order"
    sweep = {"orders.closed": 1, "orders.batches": 1, "orders.outcome": "swept"}
    assert [(s.name, attributes(s)) for s in spans()] == [
        (create, ids(paid.id, "u1", "admitted")),
        ("orders.mark_paid", ids(paid.id, "u1", "paid")),
        (create, ids(cancelled.id, "u1", "admitted")),
        ("orders.cancel_order", ids(cancelled.id, "u1", "cancelled")),
        (create, ids(expired.id, "u2", "admitted")),
        ("orders.sweep_expired", sweep),
    ]
    assert all(s.status.status_code is StatusCode.UNSET for s in spans())


def test_a_refused_create_marks_its_span_with_the_error_class_only(
    make_service: Callable[..., OrderService], spans: Callable[[], list[ReadableSpan]]
) -> None:
    service = make_service(unpaid_limit=1)
    service.create_unpaid_order("u1", metadata={"card": "secret-4242"})
    with pytest.raises(UnpaidOrderLimitReached):
        service.create_unpaid_order("u1", metadata={"card": "secret-4242"})

    refused = spans()[-1]
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.status.description == "UnpaidOrderLimitReached"
    assert attributes(refused) == {
        "orders.user_id": "u1",
        "orders.outcome": "refused",
        "orders.error": "UnpaidOrderLimitReached",
    }
    assert not refused.events  # no exception recorded: its message stays out of the trace
    assert "secret" not in repr([attributes(s) for s in spans()])


def test_the_created_event_carries_the_trace_and_a_consumer_span_links_to_it(
    service: OrderService, engine: Engine, spans: Callable[[], list[ReadableSpan]]
) -> None:
    tracer = trace.get_tracer("checkout")
    with tracer.start_as_current_span("checkout"):
        traced = service.create_unpaid_order("u1")
    untraced = service.create_unpaid_order("u2")
    creates = [s.context for s in spans()]
    assert spans()[0].parent is not None  # in the checkout's trace
    assert spans()[1].parent is None  # a trace of its own

    # Each created event names its create's span (the caller's trace, or the create's own).
    events = {e.order_id: e for e in read_events(engine)}
    for order, create in zip([traced, untraced], creates, strict=True):
        ids = f"{create.trace_id:032x}-{create.span_id:016x}"
        assert events[order.id].data["traceparent"] == f"00-{ids}-{create.trace_flags:02x}"

    handled: list[str] = []
    consumer = EventConsumer(engine, "traced", lambda e: handled.append(e.order_id), start="oldest")
    assert consumer.run_once().handled == 2
    consumed = [s for s in spans() if s.name == "orders.consume_event"]
    assert [attributes(s)["orders.order_id"] for s in consumed] == [traced.id, untraced.id]
    for span, create in zip(consumed, creates, strict=True):
        assert [(link.context.trace_id, link.context.span_id) for link in span.links] == [
            (create.trace_id, create.span_id)
        ]
        assert span.parent is None  # a link, not a parent: the consumer's own trace
    assert attributes(consumed[0])["orders.consumer"] == "traced"


def test_the_asyncio_api_gives_the_same_spans_in_the_callers_trace(
    service: OrderService,
    database_url: str,
    clock: ManualClock,
    redis_options: dict[str, Any],
    spans: Callable[[], list[ReadableSpan]],
) -> None:
    settings = Settings(database_url=database_url, **redis_options)
    loop = LoopThread()
    aio = loop.call(new_async_service(settings, clock=clock))
    tracer = trace.get_tracer("checkout")

    async def checkout() -> tuple[int, str]:
        with tracer.start_as_current_span("checkout") as parent:
            order = await aio.create_unpaid_order("u1")
            await aio.mark_paid(order.id, payment_ref="p-1")
            return parent.get_span_context().span_id, order.id

    try:
        parent_id, order_id = loop.call(checkout())
    finally:
        loop.call(aio.aclose())
        loop.stop()
    got = spans()
    assert [s.name for s in got] == ["orders.create_unpaid_order", "orders.mark_paid"]
    assert [s.parent.span_id if s.parent else None for s in got] == [parent_id, parent_id]
    assert attributes(got[1]) == {
        "orders.order_id": order_id,
        "orders.user_id": "u1",
        "orders.outcome": "paid",
    }


_WITHOUT = """
import sys
if sys.argv[1] == "absent":
    sys.modules["opentelemetry"] = None  # the import fails as if not installed
from orders import tracing
assert tracing.AVAILABLE is (sys.argv[1] != "absent")
with tracing.span("orders.x", order_id="o") as s:
    s.set(user_id="u")
    assert tracing.event_context() is None
parent = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
with tracing.consumer_span("orders.y", parent, order_id="o"):
    pass
print("ok")
"""


@pytest.mark.parametrize("case", ["absent", "no_provider"])
def test_without_the_package_or_a_provider_nothing_is_recorded_and_nothing_fails(
    case: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT, case],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr
