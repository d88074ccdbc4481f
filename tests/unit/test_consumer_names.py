"""Names of the durable cursors the scheduler keeps for closed-order handlers."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from orders.errors import InvalidInput
from orders.scheduler.event_jobs import CONSUMER_NAME_LENGTH, closed_order_consumers, consumer_name


def handler_named(qualname: str) -> Callable[[Any], None]:
    def handler(_event: Any) -> None:
        return None

    handler.__qualname__ = qualname
    return handler


def test_a_short_name_is_kept_whole() -> None:
    assert consumer_name(handler_named("release")) == f"on_closed:{__name__}.release"


def test_long_names_that_share_a_prefix_get_different_cursors() -> None:
    prefix = "a_long_enclosing_function_name_for_handlers.<locals>."
    first = consumer_name(handler_named(prefix + "release_stock"))
    second = consumer_name(handler_named(prefix + "notify_customer"))
    assert first != second
    assert len(first) == len(second) == CONSUMER_NAME_LENGTH


def test_one_handler_named_twice_is_refused() -> None:
    # Only what closed_order_consumers reads of a service.
    service = SimpleNamespace(
        closed_handlers=[handler_named("twice"), handler_named("twice")],
        refused_payment_handlers=[],
        settings=SimpleNamespace(on_closed="", on_payment_refused="", event_max_attempts=3),
        engine=None,
        clock=None,
    )
    with pytest.raises(InvalidInput):
        closed_order_consumers(service)  # type: ignore[arg-type]
