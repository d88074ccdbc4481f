"""Order states, the Order value, and the rules about them: no I/O here.

Input checks live in :mod:`orders.validation`; this module says what an order is, when it
counts against its user, and which error a caller gets when a transition finds it terminal.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum
from typing import Any

from orders.errors import (
    InvalidInput,
    OrderAlreadyPaid,
    OrderClosed,
    OrderConflict,
    OrdersError,
)
from orders.validation import check_optional_text

Clock = Callable[[], int]
"""Returns the current time in integer milliseconds since the Unix epoch."""


class OrderStatus(StrEnum):
    UNPAID = "unpaid"
    PAID = "paid"
    CANCELLED = "cancelled"
    CLOSED = "closed"

    @property
    def is_terminal(self) -> bool:
        return self is not OrderStatus.UNPAID


class EventKind(StrEnum):
    CREATED = "created"
    PAID = "paid"
    CANCELLED = "cancelled"
    CLOSED = "closed"
    EXTENDED = "extended"
    #: A payment the service refused: a refund is owed (see ``oes_payment_refusals``).
    PAYMENT_REFUSED = "payment_refused"
    #: An operator made a consumer's parked event retrying again.
    REQUEUED = "requeued"
    #: An operator dropped a consumer's parked event.
    DISCARDED = "discarded"
    #: The order's reminder: it expires soon (``remind_before_s``), and is still unpaid.
    EXPIRING = "expiring"
    #: Its user was erased (``erase_user``): one per erasure, on one of the user's orders,
    #: under the pseudonym; its data holds the pseudonym and the counts, never the user id.
    ERASED = "erased"


class ActorKind(StrEnum):
    """Who caused an event."""

    #: The host application, through a use case (``actor=`` names it further).
    APPLICATION = "application"
    #: A person, through the CLI (``user@host`` unless ``--actor`` says otherwise).
    OPERATOR = "operator"
    #: The sweep closing expired orders (the scheduler's, or a direct sweep_expired call).
    SWEEPER = "sweeper"
    #: The host's pre-close check, extending an order the sweep was about to close.
    PRE_CLOSE_CHECK = "pre_close_check"
    #: A waiting list serving its next entry (the name is the entry's id).
    WAITING_LIST = "waiting_list"


#: The longest free-text actor name an event holds.
ACTOR_MAX_LENGTH = 128


@dataclass(frozen=True, slots=True)
class Actor:
    """Who caused an event: a kind, and a free-text name the caller chose (or None)."""

    kind: ActorKind
    name: str | None = None

    @classmethod
    def of(cls, given: object, default: ActorKind = ActorKind.APPLICATION) -> Actor:
        """The actor a use case's ``actor=`` names: an Actor as it is, a string as the name
        of a ``default`` actor, None as ``default`` with no name. InvalidInput otherwise."""
        if isinstance(given, Actor):
            if not isinstance(given.kind, ActorKind):
                raise InvalidInput("actor", "must have an ActorKind")
            name = check_optional_text("actor", given.name, ACTOR_MAX_LENGTH)
            return given if name == given.name else cls(given.kind, name)
        if given is None:
            return _UNNAMED[default]  # frozen: one per kind serves every call
        return cls(default, check_optional_text("actor", given, ACTOR_MAX_LENGTH))

    @classmethod
    def from_columns(cls, kind: str | None, name: str | None) -> Actor | None:
        """The actor a row's kind and name columns hold; None where the kind is NULL."""
        return None if kind is None else cls(ActorKind(kind), name)

    def columns(self) -> dict[str, str | None]:
        """The event row's ``actor_kind`` and ``actor`` values."""
        return {"actor_kind": self.kind.value, "actor": self.name}

    def __str__(self) -> str:
        return self.kind.value if self.name is None else f"{self.kind.value}:{self.name}"


#: The actor of each kind with no name (what ``Actor.of(None, kind)`` returns).
_UNNAMED = {kind: Actor(kind) for kind in ActorKind}


APPLICATION = Actor(ActorKind.APPLICATION)
SWEEPER = Actor(ActorKind.SWEEPER)
PRE_CLOSE_CHECK = Actor(ActorKind.PRE_CLOSE_CHECK)

#: The close reason of an order cancelled to make room for a newer one at the limit.
REPLACED_REASON = "replaced"
#: The close reason of an unpaid order cancelled because its user was erased.
ERASED_REASON = "erased"


class RefusalReason(StrEnum):
    """Why a payment was refused (a ``payment_refused`` event's ``reason``)."""

    #: The sweep closed the order (and no late payment was accepted).
    CLOSED = "closed"
    CANCELLED = "cancelled"
    #: Paid already, under another payment reference.
    ALREADY_PAID = "already_paid"
    #: The payment's amount is not the order's.
    AMOUNT_MISMATCH = "amount_mismatch"
    #: The payment's currency is not the order's.
    CURRENCY_MISMATCH = "currency_mismatch"
    #: Within the late-payment window, but the host's late-payment check refused it (or
    #: raised, or ran out of time).
    LATE_PAYMENT_REFUSED = "late_payment_refused"
    #: SQL holds no order with that id: retention pruned it, or it never existed (once
    #: pruned, the two cannot be told apart). Recorded with no user and no event.
    UNKNOWN_ORDER = "unknown_order"
    #: A late payment within the window, but units its order had released are held or
    #: sold by others now (:mod:`orders.sql.holds`): a refund is owed.
    UNITS_TAKEN = "units_taken"


@dataclass(frozen=True, slots=True)
class Payment:
    """A payment as the payment callback reported it to ``mark_paid``."""

    ref: str | None = None
    amount: Decimal | None = None
    currency: str | None = None

    def mismatch(self, order: Order) -> RefusalReason | None:
        """Why this payment cannot pay ``order`` (None: it can). Only what both sides state is
        compared: the amounts (as numbers: 10.00 equals 10) when both have one, and then
        the currencies when both have one. Over- and underpayments are both refused."""
        if self.amount is None or order.amount is None:
            return None
        if None not in (self.currency, order.currency) and self.currency != order.currency:
            return RefusalReason.CURRENCY_MISMATCH
        if self.amount != order.amount:
            return RefusalReason.AMOUNT_MISMATCH
        return None


#: What an order holds of one resource: a number of units, or the names of its named units.
Held = int | tuple[str, ...]


def unit_counts(holds: Mapping[str, Held]) -> dict[str, int]:
    """``holds`` as units per resource."""
    return {rid: held if isinstance(held, int) else len(held) for rid, held in holds.items()}


@dataclass(frozen=True, slots=True)
class Order:
    """An order as the database held it at ``read_at_ms``. A value, never a live ORM row.

    Timestamps are integer milliseconds since the epoch (``*_ms``); the ``*_at`` properties
    give the same instants as UTC-aware datetimes.
    """

    id: str
    user_id: str
    status: OrderStatus
    created_at_ms: int
    expires_at_ms: int
    read_at_ms: int
    amount: Decimal | None = None
    currency: str | None = None
    paid_at_ms: int | None = None
    closed_at_ms: int | None = None
    close_reason: str | None = None
    payment_ref: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    #: How often the expiry was moved (extend_order, the pre-close check).
    extensions: int = 0
    #: When the sweep is to write its ``expiring`` event (None: none due, or already
    #: written), and when it wrote it (None: not reminded).
    remind_at_ms: int | None = None
    reminded_at_ms: int | None = None
    #: The expiry policy it was created under (None: ``Settings.default_policy``).
    policy: str | None = None
    #: What it holds of resources: resource id -> units (held while unpaid, sold once
    #: paid, released at its close or cancel): a count, or the names of named units.
    holds: Mapping[str, Held] = field(default_factory=dict)

    @property
    def created_at(self) -> datetime:
        return ms_to_datetime(self.created_at_ms)

    @property
    def expires_at(self) -> datetime:
        return ms_to_datetime(self.expires_at_ms)

    @property
    def paid_at(self) -> datetime | None:
        return None if self.paid_at_ms is None else ms_to_datetime(self.paid_at_ms)

    @property
    def closed_at(self) -> datetime | None:
        return None if self.closed_at_ms is None else ms_to_datetime(self.closed_at_ms)

    @property
    def time_left_ms(self) -> int:
        """Milliseconds until expiry as of ``read_at_ms``; 0 once expired or terminal."""
        if self.status is not OrderStatus.UNPAID:
            return 0
        return max(0, self.expires_at_ms - self.read_at_ms)

    @property
    def time_left_s(self) -> float:
        return self.time_left_ms / 1000

    @property
    def is_open(self) -> bool:
        """Unpaid and not yet expired: counts against the user's limit."""
        return is_open(self.status, self.expires_at_ms, self.read_at_ms)


def is_open(status: str, expires_at_ms: int, now_ms: int) -> bool:
    """The one rule of what counts against a user's limit: unpaid, with its expiry ahead.

    SQL says the same in :func:`orders.sql.predicates.open_at`, Redis in ``admit.lua``.
    """
    return status == OrderStatus.UNPAID and expires_at_ms > now_ms


@dataclass(frozen=True, slots=True)
class NewOrder:
    """A create on its way down, from the service to the admission, the combiner and the
    SQL slot guard: the order to write and what its admission needs. A create's new field
    is one line here (the SQL row is built from it in :func:`orders.sql.slots.order_row`)."""

    id: str
    user_id: str
    #: When the create started: the order's creation, and the time its admission reads.
    created_at_ms: int
    expires_at_ms: int
    #: The limit it is admitted under (the user's own, where set, replaces it).
    limit: int
    #: Who creates it (its ``created`` event says so).
    actor: Actor
    #: The caller chose the id: a refusal may be a retry of an order no longer open.
    caller_id: bool = False
    amount: Decimal | None = None
    currency: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    remind_at_ms: int | None = None
    policy: str | None = None
    #: The caller's trace context, for its ``created`` event (``tracing.event_context``).
    trace: dict[str, str] | None = None
    #: The units it holds, (resource id, units) sorted by id (``validation.check_holds``).
    holds: tuple[tuple[str, int], ...] = ()
    #: The named units it asks for by name, (resource id, names sorted) sorted by id
    #: (``validation.check_hold_names``); its other holds of named resources are picked.
    names: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def asked(self) -> dict[str, Held]:
        """Its holds as its row keeps them before any unit is picked: names where given."""
        return {**dict(self.holds), **dict(self.names)}

    def retry_of(self, order: Order) -> Order:
        """``order`` if this create is a retry of it; else OrderConflict."""
        if order.user_id != self.user_id:
            raise OrderConflict(order.id, "this order id belongs to another user")
        if order.amount != self.amount or order.currency != self.currency:
            raise OrderConflict(order.id, "this order id exists with another amount or currency")
        held = order.holds
        if unit_counts(held) != dict(self.holds) or any(
            held[rid] != names for rid, names in self.names
        ):
            raise OrderConflict(order.id, "this order id exists with other holds")
        return order


def refusal(order: Order) -> OrdersError:
    """The error for a transition out of ``unpaid`` that found ``order`` already terminal."""
    if order.status is OrderStatus.PAID:
        return OrderAlreadyPaid(order.id, order.payment_ref)
    return OrderClosed(order.id, order.status.value)


@dataclass(frozen=True, slots=True)
class SweepResult:
    """What one :meth:`~orders.service.OrderService.sweep_expired` call did."""

    closed: int
    batches: int
    users: int
    cutoff_ms: int
    #: closed_at - expires_at of the longest-overdue order closed, in ms (None if none).
    max_lag_ms: int | None
    redis_errors: int = 0
    #: Reminders written (``expiring`` events; a policy's ``remind_before_s``).
    reminded: int = 0


def ms_to_datetime(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).replace(microsecond=(ms % 1000) * 1000)


def system_clock() -> int:
    """Wall-clock time in integer milliseconds (the default clock)."""
    import time  # noqa: PLC0415

    return time.time_ns() // 1_000_000


# --- order ids ---------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: Two Crockford characters per 10 bits: an id is 13 look-ups, not 26 shifts.
_CROCKFORD_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]


class OrderIdGenerator:
    """Unique, time-ordered ids: 48 bits of milliseconds then 80 random bits (a ULID).

    Ids made by one generator sort in creation order even within one millisecond (the
    random part is incremented); across processes they sort by millisecond.
    """

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_rand = 0

    def __call__(self, now_ms: int | None = None) -> str:
        """A new id; ``now_ms``: the caller's reading of the clock (read here if None)."""
        with self._lock:
            if now_ms is None:
                now_ms = self._clock()
            if now_ms <= self._last_ms:
                now_ms = self._last_ms
                self._last_rand += 1
                if self._last_rand >= 1 << 80:  # pragma: no cover - 2**80 ids in one ms
                    raise RuntimeError("order id space for this millisecond exhausted")
            else:
                self._last_ms = now_ms
                self._last_rand = int.from_bytes(os.urandom(10), "big") >> 1
            value = (now_ms << 80) | self._last_rand
        # 26 characters of 5 bits hold the 128 bits (the top two are 0), 10 bits at a time.
        pairs = _CROCKFORD_PAIRS
        return "".join([pairs[(value >> shift) & 1023] for shift in range(120, -1, -10)])
