"""What the overview shows of resources: those running out (a named one with its first
free units) and the longest waiting lists. Every read is bounded, whatever the number of
resources, units and waiting entries:

* the resources running out rank a range of the resources' primary key
  (``RESOURCES_RANKED``), and each named one shown reads the first rows of one range of
  its units' (resource, state, position) index: ``FREE_NAMES`` names at most, one
  statement per named resource shown;
* the waiting lists rank the first ``WAITING_RANKED`` entries along the queues' partial
  index, in one statement (:meth:`orders.sql.waiting.WaitingRecords.longest_queues`).

Past a bound, the part says it ranked only part (``capped``).
"""

from __future__ import annotations

from typing import Any

from orders.inventory import Resource
from orders.service import OrderService

#: The resources running out: the ten with the least free share, ranked among the first
#: RESOURCES_RANKED by id. The share has no index, so ranking every resource would cost a
#: read of each on every refresh; past the bound the panel says it ranked only part
#: (``capped``).
RUNNING_OUT = 10
RESOURCES_RANKED = 10_000
#: A named resource running out lists its first free units, up to this many.
FREE_NAMES = 10
#: The longest waiting lists: ten, ranked among the first WAITING_RANKED waiting entries
#: (by resource id, then arrival): counting every queue whole would cost a read of each
#: entry on every refresh.
LONGEST_QUEUES = 10
WAITING_RANKED = 10_000


def _resource_row(service: OrderService, resource: Resource) -> dict[str, Any]:
    # The id is caller text, as it came: the page writes it as text, never as HTML. So are
    # the unit names.
    first_free = None
    if resource.named:
        first_free = [] if resource.free == 0 else first_free_units(service, resource)
    return {**resource.as_dict(), "sold_out": resource.free == 0, "first_free": first_free}


def first_free_units(service: OrderService, resource: Resource) -> list[str]:
    """The named resource's first free units (``FREE_NAMES`` at most)."""
    return service.capacities.records.first_free(resource.id, FREE_NAMES)


def read_resources(service: OrderService) -> dict[str, Any]:
    """The resources running out, least free share first."""
    records = service.capacities.records
    found = records.running_out(RUNNING_OUT, among=RESOURCES_RANKED)
    return {
        "running_out": [_resource_row(service, resource) for resource in found],
        "ranked_cap": RESOURCES_RANKED,
        "capped": records.more_than(RESOURCES_RANKED),
        "free_names_cap": FREE_NAMES,
    }


def read_waiting(service: OrderService, now_ms: int) -> dict[str, Any]:
    """The resources with the longest waiting lists, longest first."""
    longest = service.waiting_list.records.longest_queues(LONGEST_QUEUES, among=WAITING_RANKED)
    return {
        "longest": [
            {
                "resource_id": queue.resource_id,
                "entries": queue.entries,
                "units": queue.units,
                "oldest_created_at_ms": queue.oldest_created_at_ms,
                "oldest_age_ms": now_ms - queue.oldest_created_at_ms,
                "free": queue.free,
            }
            for queue in longest.queues
        ],
        "ranked_cap": WAITING_RANKED,
        "capped": longest.capped,
    }
