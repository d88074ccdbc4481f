"""The values of inventory: resources (counted or named units an unpaid order holds) and
their waiting lists, as SQL holds them. No I/O here; :mod:`orders.domain` says what an
order is.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from orders.domain import ms_to_datetime


class HoldReason(StrEnum):
    """Why a create's holds were refused (:class:`~orders.errors.HoldRefused`)."""

    SOLD_OUT = "sold_out"
    USER_CAP = "user_cap"
    UNKNOWN_RESOURCE = "unknown_resource"
    #: A named unit asked for by name is held or sold (the refusal names them).
    TAKEN = "taken"


@dataclass(frozen=True, slots=True)
class Resource:
    """A counted resource as SQL held it: ``held`` units by unpaid orders, ``sold`` by paid
    ones. ``free`` may not go below 0 even where the capacity was lowered below what is
    held and sold (nothing is taken back; new holds wait until enough is released)."""

    id: str
    capacity: int
    held: int
    sold: int
    per_user: int | None = None
    updated_at_ms: int | None = None
    #: Its units are named (``set_units``): its capacity is their count.
    named: bool = False

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.held - self.sold)

    def as_dict(self) -> dict[str, int | str | bool | None]:
        """Its fields and ``free``, as JSON takes them (the CLI's ``--json``, the dashboard)."""
        return {
            "id": self.id,
            "capacity": self.capacity,
            "held": self.held,
            "sold": self.sold,
            "free": self.free,
            "per_user": self.per_user,
            "named": self.named,
            "updated_at_ms": self.updated_at_ms,
        }


#: The order id of a waiting-list entry's order is this and the entry's id: the one order it
#: is ever served with (exactly once: a create is idempotent on its order id).
WAITING_ORDER_PREFIX = "waiting-"


def waiting_order_id(entry_id: int) -> str:
    """The one order id the waiting-list entry ``entry_id`` is ever served with."""
    return f"{WAITING_ORDER_PREFIX}{entry_id}"


class WaitingStatus(StrEnum):
    """Where a waiting-list entry is: in the queue, or out of it and why."""

    WAITING = "waiting"
    #: An unpaid order was made for it (``WaitingEntry.order_id``).
    SERVED = "served"
    LEFT = "left"
    #: Its ``until`` passed before it could be served.
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class WaitingEntry:
    """One user waiting for ``quantity`` units of one resource, as SQL held it; entries
    are served first come, first served (by ``id``)."""

    id: int
    resource_id: str
    user_id: str
    quantity: int
    created_at_ms: int
    status: WaitingStatus
    #: After this instant it is dropped, not served (None: it waits as long as it takes).
    until_ms: int | None = None
    #: The order made for it (status ``served``).
    order_id: str | None = None
    #: When it left the queue (served, left or expired).
    ended_at_ms: int | None = None

    @property
    def created_at(self) -> datetime:
        return ms_to_datetime(self.created_at_ms)

    @property
    def until(self) -> datetime | None:
        return None if self.until_ms is None else ms_to_datetime(self.until_ms)

    @property
    def ended_at(self) -> datetime | None:
        return None if self.ended_at_ms is None else ms_to_datetime(self.ended_at_ms)

    def as_dict(self) -> dict[str, int | str | None]:
        """Its fields, with the instants also as ISO 8601 text, as JSON takes them."""
        return {
            "id": self.id,
            "resource_id": self.resource_id,
            "user_id": self.user_id,
            "quantity": self.quantity,
            "status": self.status.value,
            "order_id": self.order_id,
            "created_at_ms": self.created_at_ms,
            "created_at": self.created_at.isoformat(),
            "until_ms": self.until_ms,
            "until": None if self.until is None else self.until.isoformat(),
            "ended_at_ms": self.ended_at_ms,
            "ended_at": None if self.ended_at is None else self.ended_at.isoformat(),
        }
