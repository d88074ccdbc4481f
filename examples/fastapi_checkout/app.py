"""A checkout API on orders.aio: unpaid orders held against a per-user limit, paid or expired.

Run it (ORDERS_* settings from the environment, see README.md beside this file)::

    uvicorn app:app --workers 3

With several workers, set PROMETHEUS_MULTIPROC_DIR to an empty folder first: then /metrics
answers with the sum over every worker, whichever one serves the scrape.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from decimal import Decimal
from typing import Annotated

from fastapi import Body, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

import orders.aio
from orders import metrics
from orders.aio import AsyncOrderService
from orders.errors import (
    CreateRateLimited,
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderNotFound,
    OrdersError,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    metrics.register()  # a wrong PROMETHEUS_MULTIPROC_DIR stops the worker here, not later
    # One service per worker process, built on the worker's event loop.
    app.state.orders = await orders.aio.build_async_service()
    try:
        yield
    finally:
        await app.state.orders.aclose()


app = FastAPI(title="checkout", lifespan=lifespan)


def order_service(request: Request) -> AsyncOrderService:
    service: AsyncOrderService = request.app.state.orders
    return service


Service = Annotated[AsyncOrderService, Depends(order_service)]


class NewOrder(BaseModel):
    order_id: str | None = None  # give one to make retries of the same request safe
    amount: Decimal | None = None
    currency: str | None = None


class Payment(BaseModel):
    payment_ref: str  # the payment provider's reference: what a refund would need


class OrderOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # read straight off orders.domain.Order

    id: str
    user_id: str
    status: str
    amount: Decimal | None
    currency: str | None
    created_at: datetime
    expires_at: datetime
    paid_at: datetime | None
    closed_at: datetime | None
    payment_ref: str | None


class LatePayment(OrderClosed):
    """A payment for a closed or cancelled order: it must be refunded with ``payment_ref``."""

    def __init__(self, closed: OrderClosed, payment_ref: str) -> None:
        super().__init__(closed.order_id, closed.status)
        self.payment_ref = payment_ref


@app.post("/users/{user_id}/orders", status_code=201)
async def create_order(
    user_id: str, service: Service, body: Annotated[NewOrder | None, Body()] = None
) -> OrderOut:
    body = body or NewOrder()
    order = await service.create_unpaid_order(
        user_id, order_id=body.order_id, amount=body.amount, currency=body.currency
    )
    return OrderOut.model_validate(order)


@app.post("/orders/{order_id}/pay")
async def pay_order(order_id: str, payment: Payment, service: Service) -> OrderOut:
    try:
        order = await service.mark_paid(order_id, payment_ref=payment.payment_ref)
    except OrderClosed as exc:  # the error does not know the payment: add it, for the refund
        raise LatePayment(exc, payment.payment_ref) from exc
    return OrderOut.model_validate(order)


@app.get("/users/{user_id}/orders")
async def open_orders(user_id: str, service: Service) -> list[OrderOut]:
    return [OrderOut.model_validate(order) for order in await service.list_unpaid(user_id)]


@app.get("/metrics")
def prometheus_metrics() -> Response:
    # A plain def: FastAPI runs it on a thread, as reading every worker's files blocks.
    body, content_type = metrics.exposition()
    return Response(body, media_type=content_type)


@app.exception_handler(OrdersError)
async def orders_error(request: Request, exc: OrdersError) -> JSONResponse:
    """Every error of the service, as an HTTP answer: the one place they are mapped."""
    body: dict[str, object] = {"error": type(exc).__name__, "detail": str(exc)}
    headers: dict[str, str] = {}
    match exc:
        case UnpaidOrderLimitReached() | CreateRateLimited():
            status = 429
            retry_after_s = max(1, math.ceil(exc.retry_after_s))  # 0 means unknown
            headers["Retry-After"] = str(retry_after_s)
            body |= {"limit": exc.limit, "retry_after_s": retry_after_s}
            if isinstance(exc, CreateRateLimited):
                body["window_s"] = exc.window_s
            else:
                body["open_count"] = exc.open_count
        case LatePayment():
            status = 409
            body |= {"order_id": exc.order_id, "status": exc.status}
            body["refund"] = {"required": True, "payment_ref": exc.payment_ref}
            body["detail"] = f"the order is {exc.status}: the payment must be refunded"
        case OrderClosed() | OrderAlreadyPaid() | OrderConflict():
            status = 409
            body["order_id"] = exc.order_id
        case OrderNotFound():
            status = 404
            body["order_id"] = exc.order_id
        case InvalidInput():
            status = 422
            body["field"] = exc.field
        case StoreUnavailable():
            status = 503
            headers["Retry-After"] = "1"
        case _:
            status = 500
    return JSONResponse(body, status_code=status, headers=headers)
