"""The checkout and the payment provider's webhook, each one transaction on Django's
database with the order orders holds for it."""

from __future__ import annotations

import json
import math
from decimal import Decimal, InvalidOperation
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from orders.cli.render import order_to_json
from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderNotFound,
    OrdersError,
    StoreUnavailable,
    UnpaidOrderLimitReached,
)
from shop.glue import order_service, order_transaction
from shop.models import Cart


def start_payment(cart: Cart) -> str:
    """Ask the payment provider for a payment of the cart; its reference. (A stand-in: a
    real one calls the provider, and may fail after the order was created.)"""
    return f"intent-{cart.order_id}"


@csrf_exempt
@require_POST
def checkout(request: HttpRequest, user_id: str) -> JsonResponse:
    """The cart and its unpaid order, together or not at all: 201, or 429 at the limit."""
    try:
        body = json.loads(request.body or b"{}")
        total = Decimal(str(body["total"]))
        currency = str(body.get("currency", "EUR"))
    except (ValueError, KeyError, TypeError, InvalidOperation):
        return JsonResponse({"error": "InvalidInput", "field": "total"}, status=422)
    try:
        with order_transaction() as conn:
            cart = Cart.objects.create(user_id=user_id, total=total, currency=currency)
            order = order_service().create_unpaid_order(
                user_id, amount=total, currency=currency, connection=conn
            )
            cart.order_id = order.id
            cart.save(update_fields=["order_id"])
            intent = start_payment(cart)
    except OrdersError as exc:
        return error_response(exc)
    return JsonResponse(
        {"cart": cart.pk, "payment_intent": intent, **order_to_json(order)}, status=201
    )


@csrf_exempt
@require_POST
def payment_webhook(request: HttpRequest, order_id: str) -> JsonResponse:
    """The provider says the order's payment went through: the order is paid and its cart
    records the payment, in one transaction; 409 with the reference to refund when the
    order was closed or cancelled first."""
    try:
        payment_ref = str(json.loads(request.body)["payment_ref"])
    except (ValueError, KeyError, TypeError):
        return JsonResponse({"error": "InvalidInput", "field": "payment_ref"}, status=422)
    try:
        with order_transaction() as conn:
            order = order_service().mark_paid(order_id, payment_ref=payment_ref, connection=conn)
            Cart.objects.filter(order_id=order_id).update(payment_ref=payment_ref)
    except OrdersError as exc:
        return error_response(exc, payment_ref=payment_ref)
    return JsonResponse(order_to_json(order))


def error_response(exc: OrdersError, payment_ref: str | None = None) -> JsonResponse:
    """Every error of the service as an HTTP answer: the one place they are mapped."""
    body: dict[str, Any] = {"error": type(exc).__name__, "detail": str(exc)}
    headers: dict[str, str] = {}
    match exc:
        case UnpaidOrderLimitReached():
            status = 429
            retry_after_s = max(1, math.ceil(exc.retry_after_s))  # 0 means unknown
            headers["Retry-After"] = str(retry_after_s)
            body |= {"limit": exc.limit, "open_count": exc.open_count}
        case OrderClosed() if payment_ref is not None:
            status = 409  # paid too late: the money must go back
            body |= {"order_id": exc.order_id, "status": exc.status}
            body["refund"] = {"required": True, "payment_ref": payment_ref}
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
    return JsonResponse(body, status=status, headers=headers)
