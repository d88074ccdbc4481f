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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from orders.config import Settings
from orders.domain import Actor, ActorKind, Order, OrderStatus, Payment, SweepResult
from orders.errors import (
    CreateRateLimited,
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
    UnknownUser,
    UnpaidOrderLimitReached,
)
from orders.policies import ExpiryPolicy

if TYPE_CHECKING:
    from orders.service import OrderService

    __version__: str

_P = ParamSpec("_P")
_R = TypeVar("_R")

__all__ = [
    "Actor",
    "ActorKind",
    "CreateRateLimited",
    "ExpiryPolicy",
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
    "SchemaConflict",
    "SchemaNotReady",
    "Settings",
    "StoreUnavailable",
    "SweepResult",
    "UnknownUser",
    "UnpaidOrderLimitReached",
    "cancel_order",
    "clear_user_limit",
    "configure",
    "create_unpaid_order",
    "default_service",
    "extend_order",
    "get_order",
    "iter_events",
    "list_unpaid",
    "mark_paid",
    "mark_refund_handled",
    "reconcile",
    "refused_payments",
    "set_user_limit",
    "sweep_expired",
    "user_limit",
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


def _on_default(method: Callable[[OrderService], Callable[_P, _R]]) -> Callable[_P, _R]:
    """``method`` (a lambda naming an OrderService method) as a function on the default
    service: the lambda runs at the call, so OrderService still loads on first use."""

    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return method(default_service())(*args, **kwargs)

    return call


create_unpaid_order = _on_default(lambda s: s.create_unpaid_order)
mark_paid = _on_default(lambda s: s.mark_paid)
cancel_order = _on_default(lambda s: s.cancel_order)
extend_order = _on_default(lambda s: s.extend_order)
get_order = _on_default(lambda s: s.get_order)
list_unpaid = _on_default(lambda s: s.list_unpaid)
iter_events = _on_default(lambda s: s.iter_events)
sweep_expired = _on_default(lambda s: s.sweep_expired)
reconcile = _on_default(lambda s: s.reconcile)
refused_payments = _on_default(lambda s: s.refused_payments)
mark_refund_handled = _on_default(lambda s: s.mark_refund_handled)
set_user_limit = _on_default(lambda s: s.set_user_limit)
clear_user_limit = _on_default(lambda s: s.clear_user_limit)
user_limit = _on_default(lambda s: s.user_limit)
