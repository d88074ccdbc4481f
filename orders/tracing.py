"""Optional OpenTelemetry spans (the ``otel`` extra: ``pip install 'orders[otel]'``).

The only module that imports ``opentelemetry``. Without the package every helper here
does nothing and costs a function call. With it, spans go to the API's global tracer
provider under the tracer name ``orders``: the host configures the SDK and its exporter;
this package never does. Without a configured SDK the API hands out non-recording spans,
and no attribute is built for them (``is_recording()`` is asked first).

A typed :class:`~orders.errors.OrdersError` (a refusal, a conflict) marks its span as an
error whose description is the error's class name only: neither the message nor the
exception is recorded, so no metadata value or payment reference reaches a trace.

A create inside a recording span writes that span's W3C ``traceparent`` into its
``created`` event's data (:func:`event_context`); an event consumer's span for that event
links to it (:func:`consumer_span`): a link, not a parent, as the consumer's work runs
later in a trace of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from orders.errors import OrdersError

try:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the otel extra is not installed: no spans
    AVAILABLE = False
else:
    AVAILABLE = True
    # A proxy until the host sets its provider, then that provider's tracer: made once.
    TRACER = trace.get_tracer("orders")

#: The key of the trace context in a ``created`` event's data.
TRACEPARENT = "traceparent"


class Span:
    """What a traced block may do to its span: set attributes (built only when recorded)."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.recording: bool = span is not None and span.is_recording()

    def set(self, **attributes: str | int) -> None:
        """Set ``orders.<name>`` attributes, when the span is recorded."""
        if self.recording:
            self.span.set_attributes({f"orders.{k}": v for k, v in attributes.items()})


class _Untraced:
    """The block of a span not recorded: nothing to start or end (one shared instance)."""

    span = Span(None)

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, *_exc: object) -> None:
        return None


_UNTRACED = _Untraced()


def span(
    name: str, links: list[Any] | None = None, **attributes: str | int
) -> AbstractContextManager[Span]:
    """A span named ``name`` around the block, current within it; ``attributes`` set
    as ``orders.<name>``. An exception ends it as an error named by its class. Without
    a recording provider, a shared block that does nothing (no generator per call)."""
    if not recorded():
        return _UNTRACED
    return _recorded_span(name, links, attributes)


@contextmanager
def _recorded_span(
    name: str, links: list[Any] | None, attributes: dict[str, str | int]
) -> Iterator[Span]:
    with TRACER.start_as_current_span(
        name, links=links, record_exception=False, set_status_on_exception=False
    ) as current:
        traced = Span(current)
        traced.set(**attributes)
        try:
            yield traced
        except BaseException as exc:
            if traced.recording:
                outcome = "refused" if isinstance(exc, OrdersError) else "error"
                current.set_attribute("orders.outcome", outcome)
                current.set_attribute("orders.error", type(exc).__name__)
                current.set_status(trace.Status(trace.StatusCode.ERROR, type(exc).__name__))
            raise


def recorded() -> bool:
    """Whether spans may be recorded: the package is there and the host set a provider
    (without one, the API's default proxy hands out non-recording spans: skipped here,
    as starting one still costs tens of microseconds)."""
    return AVAILABLE and not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    )


def event_context() -> dict[str, str] | None:
    """The current recording span's ``{"traceparent": ...}``, for a ``created`` event's
    data; None outside one (or without the package)."""
    if not AVAILABLE or not trace.get_current_span().is_recording():
        return None
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return {TRACEPARENT: carrier[TRACEPARENT]} if TRACEPARENT in carrier else None


def consumer_span(
    name: str, event_data: Mapping[str, Any], **attributes: str | int
) -> Any:  # a context manager yielding Span
    """:func:`span` for the handling of one event, linked to the trace the event's data
    names (its ``traceparent``), if any."""
    links: list[Any] = []
    parent = event_data.get(TRACEPARENT)
    if AVAILABLE and isinstance(parent, str):
        extracted = TraceContextTextMapPropagator().extract({TRACEPARENT: parent})
        context = trace.get_current_span(extracted).get_span_context()
        if context.is_valid:
            links.append(trace.Link(context))
    return span(name, links=links or None, **attributes)
