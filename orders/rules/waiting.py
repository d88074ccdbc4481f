"""Waiting lists: users queued for units of a resource, served the moment units come free.

A user waits for ``quantity`` units of one resource (:meth:`WaitingList.wait_for`; one place
per user and resource). When units come free (a cancel or close of an order holding them,
a sweep batch, a capacity raised) the service calls :meth:`WaitingList.serve` with those
resources, in the same step, after the commit that freed them. For each resource it walks
the queue first come, first served:

* an entry past its ``until`` is dropped (status ``expired``; a log line and
  ``orders_waiting_total{outcome="expired"}``: an order event needs an order, which a
  dropped entry never had);
* an entry whose quantity fits the units still free gets an unpaid order through the
  service's own create path (its limit, per-user caps, holds and events), with the order id
  :func:`order_id_for` derives from the entry, metadata ``{"waiting_entry": id}`` and the
  actor ``waiting_list:<id>``; then the entry is marked ``served``;
* refused by the user's unpaid limit, create rate or per-user cap (or too large for what is
  free): the entry keeps its place and the walk goes on with the next;
* refused ``sold_out`` (someone else took the units first): the walk of that resource stops.

Exactly once. The order id is the entry's, and a create is idempotent on its order id: two
servers of one entry (a cancel's and a sweep's), or one run again after a crash between the
create and the mark, make one order; the mark is a compare-and-set, so it is made once. An
entry whose order exists already (the crash case) is marked served without a create. A unit
freed is offered through SQL's own hold guard, so never to two entries.

Recovery: a crash between a release's commit and its serve leaves units free while entries
wait. :meth:`WaitingList.recover` serves every resource with an entry waiting and a unit
free (or an entry past ``until``), found by one query; the sweep runs it at most once per
``RECOVERY_INTERVAL_MS`` (it is also how an entry refused at its user's limit is tried
again once that user has room), and reconcile runs it once.

A failure while serving (a store down) is logged by the triggers and left to recovery: it
never undoes nor fails the cancel, close or capacity change that freed the units.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from orders import metrics
from orders.domain import Actor, ActorKind, Clock, Order
from orders.errors import (
    CreateRateLimited,
    HoldRefused,
    InvalidInput,
    OrderConflict,
    OrdersError,
    UnknownResource,
    UnpaidOrderLimitReached,
    WaitingEntryNotFound,
)
from orders.inventory import WaitingEntry, waiting_order_id
from orders.policies import check_deadline
from orders.sql.resources import ResourceRecords
from orders.sql.waiting import WaitingRecords
from orders.validation import check_count, check_resource_id, check_row_id, check_user_id

log = logging.getLogger("orders.service")

#: ``create(user_id, order_id, holds, metadata, actor)``: the service's create path, which
#: returns the order (the existing one for a retry of its order id) or raises its refusal.
CreateForEntry = Callable[[str, str, Mapping[str, int], Mapping[str, Any], Actor], Order]

#: Entries read from a queue at once.
QUEUE_PAGE = 100
#: Resources one recovery pass serves at most (the next pass takes the rest).
RECOVERY_RESOURCES = 1_000
#: The sweep's recovery pass runs at most this often (reconcile's always runs).
RECOVERY_INTERVAL_MS = 1_000
#: The key of an order's metadata that names its waiting-list entry.
METADATA_KEY = "waiting_entry"
#: What a create refused for the user alone raises: the entry keeps its place.
_USER_REFUSALS = (UnpaidOrderLimitReached, CreateRateLimited)


#: The one order id an entry is ever served with (module docstring: exactly once).
order_id_for = waiting_order_id


@dataclass(eq=False)
class WaitingList:
    """Queues users for resources and serves them (see the module docstring)."""

    records: WaitingRecords
    resources: ResourceRecords
    create: CreateForEntry
    clock: Clock
    max_user_id_length: int
    _last_recovery_ms: float = field(default=-math.inf, init=False)
    _recovery_guard: threading.Lock = field(default_factory=threading.Lock, init=False)

    # --- the use cases ----------------------------------------------------------------

    def wait_for(
        self,
        user_id: object,
        resource_id: object,
        quantity: object,
        until: object,
        actor: object,
    ) -> WaitingEntry:
        """Queue the user (or return its entry already waiting there), then serve the
        resource at once: units may be free now. Checked first, nothing written on bad
        input: InvalidInput, or UnknownResource."""
        uid = check_user_id(user_id, self.max_user_id_length)
        rid = check_resource_id(resource_id)
        units = check_count("quantity", quantity, 1)
        cause = Actor.of(actor)
        now_ms = self.clock()
        until_ms = self._until_ms(until, now_ms)
        resource = self.resources.get(rid)
        if resource is None:
            raise UnknownResource(rid)
        if units > resource.capacity:
            raise InvalidInput("quantity", "must not exceed the resource's capacity")
        if resource.per_user is not None and units > resource.per_user:
            raise InvalidInput("quantity", "must not exceed the resource's per-user cap")
        entry, added = self.records.add(rid, uid, units, until_ms, now_ms, cause)
        if not added:
            return entry
        metrics.WAITING.labels("added").inc()
        self.after_release([rid])
        return self.records.get(entry.id) or entry

    def waiting(self, resource_id: object) -> list[WaitingEntry]:
        """The resource's queue, first come first; UnknownResource for no such resource."""
        rid = check_resource_id(resource_id)
        if self.resources.get(rid) is None:
            raise UnknownResource(rid)
        queue: list[WaitingEntry] = []
        while page := self.records.queue(
            rid, after_id=queue[-1].id if queue else 0, limit=QUEUE_PAGE
        ):
            queue.extend(page)
            if len(page) < QUEUE_PAGE:
                break
        return queue

    def leave(self, entry_id: object) -> WaitingEntry:
        """Take the entry out of its queue; one already out of it is returned as it is."""
        eid = check_row_id("entry_id", entry_id)
        entry, left = self.records.leave(eid, self.clock())
        if entry is None:
            raise WaitingEntryNotFound(eid)
        if left:
            metrics.WAITING.labels("left").inc()
        return entry

    def get(self, entry_id: object) -> WaitingEntry:
        eid = check_row_id("entry_id", entry_id)
        entry = self.records.get(eid)
        if entry is None:
            raise WaitingEntryNotFound(eid)
        return entry

    # --- serving ----------------------------------------------------------------------

    def serve(self, resource_ids: Iterable[str], now_ms: int) -> int:
        """Serve the queues of ``resource_ids`` (module docstring); how many entries were
        served. One query when none of them has a queue."""
        served = 0
        for resource_id in self.records.with_waiting(resource_ids):
            served += self._serve_one(resource_id, now_ms)
        return served

    def recover(self, now_ms: int, *, force: bool = True) -> int:
        """Serve every resource with an entry waiting and a unit free, or an entry past its
        ``until``; without ``force``, at most once per ``RECOVERY_INTERVAL_MS``."""
        return sum(self._serve_one(rid, now_ms) for rid in self.to_recover(now_ms, force=force))

    def to_recover(self, now_ms: int, *, force: bool = False) -> list[str]:
        """The resources :meth:`recover` would serve (none within ``RECOVERY_INTERVAL_MS``
        of the last pass, unless ``force``): for the sweep, which hands them to the
        serving threads (:mod:`orders.rules.serving`)."""
        with self._recovery_guard:
            if not force and now_ms - self._last_recovery_ms < RECOVERY_INTERVAL_MS:
                return []
            self._last_recovery_ms = now_ms
        return self.records.to_serve(now_ms, RECOVERY_RESOURCES)

    def queued_quietly(self, resource_ids: Iterable[str]) -> list[str]:
        """Of ``resource_ids``, those with an entry waiting (one query): what a sweep batch
        hands to the serving threads, which start only once there is one. A failure is
        logged and leaves them to recovery."""
        try:
            return self.records.with_waiting(resource_ids)
        except OrdersError:
            log.warning("reading the waiting lists failed; the next recovery pass serves them")
            return []

    def recovery_due_quietly(self) -> list[str]:
        """:meth:`to_recover` for the sweep: a failure is logged, never raised."""
        try:
            return self.to_recover(self.clock())
        except OrdersError:
            log.warning("the waiting lists' recovery pass failed; the next one tries again")
            return []

    def after_release(self, resource_ids: Iterable[str]) -> int:
        """:meth:`serve` for a trigger (a cancel, a close, a sweep batch, a capacity
        raised): a failure is logged, never raised (recovery finishes it)."""
        try:
            return self.serve(resource_ids, self.clock())
        except OrdersError:
            log.warning("serving a waiting list failed; the next recovery pass serves it")
            return 0

    def recover_quietly(self, *, force: bool = False) -> int:
        """:meth:`recover` for the sweep and reconcile: a failure is logged, never raised."""
        try:
            return self.recover(self.clock(), force=force)
        except OrdersError:
            log.warning("the waiting lists' recovery pass failed; the next one tries again")
            return 0

    def _serve_one(self, resource_id: str, now_ms: int) -> int:
        for gone in self.records.expire(resource_id, now_ms):
            metrics.WAITING.labels("expired").inc()
            log.info(
                "waiting-list entry expired before it could be served",
                extra={"entry_id": gone.id, "resource_id": resource_id, "user_id": gone.user_id},
            )
        resource = self.resources.get(resource_id)
        if resource is None:
            return 0
        free = resource.capacity - resource.held - resource.sold
        served, after_id = 0, 0
        while page := self.records.queue(resource_id, after_id=after_id, limit=QUEUE_PAGE):
            after_id = page[-1].id
            offered = self.records.orders_present([order_id_for(e.id) for e in page])
            for entry in page:
                if order_id_for(entry.id) in offered:  # made before a crash: mark it only
                    served += self._mark(entry, order_id_for(entry.id))
                    continue
                if entry.quantity > free:
                    continue
                outcome = self._offer(entry)
                if outcome is None:
                    return served
                if outcome:
                    free -= entry.quantity
                    served += 1
            if len(page) < QUEUE_PAGE or free <= 0:
                break
        return served

    def _offer(self, entry: WaitingEntry) -> bool | None:
        """Create the entry's order and mark it served: True; False when refused for this
        entry alone (it keeps its place); None when the resource is sold out."""
        order_id = order_id_for(entry.id)
        try:
            order = self.create(
                entry.user_id,
                order_id,
                {entry.resource_id: entry.quantity},
                {METADATA_KEY: entry.id},
                Actor(ActorKind.WAITING_LIST, str(entry.id)),
            )
        except HoldRefused as refused:
            if refused.reason == "user_cap":
                return False
            return None
        except _USER_REFUSALS:
            return False
        except OrderConflict:
            log.warning(
                "a waiting-list entry's order id is taken by another order; entry skipped",
                extra={"entry_id": entry.id, "order_id": order_id},
            )
            return False
        self._mark(entry, order.id)
        return True

    def _mark(self, entry: WaitingEntry, order_id: str) -> int:
        if self.records.mark_served(entry.id, order_id, self.clock()):
            metrics.WAITING.labels("served").inc()
            log.info(
                "waiting-list entry served",
                extra={"entry_id": entry.id, "order_id": order_id, "user_id": entry.user_id},
            )
            return 1
        return 0

    @staticmethod
    def _until_ms(until: object, now_ms: int) -> int | None:
        if until is None:
            return None
        if not isinstance(until, datetime):
            raise InvalidInput("until", "must be a datetime")
        until_ms = check_deadline(until, "until")
        if until_ms <= now_ms:
            raise InvalidInput("until", "must be ahead of now")
        return until_ms
