"""Counted resources as use cases: SQL records the capacity, then Redis may get its copy.

SQL is the record (:mod:`orders.sql.resources`): a capacity is checked, written and read
back with what is held of it in one transaction. Lowering it below what is held and sold is
allowed: nothing is taken back, and new holds are refused until enough is released.

The Redis index keeps a copy of each capacity for its one-round-trip refusals. That copy is
written after the commit by ``after_capacity(resource)`` (None: no copy yet); a
:class:`~orders.errors.StoreUnavailable` there is logged, never raised, since SQL already
holds the truth and reconcile rebuilds the copy from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from orders.domain import Actor, Clock
from orders.errors import StoreUnavailable, UnknownResource
from orders.inventory import Resource
from orders.sql.resources import ResourceRecords
from orders.validation import (
    UNITS_MAX,
    check_capacity,
    check_count,
    check_resource_id,
    check_unit_names,
)

log = logging.getLogger("orders.service")

#: The most resources one page of ``service.resources`` lists.
RESOURCES_PAGE_MAX = 10_000

#: Writes the Redis index's copy of a resource's capacity, after the SQL commit.
AfterCapacity = Callable[[Resource], object]


@dataclass(eq=False)
class Capacities:
    """Sets and reads counted resources (see the module docstring)."""

    records: ResourceRecords
    clock: Clock
    #: The Redis index's copy of the capacity, written after the commit (None: none).
    after_capacity: AfterCapacity | None = None

    def set(
        self,
        resource_id: object,
        capacity: object,
        per_user: object,
        actor: str | Actor | None,
    ) -> Resource:
        rid = check_resource_id(resource_id)
        units, cap = check_capacity(capacity, per_user)
        cause = Actor.of(actor)
        resource = self.records.set(rid, units, cap, self.clock(), cause)
        self.copy(resource)
        return resource

    def set_units(self, resource_id: object, units: object, actor: str | Actor | None) -> Resource:
        rid = check_resource_id(resource_id)
        names = check_unit_names("units", units, UNITS_MAX)
        resource = self.records.set_units(rid, names, self.clock(), Actor.of(actor))
        self.copy(resource)
        return resource

    def units(self, resource_id: object) -> dict[str, list[str]]:
        """The named units of a resource by state (``free``, ``held``, ``sold``), each list
        in the resource's order."""
        found = self.read(resource_id)
        by_state: dict[str, list[str]] = {"free": [], "held": [], "sold": []}
        for name, state, _ in self.records.units(found.id):
            by_state[state].append(name)
        return by_state

    def read(self, resource_id: object) -> Resource:
        rid = check_resource_id(resource_id)
        found = self.records.get(rid)
        if found is None:
            raise UnknownResource(rid)
        return found

    def page(self, after: object, limit: object) -> list[Resource]:
        start = None if after is None else check_resource_id(after)
        return self.records.list(start, check_count("limit", limit, 1, RESOURCES_PAGE_MAX))

    def copy(self, resource: Resource) -> None:
        """Hand the committed resource to ``after_capacity``; a Redis failure is logged."""
        if self.after_capacity is None:
            return
        try:
            self.after_capacity(resource)
        except StoreUnavailable:
            log.warning(
                "redis capacity write failed; reconcile will fix it",
                extra={"resource_id": resource.id},
            )
