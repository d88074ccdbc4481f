"""The FastAPI example's one exception handler: each error of the service, as HTTP.

tests/e2e/test_fastapi_example.py runs the app for real; here the rounding of Retry-After
and each row of the mapping are checked exactly, without a server.
"""

from __future__ import annotations

import asyncio
import json
from types import ModuleType
from typing import Any, cast

import pytest

from orders.errors import (
    CreateRateLimited,
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderExpired,
    OrderNotFound,
    OrdersError,
    SchemaNotReady,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from tests.support.examples import load_example


@pytest.fixture(scope="module")
def example() -> ModuleType:
    return load_example("fastapi_checkout/app.py", "fastapi_checkout_app")


def answer(example: ModuleType, exc: OrdersError) -> tuple[int, dict[str, str], dict[str, Any]]:
    response = asyncio.run(example.orders_error(None, exc))
    return response.status_code, dict(response.headers), json.loads(response.body)


def test_the_create_rate_is_429_with_retry_after_and_its_window(example: ModuleType) -> None:
    status, headers, body = answer(example, CreateRateLimited("u1", 10, 3600, 1799.5))
    assert (status, headers["retry-after"]) == (429, "1800")
    assert body["error"] == "CreateRateLimited"
    assert (body["limit"], body["window_s"], body["retry_after_s"]) == (10, 3600, 1800)


@pytest.mark.parametrize(
    ("retry_after_s", "header"),
    [(1799.001, "1800"), (1800.0, "1800"), (0.2, "1"), (2.5, "3"), (0.0, "1")],
)
def test_the_limit_is_429_with_retry_after_in_whole_seconds_rounded_up(
    example: ModuleType, retry_after_s: float, header: str
) -> None:
    status, headers, body = answer(example, UnpaidOrderLimitReached("u1", 2, 2, retry_after_s))
    assert (status, headers["retry-after"]) == (429, header)
    assert body["error"] == "UnpaidOrderLimitReached"
    assert (body["limit"], body["open_count"], body["retry_after_s"]) == (2, 2, int(header))


@pytest.mark.parametrize("closed", [OrderClosed("o1", "closed"), OrderClosed("o1", "cancelled")])
def test_a_late_payment_is_409_with_the_reference_to_refund(
    example: ModuleType, closed: OrderClosed
) -> None:
    status, _, body = answer(example, example.LatePayment(closed, "psp-9"))
    assert status == 409
    assert body["refund"] == {"required": True, "payment_ref": "psp-9"}
    assert (body["order_id"], body["status"]) == ("o1", closed.status)
    assert "must be refunded" in body["detail"]


@pytest.mark.parametrize(
    ("exc", "status", "extra"),
    [
        (OrderAlreadyPaid("o1", "psp-1"), 409, {"order_id": "o1"}),
        (OrderConflict("o1", "used by another user"), 409, {"order_id": "o1"}),
        (OrderExpired("o1"), 409, {"order_id": "o1"}),
        (OrderNotFound("o1"), 404, {"order_id": "o1"}),
        (InvalidInput("currency", "must be 3 letters"), 422, {"field": "currency"}),
        (StoreUnavailable("redis", "refused"), 503, {}),
        (SchemaNotReady("missing"), 503, {}),
        (OrdersError("anything else"), 500, {}),
    ],
    ids=lambda value: type(value).__name__ if isinstance(value, Exception) else None,
)
def test_every_other_error_has_its_status(
    example: ModuleType, exc: OrdersError, status: int, extra: dict[str, str]
) -> None:
    got, headers, body = answer(example, exc)
    assert got == status
    assert body == {"error": type(exc).__name__, "detail": str(exc), **extra}
    assert "refund" not in body  # only a payment the client just made is refunded
    assert ("retry-after" in headers) == (status == 503)
    assert "psp-1" not in json.dumps(body)  # another payment's reference is not shown


def test_the_app_serves_the_three_routes(example: ModuleType) -> None:
    routes = {
        (method, route.path)
        for route in cast(Any, example.app).routes
        for method in getattr(route, "methods", ())
    }
    assert {
        ("POST", "/users/{user_id}/orders"),
        ("POST", "/orders/{order_id}/pay"),
        ("GET", "/users/{user_id}/orders"),
    } <= routes
