"""The scheduler's event jobs: the durable consumers of the event hooks (``on_closed``,
``on_payment_refused``, registered in code or named in the settings) and the job that runs
them (or the webhook's consumer) on the active scheduler. :mod:`orders.scheduler.jobs`
schedules them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable
from importlib import import_module
from typing import Any

from orders import metrics
from orders.domain import EventKind
from orders.errors import InvalidInput, StoreUnavailable
from orders.events.admin import parked_counts
from orders.events.consumer import EventConsumer
from orders.events.stream import OrderEvent
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService

#: The width of ``event_cursors.name``.
CONSUMER_NAME_LENGTH = 64
#: How often the events job looks for new events.
EVENTS_INTERVAL_S = 0.5


def load_handler(path: str, setting: str = "on_closed") -> Callable[[OrderEvent], None]:
    """``package.module:function`` (or ``package.module.function``) to the function;
    ``setting`` names the setting it came from in an error."""
    module_name, _, attr = path.strip().replace(":", ".").rpartition(".")
    if not module_name or not attr:
        raise InvalidInput(setting, "must name handlers as package.module:function")
    try:
        handler: Callable[[OrderEvent], None] = getattr(import_module(module_name), attr)
    except (ImportError, AttributeError):
        raise InvalidInput(setting, f"cannot import the handler {path.strip()}") from None
    return handler


def consumer_name(handler: Callable[[OrderEvent], None], hook: str = "on_closed") -> str:
    """The durable cursor's name for a ``hook`` handler (``on_closed``,
    ``on_payment_refused``): at most 64 characters.

    A name cut to fit ends in a hash of the whole, so two handlers whose names share a
    long prefix never share a cursor (one would silently skip what the other consumed).
    """
    name = f"{hook}:{handler.__module__}.{handler.__qualname__}"
    if len(name) <= CONSUMER_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{name[: CONSUMER_NAME_LENGTH - 13]}~{digest}"


#: The event hooks: setting (and cursor prefix) -> the kind of event its handlers get.
HOOK_KINDS = {"on_closed": EventKind.CLOSED, "on_payment_refused": EventKind.PAYMENT_REFUSED}


def closed_order_consumers(service: OrderService) -> list[EventConsumer]:
    """One durable consumer per hook handler, registered in code (``on_closed``,
    ``on_payment_refused``) or configured (the settings of the same names)."""
    registered = {
        "on_closed": service.closed_handlers,
        "on_payment_refused": service.refused_payment_handlers,
    }
    consumers = []
    for hook, kind in HOOK_KINDS.items():
        configured: str = getattr(service.settings, hook)
        handlers = list(registered[hook])
        handlers += [load_handler(p, hook) for p in configured.split(",") if p.strip()]
        names = [consumer_name(h, hook) for h in handlers]
        if len(set(names)) != len(names):
            raise InvalidInput(hook, "names one handler twice")
        consumers += [
            EventConsumer(
                service.engine,
                name,
                handler,
                kinds=[kind],
                clock=service.clock,
                max_attempts=service.settings.event_max_attempts,
                start="oldest",  # the closes the sweep made before the job's first run too
            )
            for name, handler in zip(names, handlers, strict=True)
        ]
    return consumers


class EventsJob:
    """Runs the closed-order handlers; only the active scheduler does (the lease holder).

    A consumer whose store fails logs ``handlers_failed`` once, and ``handlers_back`` once
    it runs again, not once per run. Its runs are counted in the sweeper's summary line.

    After each run the ``orders_parked_events`` gauge is set for every consumer it has
    ever shown, 0 for one with nothing parked any more (a label is never left at an old
    value); a standby shows 0 for all, as it does for the backlog.
    """

    def __init__(
        self, sweeper: Sweeper, consumers: list[EventConsumer], *, limit: int | None = None
    ) -> None:
        self.sweeper = sweeper
        self.consumers = consumers
        #: Events per consumer per run (None: run_once's own default).
        self.limit = limit
        self._failing: set[str] = set()
        self._shown: set[str] = {consumer.name for consumer in consumers}

    def __call__(self) -> float:
        if self.sweeper.stopping or not self.sweeper.holds_lease:
            self._show_parked({})
            return EVENTS_INTERVAL_S
        self._run_consumers()
        with contextlib.suppress(StoreUnavailable):  # the consumers' failure was logged
            self._show_parked(parked_counts(self.sweeper.service.engine))
        return EVENTS_INTERVAL_S

    def _show_parked(self, parked: dict[str, int]) -> None:
        self._shown.update(parked)
        for name in self._shown:
            metrics.PARKED_EVENTS.labels(name).set(parked.get(name, 0))

    def _run_consumers(self) -> None:
        for consumer in self.consumers:
            try:
                result = (
                    consumer.run_once() if self.limit is None else consumer.run_once(self.limit)
                )
            except StoreUnavailable as exc:
                if consumer.name not in self._failing:
                    self._failing.add(consumer.name)
                    self._log(logging.WARNING, "handlers_failed", consumer.name, detail=str(exc))
                continue
            if consumer.name in self._failing:
                self._failing.discard(consumer.name)
                self._log(logging.INFO, "handlers_back", consumer.name)
            self.sweeper.add_handler_run(consumer.name, result)

    def _log(self, level: int, event: str, consumer: str, **fields: Any) -> None:
        self.sweeper.log_event(level, event, consumer=consumer, **fields)
