"""orders: at most a few unpaid orders per user, each closing on its own when its time is up.

Two ways to use it. Module-level functions bound to a default service that is configured
from ``ORDERS_*`` environment variables on first use (nothing connects at import, and
SQLAlchemy and redis-py load only with the service)::

    import orders
    order = orders.create_unpaid_order("user-7", amount="19.90", currency="EUR")
    orders.mark_paid(order.id, payment_ref="psp-123")

Or an :class:`OrderService` that a host application builds from its own SQLAlchemy engine
and redis-py client::

    service = orders.OrderService(engine, redis_client, orders.Settings(unpaid_limit=3))
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from orders.config import Settings
from orders.domain import Actor, ActorKind, Order, OrderStatus, Payment, SweepResult
from orders.errors import (
    CreateRateLimited,
    HoldRefused,
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrderNotFound,
    OrdersError,
    Overloaded,
    PaymentMismatch,
    RefundOwed,
    SchemaConflict,
    SchemaNotReady,
    StoreUnavailable,
    UnknownResource,
    UnknownUser,
    UnpaidOrderLimitReached,
    WaitingEntryNotFound,
)
from orders.inventory import Resource, WaitingEntry
from orders.policies import ExpiryPolicy

if TYPE_CHECKING:
    from orders.events.stream import EventPosition, OrderEvent
    from orders.rules.reconcile import ReconcileReport
    from orders.service import OrderService
    from orders.sql.refusals import PaymentRefusal
    from orders.sql.user_limits import LimitChange, UserLimit

    __version__: str

__all__ = [
    "Actor",
    "ActorKind",
    "CreateRateLimited",
    "ExpiryPolicy",
    "HoldRefused",
    "InvalidInput",
    "Order",
    "OrderAlreadyPaid",
    "OrderClosed",
    "OrderConflict",
    "OrderNotFound",
    "OrderService",
    "OrderStatus",
    "OrdersError",
    "Overloaded",
    "Payment",
    "PaymentMismatch",
    "RefundOwed",
    "Resource",
    "SchemaConflict",
    "SchemaNotReady",
    "Settings",
    "StoreUnavailable",
    "SweepResult",
    "UnknownResource",
    "UnknownUser",
    "UnpaidOrderLimitReached",
    "WaitingEntry",
    "WaitingEntryNotFound",
    "cancel_order",
    "clear_user_limit",
    "configure",
    "create_unpaid_order",
    "default_service",
    "extend_order",
    "get_order",
    "iter_events",
    "leave_waiting",
    "list_unpaid",
    "mark_paid",
    "mark_refund_handled",
    "reconcile",
    "refused_payments",
    "resource",
    "resources",
    "set_capacity",
    "set_units",
    "set_user_limit",
    "sweep_expired",
    "units",
    "user_limit",
    "user_limit_history",
    "wait_for",
    "waiting",
    "waiting_entry",
]


def __getattr__(name: str) -> Any:
    """Load on first use what importing ``orders`` need not pay for (PEP 562).

    ``OrderService`` pulls in SQLAlchemy, redis-py and the rest of the service, and
    ``__version__`` the package metadata; a command such as ``orders --help`` needs neither.
    """
    if name == "OrderService":
        from orders.service import OrderService  # noqa: PLC0415

        value: Any = OrderService
    elif name == "__version__":
        value = _installed_version()
    else:
        raise AttributeError(f"module 'orders' has no attribute {name!r}")
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__"})


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("orders")
    except PackageNotFoundError:  # imported from a source tree that was never pip-installed
        return "0+unknown"


_default: OrderService | None = None
_default_lock = threading.Lock()


def default_service() -> OrderService:
    """The service behind the module-level functions, built from ``ORDERS_*`` on first use."""
    global _default  # noqa: PLW0603
    with _default_lock:
        if _default is None:
            from orders.bootstrap import build_service  # noqa: PLC0415

            _default = build_service(Settings.from_env())
        return _default


def configure(service: OrderService | None) -> None:
    """Bind the module-level functions to ``service`` (None: rebuild from the environment)."""
    global _default  # noqa: PLW0603
    with _default_lock:
        _default = service


def create_unpaid_order(
    user_id: str | int,
    *,
    order_id: str | None = None,
    ttl_s: float | None = None,
    limit: int | None = None,
    amount: Decimal | int | str | None = None,
    currency: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    actor: str | Actor | None = None,
    on_limit: str | None = None,
    policy: str | None = None,
    expires_at: datetime | None = None,
    holds: Mapping[str, int | Sequence[str]] | None = None,
) -> Order:
    """See :meth:`OrderService.create_unpaid_order`."""
    return default_service().create_unpaid_order(
        user_id,
        order_id=order_id,
        ttl_s=ttl_s,
        limit=limit,
        amount=amount,
        currency=currency,
        metadata=metadata,
        actor=actor,
        on_limit=on_limit,
        policy=policy,
        expires_at=expires_at,
        holds=holds,
    )


def mark_paid(
    order_id: str,
    *,
    payment_ref: str | None = None,
    amount: Decimal | int | str | None = None,
    currency: str | None = None,
    actor: str | Actor | None = None,
) -> Order:
    """See :meth:`OrderService.mark_paid`."""
    return default_service().mark_paid(
        order_id, payment_ref=payment_ref, amount=amount, currency=currency, actor=actor
    )


def cancel_order(
    order_id: str, *, reason: str | None = None, actor: str | Actor | None = None
) -> Order:
    """See :meth:`OrderService.cancel_order`."""
    return default_service().cancel_order(order_id, reason=reason, actor=actor)


def get_order(order_id: str) -> Order:
    """See :meth:`OrderService.get_order`."""
    return default_service().get_order(order_id)


def list_unpaid(user_id: str | int) -> list[Order]:
    """See :meth:`OrderService.list_unpaid`."""
    return default_service().list_unpaid(user_id)


def sweep_expired(*, batch_size: int | None = None, max_batches: int | None = None) -> SweepResult:
    """See :meth:`OrderService.sweep_expired`."""
    return default_service().sweep_expired(batch_size=batch_size, max_batches=max_batches)


def extend_order(order_id: str, extra_s: float, *, actor: str | Actor | None = None) -> Order:
    """See :meth:`OrderService.extend_order`."""
    return default_service().extend_order(order_id, extra_s, actor=actor)


def iter_events(*, after: EventPosition | None = None, limit: int = 100) -> list[OrderEvent]:
    """See :meth:`OrderService.iter_events`."""
    return default_service().iter_events(after=after, limit=limit)


def reconcile(*, user_id: str | None = None, dry_run: bool = False) -> ReconcileReport:
    """See :meth:`OrderService.reconcile`."""
    return default_service().reconcile(user_id=user_id, dry_run=dry_run)


def refused_payments(
    *, since_ms: int | None = None, pending_only: bool = False, limit: int = 100
) -> list[PaymentRefusal]:
    """See :meth:`OrderService.refused_payments`."""
    return default_service().refused_payments(
        since_ms=since_ms, pending_only=pending_only, limit=limit
    )


def mark_refund_handled(
    order_id: str, payment_ref: str | None = None, *, actor: str | Actor | None = None
) -> PaymentRefusal:
    """See :meth:`OrderService.mark_refund_handled`."""
    return default_service().mark_refund_handled(order_id, payment_ref, actor=actor)


def set_user_limit(
    user_id: str | int, limit: int, *, actor: str | Actor | None = None
) -> UserLimit:
    """See :meth:`OrderService.set_user_limit`."""
    return default_service().set_user_limit(user_id, limit, actor=actor)


def clear_user_limit(user_id: str | int, *, actor: str | Actor | None = None) -> UserLimit:
    """See :meth:`OrderService.clear_user_limit`."""
    return default_service().clear_user_limit(user_id, actor=actor)


def user_limit(user_id: str | int) -> UserLimit:
    """See :meth:`OrderService.user_limit`."""
    return default_service().user_limit(user_id)


def user_limit_history(user_id: str | int, *, limit: int = 100) -> list[LimitChange]:
    """See :meth:`OrderService.user_limit_history`."""
    return default_service().user_limit_history(user_id, limit=limit)


def set_capacity(
    resource_id: str,
    capacity: int,
    *,
    per_user: int | None = None,
    actor: str | Actor | None = None,
) -> Resource:
    """See :meth:`OrderService.set_capacity`."""
    return default_service().set_capacity(resource_id, capacity, per_user=per_user, actor=actor)


def set_units(
    resource_id: str, units: Sequence[str], *, actor: str | Actor | None = None
) -> Resource:
    """See :meth:`OrderService.set_units`."""
    return default_service().set_units(resource_id, units, actor=actor)


def units(resource_id: str) -> dict[str, list[str]]:
    """See :meth:`OrderService.units`."""
    return default_service().units(resource_id)


def resource(resource_id: str) -> Resource:
    """See :meth:`OrderService.resource`."""
    return default_service().resource(resource_id)


def resources(*, after: str | None = None, limit: int = 100) -> list[Resource]:
    """See :meth:`OrderService.resources`."""
    return default_service().resources(after=after, limit=limit)


def wait_for(
    user_id: str | int,
    resource_id: str,
    quantity: int = 1,
    *,
    until: datetime | None = None,
    actor: str | Actor | None = None,
) -> WaitingEntry:
    """See :meth:`OrderService.wait_for`."""
    return default_service().wait_for(user_id, resource_id, quantity, until=until, actor=actor)


def waiting(resource_id: str) -> list[WaitingEntry]:
    """See :meth:`OrderService.waiting`."""
    return default_service().waiting(resource_id)


def waiting_entry(entry_id: int) -> WaitingEntry:
    """See :meth:`OrderService.waiting_entry`."""
    return default_service().waiting_entry(entry_id)


def leave_waiting(entry_id: int) -> WaitingEntry:
    """See :meth:`OrderService.leave_waiting`."""
    return default_service().leave_waiting(entry_id)
