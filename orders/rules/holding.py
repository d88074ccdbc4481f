"""A create's holds in the Redis index, and the index of each resource rebuilt from SQL.

SQL is the record and refuses every oversell alone (:mod:`orders.sql.holds`); the index
(:mod:`orders.index.resources`) lets a sold-out cart be refused in one round trip without
SQL. A create with holds asks the index first (:meth:`Holding.reserve`):

* refused: :class:`~orders.errors.HoldRefused` (``source="redis"``), nothing written
  anywhere: neither the user's admission nor SQL is asked;
* reserved: the create goes on to the user's admission and SQL; if it does not commit, its
  members leave the resources again (:meth:`Holding.release`), as its user's member does;
* a resource the index does not know (its keys were lost, or never built) is not guessed:
  SQL decides for it, and once the create is over the resource is rebuilt from SQL
  (:meth:`Holding.rebuild`), one rebuild at a time per resource in this process.

Redis unreachable: under ``create_without_redis`` SQL decides alone, as for the limit;
otherwise the create fails with ``StoreUnavailable`` before anything is written.

A rebuild reads SQL (capacity and sold first, then the held holds), replaces the resource's
keys atomically, then reads SQL again for the members it wrote and releases those no longer
held: a cancel or close that committed between the read and the swap removed its member from
the old keys (or from none), and would otherwise leave a unit looking taken until its order's
expiry. A create that commits during the rebuild is missing from the new keys: the index then
counts too few units taken, which is safe (SQL refuses the last ones), until reconcile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import closing
from dataclasses import dataclass

from orders import metrics
from orders.domain import NewOrder, Order, OrderStatus
from orders.errors import HoldRefused, StoreUnavailable
from orders.index.resources import ResourceIndex
from orders.inventory import HoldReason
from orders.sql.resources import ResourceRecords

log = logging.getLogger(__name__)


class Holding:
    """The index side of holds (module docstring)."""

    def __init__(
        self, index: ResourceIndex, records: ResourceRecords, *, create_without_redis: bool
    ) -> None:
        self.index = index
        self.records = records
        self.create_without_redis = create_without_redis
        self._rebuilding: set[str] = set()
        self._guard = threading.Lock()

    def reserve(self, new: NewOrder) -> tuple[str, ...]:
        """Reserve ``new``'s holds in the index, or raise HoldRefused (nothing written).
        Returns the resources the index did not know (for :meth:`rebuild` once the create
        is over)."""
        try:
            reserved = self.index.reserve(
                new.id, new.expires_at_ms, new.created_at_ms, list(new.holds), dict(new.names)
            )
        except StoreUnavailable:
            if not self.create_without_redis:
                raise
            log.warning(
                "redis unavailable: holds decided by SQL only",
                extra={"order_id": new.id, "user_id": new.user_id},
            )
            return ()
        if reserved.refused is not None:
            units = dict(new.holds)[reserved.refused]
            reason = HoldReason.TAKEN if reserved.taken else HoldReason.SOLD_OUT
            raise HoldRefused(
                reserved.refused, reason, units, reserved.free, "redis", reserved.taken
            )
        return reserved.unknown

    def held(self, order: Order) -> None:
        """After a create's commit: the index learns which named units it holds (picked or
        asked for), so that the next ask for one is refused without SQL."""
        named = {rid: held for rid, held in order.holds.items() if isinstance(held, tuple)}
        if named:
            self.follow(lambda: self.index.hold_units(order.id, named), order.id)

    def release(self, new: NewOrder) -> None:
        """Take a create's reservation back (it did not commit); a failure only delays it."""
        self.follow(lambda: self.index.release(new.id, [rid for rid, _ in new.holds]), new.id)

    def after_transition(self, order: Order) -> None:
        """After a commit that changed the order: a paid order's units move to sold, a
        cancelled or closed order's are released (a late payment's units, taken again in
        SQL, are left for reconcile: the index then counts too few sold, which is safe)."""
        if not order.holds:
            return
        ids = list(order.holds)
        if order.status is OrderStatus.PAID:
            self.follow(lambda: self.index.sell(order.id, ids), order.id)
            metrics.HOLDS.labels("sold").inc(len(ids))
        elif order.status is not OrderStatus.UNPAID:
            self.follow(lambda: self.index.release(order.id, ids), order.id)
            metrics.HOLDS.labels("released").inc(len(ids))

    def moved(self, order: Order) -> None:
        """After an extension: the members follow the new expiry."""
        if order.holds:
            ids = list(order.holds)
            self.follow(lambda: self.index.move(order.id, ids, order.expires_at_ms), order.id)

    @staticmethod
    def released_by_sweep(
        closed: Iterable[tuple[str, dict[str, int] | None]],
    ) -> list[tuple[str, list[str]]]:
        """After a sweep batch's commit: count the holds of the orders it closed (order id,
        holds), released in SQL whatever Redis does next, and return them (order id,
        resource ids) for :meth:`release_swept`."""
        pairs = [(order_id, list(holds)) for order_id, holds in closed if holds]
        if pairs:
            metrics.HOLDS.labels("released").inc(sum(len(ids) for _, ids in pairs))
        return pairs

    def release_swept(self, pairs: list[tuple[str, list[str]]]) -> None:
        """Take the swept orders' members out of the resources (StoreUnavailable: they no
        longer count anyway, their expiry having passed; reconcile drops them)."""
        if pairs:
            self.index.release_many(pairs)

    def rebuild(self, resource_id: str, now_ms: int) -> bool:
        """Rebuild one resource's keys from SQL (module docstring); False when another
        thread of this process is rebuilding it, or SQL has no such resource (its keys go)."""
        with self._guard:
            if resource_id in self._rebuilding:
                return False
            self._rebuilding.add(resource_id)
        try:
            state = self.records.for_rebuild(resource_id)
            if state is None:
                self.index.forget(resource_id)
                return False
            capacity, sold, held, named = state
            self.index.rebuild(resource_id, capacity, sold, held, now_ms, named)
            written = [order_id for order_id, _, expiry in held if expiry > now_ms]
            gone = set(written) - self.records.still_held(resource_id, written)
            for order_id in gone:
                self.index.release(order_id, [resource_id])
            return True
        finally:
            with self._guard:
                self._rebuilding.discard(resource_id)

    def drift(self, resource_id: str, now_ms: int) -> str | None:
        """How the resource's keys differ from SQL: None (equal), ``missing`` (no keys) or
        ``stale`` (another capacity, sold count or set of live members)."""
        snapshot = self.index.snapshot(resource_id, now_ms)
        if snapshot is None:
            return "missing"
        state = self.records.for_rebuild(resource_id)
        if state is None:
            return "stale"
        capacity, sold, held, named = state
        members = {oid: (units, expiry) for oid, units, expiry in held if expiry > now_ms}
        holders = {
            unit: ("!" + oid if unit_state == "sold" else oid)
            for unit, unit_state, oid in named
            if oid is not None
            and (unit_state == "sold" or (unit_state == "held" and oid in members))
        }
        same = (snapshot.cap, snapshot.sold, snapshot.members, snapshot.units) == (
            capacity,
            sold,
            members,
            holders,
        )
        return None if same else "stale"

    def rebuild_quietly(self, resource_ids: Iterable[str], now_ms: int) -> None:
        """:meth:`rebuild` after a create found resources unknown; a failure is logged (the
        next create, or reconcile, tries again)."""
        for resource_id in resource_ids:
            try:
                self.rebuild(resource_id, now_ms)
            except StoreUnavailable:
                log.warning("resource rebuild failed", extra={"resource_id": resource_id})

    @staticmethod
    def follow(write: Callable[[], object], order_id: str) -> None:
        """Run a Redis write that follows a commit; its failure only delays the repair."""
        try:
            write()
        except StoreUnavailable:
            log.warning(
                "redis hold update failed; the member expires by its score or at reconcile",
                extra={"order_id": order_id},
            )


@dataclass
class ResourceDrift:
    """What reconcile found of the resources' index (counts of resources)."""

    checked: int = 0
    #: Resources SQL has that the index did not know, and those it counted wrongly.
    missing: int = 0
    stale: int = 0
    #: Resources the index had that SQL does not (their keys removed).
    removed: int = 0


def reconcile_resources(holding: Holding, now_ms: int, dry_run: bool, page: int) -> ResourceDrift:
    """Compare every resource's keys with SQL, a page of resources at a time, and rebuild
    those that differ (unless ``dry_run``); then remove the keys of resources SQL no longer
    has. A resource that changes during the comparison may be rebuilt without need: a
    rebuild is always safe."""
    drift = ResourceDrift()
    after: str | None = None
    while batch := holding.records.list(after, page):
        for resource in batch:
            drift.checked += 1
            kind = holding.drift(resource.id, now_ms)
            if kind is None:
                continue
            setattr(drift, kind, getattr(drift, kind) + 1)
            if not dry_run:
                metrics.RESOURCE_DRIFT.labels(kind).inc()
                holding.rebuild(resource.id, now_ms)
        after = batch[-1].id
    with closing(holding.index.scan_resources(chunk=page)) as scanned:
        for resource_ids in scanned:
            for resource_id in resource_ids:
                if holding.records.get(resource_id) is None:
                    drift.removed += 1
                    if not dry_run:
                        holding.index.forget(resource_id)
    return drift
