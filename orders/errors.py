"""Every error the service raises on purpose.

The tree, so a caller can catch as broadly or as narrowly as it likes::

    OrdersError
     ├── InvalidInput              bad argument; nothing was written
     │    └── OrderConflict        an order id reused for another user or amount
     ├── OrderNotFound             no order with that id
     ├── UnpaidOrderLimitReached   the user already holds `limit` open unpaid orders
     ├── CreateRateLimited         the user started `limit` creates in the last `window_s`
     ├── OrderClosed               closed or cancelled: a late payment must be refunded
     │    └── OrderExpired         unpaid, but its time is up: the sweep will close it
     ├── OrderAlreadyPaid          paid already (with another payment reference)
     ├── PaymentMismatch           the payment's amount or currency is not the order's
     ├── RefundOwed                erasure refused: a refund of the user's is still owed
     ├── UnknownUser               erasure of a user the service never held
     ├── UnknownResource           no counted resource with that id (set_capacity first)
     ├── WaitingEntryNotFound      no waiting-list entry with that id
     ├── SchemaConflict            a name our schema needs is taken by something else
     └── StoreUnavailable          Redis or SQL failed; the operation did not happen
          ├── SchemaNotReady       the database has no (or an old) schema
          ├── RedisServerMissing   the embedded default found no server binary to start
          └── RedisServerTooOld    the embedded default's server binary is too old

Exceptions from redis-py and SQLAlchemy are translated into these at the edge, with
``raise ... from exc`` so the cause is kept for debugging but never part of the contract.
A refused payment (:class:`OrderClosed`, :class:`OrderAlreadyPaid`, :class:`PaymentMismatch`
from ``mark_paid``) carries ``refusal``: the (transaction id, event id) position of the
``payment_refused`` event that records the refund owed, committed before the error was
raised (``EventPosition(*error.refusal)``); None where no payment was refused.

Messages never contain the raw offending value (it may be hostile or huge) nor a
password from a connection URL.
"""

from __future__ import annotations

import math


class OrdersError(Exception):
    """Base of every error raised by the ``orders`` package."""


class InvalidInput(OrdersError, ValueError):
    """An argument was refused before anything was written.

    ``field`` names the argument; the message says what is wrong without echoing it.
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"invalid {field}: {problem}")
        self.field = field
        self.problem = problem


class OrderConflict(InvalidInput):
    """A caller-supplied order id already names a different order."""

    def __init__(self, order_id: str, problem: str) -> None:
        super().__init__("order_id", problem)
        self.order_id = order_id


class OrderNotFound(OrdersError, LookupError):
    def __init__(self, order_id: str) -> None:
        super().__init__("no order with that id")
        self.order_id = order_id


class UnpaidOrderLimitReached(OrdersError):
    """The user holds ``open_count`` unpaid orders and may hold at most ``limit``.

    ``retry_after_s`` is the time until the earliest of them expires (0 if unknown).
    ``source`` says who refused: ``"redis"`` (the index) or ``"sql"`` (the SQL guard).
    ``limit`` is 0 when the user's own limit blocks every unpaid order (``set_user_limit``):
    the message says so, and waiting does not help (``retry_after_s`` is 0).
    """

    def __init__(
        self,
        user_id: str,
        limit: int,
        open_count: int,
        retry_after_s: float,
        source: str = "redis",
    ) -> None:
        if limit == 0:
            retry_after_s = 0.0
            message = "unpaid orders blocked: this user may hold no unpaid orders (limit 0)"
        else:
            message = (
                f"unpaid order limit reached: {open_count} open of {limit}; "
                f"retry in {math.ceil(retry_after_s)} s"
            )
        super().__init__(message)
        self.user_id = user_id
        self.limit = limit
        self.open_count = open_count
        self.retry_after_s = retry_after_s
        self.source = source


class HoldRefused(OrdersError):
    """A create's holds were refused and nothing was written: ``resource_id`` is the first
    resource of the cart (in id order) that could not be held, ``reason`` one of
    ``sold_out`` (fewer than ``requested`` units free), ``user_cap`` (the user would hold or
    have bought more than the resource's ``per_user``), ``unknown_resource`` or ``taken``
    (named units asked for by name are held or sold: ``units`` names them); ``free`` is
    what could still be held of it (for ``user_cap``: by this user), None when unknown.
    ``source`` says who refused: ``redis`` (the index, no SQL asked) or ``sql``."""

    def __init__(
        self,
        resource_id: str,
        reason: str,
        requested: int,
        free: int | None,
        source: str = "sql",
        units: tuple[str, ...] = (),
    ) -> None:
        left = "" if free is None else f"; {max(free, 0)} free"
        named = f": {', '.join(units[:10])}{' ...' if len(units) > 10 else ''}" if units else ""
        super().__init__(
            f"hold refused on {resource_id}: {reason}{named} ({requested} asked{left})"
        )
        self.units = units
        self.resource_id = resource_id
        self.reason = reason
        self.requested = requested
        self.free = None if free is None else max(free, 0)
        self.source = source


class UnknownResource(OrdersError, LookupError):
    """SQL has no counted resource ``resource_id`` (``service.set_capacity`` creates one)."""

    def __init__(self, resource_id: str) -> None:
        super().__init__("no resource with that id")
        self.resource_id = resource_id


class CreateRateLimited(OrdersError):
    """The user started ``limit`` creates in the last ``window_s`` seconds
    (``Settings.create_rate``); cancelling or paying orders does not lift it.

    ``retry_after_s`` is the time until the oldest of them leaves the window.
    """

    def __init__(self, user_id: str, limit: int, window_s: float, retry_after_s: float) -> None:
        super().__init__(
            f"create rate reached: {limit} creates in {window_s:g} s; "
            f"retry in {math.ceil(retry_after_s)} s"
        )
        self.user_id = user_id
        self.limit = limit
        self.window_s = window_s
        self.retry_after_s = retry_after_s


#: Where a refused payment's ``payment_refused`` event stands: (transaction id, event id).
RefusalPosition = tuple[int, int]


class OrderClosed(OrdersError):
    """The order is ``closed`` or ``cancelled``: a payment for it must be refunded (and
    ``refusal`` says where its ``payment_refused`` event is)."""

    def __init__(self, order_id: str, status: str, refusal: RefusalPosition | None = None) -> None:
        super().__init__(f"order is {status}")
        self.order_id = order_id
        self.status = status
        self.refusal = refusal


class OrderExpired(OrderClosed):
    """The order's time is up (the sweep has not closed it yet): it cannot be extended."""

    def __init__(self, order_id: str) -> None:
        super().__init__(order_id, "expired")


class OrderAlreadyPaid(OrdersError):
    """The order was paid before, with ``payment_ref``; a second payment is refunded
    (``refusal`` says where its ``payment_refused`` event is)."""

    def __init__(
        self, order_id: str, payment_ref: str | None, refusal: RefusalPosition | None = None
    ) -> None:
        super().__init__("order is already paid with another payment reference")
        self.order_id = order_id
        self.payment_ref = payment_ref
        self.refusal = refusal


class PaymentMismatch(OrdersError):
    """The payment states an amount (or currency) other than the order's: it did not pay
    the order, and ``refusal`` says where its ``payment_refused`` event is. ``field`` is
    ``"amount"`` or ``"currency"``."""

    def __init__(self, order_id: str, field: str, refusal: RefusalPosition | None) -> None:
        super().__init__(f"the payment's {field} is not the order's; it did not pay the order")
        self.order_id = order_id
        self.field = field
        self.refusal = refusal


class RefundOwed(OrdersError):
    """``erase_user`` refused: ``pending`` refused payments of the user's orders have no
    refund marked handled yet (``orders payments refused --pending``); nothing was written.
    The payment references are needed until the refunds are done."""

    def __init__(self, user_id: str, pending: int) -> None:
        super().__init__(
            f"{pending} refund(s) of this user's refused payments not yet marked handled: "
            "see orders payments refused; nothing was erased"
        )
        self.user_id = user_id
        self.pending = pending


class UnknownUser(OrdersError, LookupError):
    """``erase_user`` of a user with no order, no own limit and no erasure on record."""

    def __init__(self, user_id: str) -> None:
        super().__init__("no order, limit or erasure of that user")
        self.user_id = user_id


class SchemaConflict(OrdersError):
    """A table or index our schema needs already exists and is not ours: the database
    records no revision of ours, so something else (a host application) created it.

    ``kind`` is what the database holds under that name ("table", "index", ...), ``name``
    the name, ``outcome`` what was (not) done about it. Not a StoreUnavailable: retrying
    cannot help, an operator must rename it, drop it or give orders another database.
    """

    def __init__(self, kind: str, name: str, outcome: str) -> None:
        super().__init__(
            f"{kind} '{name}' already exists in the database and is not orders' "
            f"(created by something else); {outcome}"
        )
        self.kind = kind
        self.name = name
        self.outcome = outcome


class StoreUnavailable(OrdersError):
    """A store (``store`` is ``"redis"`` or ``"sql"``) failed, or orders.aio had no room for
    the call (``"service"``: :class:`Overloaded`); the operation did not happen."""

    def __init__(self, store: str, detail: str) -> None:
        super().__init__(f"{store} unavailable: {detail}")
        self.store = store
        self.detail = detail


class Overloaded(StoreUnavailable):
    """orders.aio: more calls are waiting for a thread than ``aio_queue`` allows; this one
    was refused before it started (nothing was written). Retry later, as for a store."""

    def __init__(self, waiting: int) -> None:
        super().__init__("service", f"{waiting} calls already wait for a thread (aio_queue)")


class SchemaNotReady(StoreUnavailable):
    """The database schema is missing or older than this code: run ``orders db upgrade``."""

    def __init__(self, detail: str) -> None:
        super().__init__("sql", f"{detail}; run `orders db upgrade`")


class RedisServerMissing(StoreUnavailable):
    """The embedded default needs a redis-server (or valkey-server) binary and found none;
    ``how_to_fix`` says where one comes from."""

    def __init__(self, how_to_fix: str) -> None:
        super().__init__("redis", f"no redis-server or valkey-server found: {how_to_fix}")


class RedisServerTooOld(StoreUnavailable):
    """The embedded default's server binary is older than ``minimum`` (``major.minor``)."""

    def __init__(self, binary: str, version: str, minimum: str, how_to_fix: str) -> None:
        super().__init__(
            "redis", f"{binary} is version {version}, older than {minimum}: {how_to_fix}"
        )
        self.binary = binary
        self.version = version
        self.minimum = minimum


class WaitingEntryNotFound(OrdersError, LookupError):
    """SQL has no waiting-list entry ``entry_id`` (``service.wait_for`` makes one)."""

    def __init__(self, entry_id: int) -> None:
        super().__init__("no waiting-list entry with that id")
        self.entry_id = entry_id
