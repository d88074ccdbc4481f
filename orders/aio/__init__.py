"""The asyncio API: :class:`AsyncOrderService`, and module-level functions on a default one.

The functions here await the service :func:`default_service` builds from ``ORDERS_*`` on
first use (or the one given to :func:`configure`)::

    import orders.aio

    order = await orders.aio.create_unpaid_order("user-1")

The calls run the synchronous API's one set of rules in threads the service owns
(:mod:`orders.aio.calls`), over its own connections to the host's stores
(:mod:`orders.aio.clients`). Their errors are the synchronous API's (:mod:`orders.errors`);
:class:`~orders.errors.CreateRateLimited` is also here, beside the calls it refuses.
"""

from __future__ import annotations

from orders.aio.default import build_async_service, configure, default_service, on_default
from orders.aio.service import AsyncOrderService
from orders.errors import CreateRateLimited

create_unpaid_order = on_default(AsyncOrderService.create_unpaid_order)
mark_paid = on_default(AsyncOrderService.mark_paid)
cancel_order = on_default(AsyncOrderService.cancel_order)
extend_order = on_default(AsyncOrderService.extend_order)
get_order = on_default(AsyncOrderService.get_order)
list_unpaid = on_default(AsyncOrderService.list_unpaid)
iter_events = on_default(AsyncOrderService.iter_events)
sweep_expired = on_default(AsyncOrderService.sweep_expired)
reconcile = on_default(AsyncOrderService.reconcile)
refused_payments = on_default(AsyncOrderService.refused_payments)
mark_refund_handled = on_default(AsyncOrderService.mark_refund_handled)
set_user_limit = on_default(AsyncOrderService.set_user_limit)
clear_user_limit = on_default(AsyncOrderService.clear_user_limit)
user_limit = on_default(AsyncOrderService.user_limit)
user_limit_history = on_default(AsyncOrderService.user_limit_history)
set_capacity = on_default(AsyncOrderService.set_capacity)
set_units = on_default(AsyncOrderService.set_units)
units = on_default(AsyncOrderService.units)
resource = on_default(AsyncOrderService.resource)
resources = on_default(AsyncOrderService.resources)
wait_for = on_default(AsyncOrderService.wait_for)
waiting = on_default(AsyncOrderService.waiting)
waiting_entry = on_default(AsyncOrderService.waiting_entry)
leave_waiting = on_default(AsyncOrderService.leave_waiting)

__all__ = [
    "AsyncOrderService",
    "CreateRateLimited",
    "build_async_service",
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
