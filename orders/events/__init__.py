"""The outbox's readers: every transition's event, consumed in commit order.

``stream`` reads events in commit order; ``consumer`` keeps a named consumer's durable
position, retries and parked events; ``admin`` is what an operator does to them (``orders
events``). The public names are re-exported here: ``from orders.events import
EventConsumer``.

May import: ``orders.sql`` and what lies below it; never the Redis side or the use cases.
"""

from orders.events.consumer import (
    ConsumeResult,
    EventConsumer,
    Handler,
    TransactionalHandler,
)
from orders.events.stream import EventPosition, OrderEvent, read_events

__all__ = [
    "ConsumeResult",
    "EventConsumer",
    "EventPosition",
    "Handler",
    "OrderEvent",
    "TransactionalHandler",
    "read_events",
]
