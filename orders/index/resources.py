"""ResourceIndex: counted resources (stock, coupons, time slots) in Redis, an index in front
of SQL.

SQL is the record and refuses every oversell by itself; this index answers "sold out" in one
round trip without SQL. Each resource has two keys in one hash slot (the resource id is their
hash tag, :func:`orders.index.keys.resource_keys`): a hash of ``cap``, ``sold``, ``held`` and
``o:<order id>`` -> units per member, and a holds set of member = order id, score = expiry
(ms). A member whose expiry has passed no longer counts. A resource without keys (never
built, lost to FLUSHALL, eviction, a failover), or whose two keys disagree, is *unknown*: the
index never guesses, its caller lets SQL decide and rebuilds it (:meth:`ResourceIndex.rebuild`).

The rule the index keeps: never more pessimistic than SQL for long (a wrong refusal is the bug
to avoid); too optimistic is safe. So a sale of an order that is no longer a member changes
nothing, and a lost key makes a resource unknown rather than full.

On one server a cart is one ``reserve.lua`` call. On a Redis Cluster a script touches one
slot: a cart's resources are grouped by slot, one call per group, all sent at once (one round
trip per node); when a group refuses, the groups that reserved are released before the
refusal is returned (compensation), so a cart stays all or nothing. Between the two steps
another cart may see those units taken and be refused: a refusal that was not needed, rare,
and the price of carts that span slots (resources of one pool may share a slot by design).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import NoScriptError

from orders import metrics
from orders.errors import InvalidInput, StoreUnavailable
from orders.index.errors import ServerRefused, redis_errors
from orders.index.keys import (
    resource_build_keys,
    resource_keys,
    resource_of,
    resource_pattern,
    text_of,
)
from orders.index.nodes import RedisClient, is_cluster
from orders.index.pipeline import CallPacker, scan_named, send_calls
from orders.index.unpaid import load_script

log = logging.getLogger("orders.index")

#: Members a rebuild writes per script call (a call blocks the server while it runs).
REBUILD_CHUNK = 1000
#: How long a rebuild's temporary keys live if it never swaps them in (ms).
REBUILD_TTL_MS = 600_000


@dataclass(frozen=True, slots=True)
class Reservation:
    """What :meth:`ResourceIndex.reserve` did."""

    #: The first resource (in the cart's order) with fewer free units than asked; None when
    #: the order is now a member of every known resource of the cart.
    refused: str | None
    #: The free units of ``refused`` (0 when fewer: a capacity lowered below what is held).
    free: int | None
    #: The cart's resources the index does not know: nothing was written for them.
    unknown: tuple[str, ...] = ()
    #: The units of ``refused`` asked for by name that another order holds or bought (then
    #: ``free`` is None): the refusal is ``taken``, not ``sold_out``.
    taken: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ResourceSnapshot:
    """A resource as the index counts it at ``now_ms`` (expired members left out)."""

    cap: int
    sold: int
    #: The units of the live members (what a reserve at ``now_ms`` counts).
    held: int
    #: order id -> (units, expiry ms), live members only.
    members: dict[str, tuple[int, int]]
    #: named unit -> its live holder's order id, or ``!`` and its buyer's.
    units: dict[str, str]

    @property
    def free(self) -> int:
        return self.cap - self.sold - self.held


class ResourceIndex:
    """The counted resources' keys on a redis-py client (one server or a cluster)."""

    def __init__(self, client: RedisClient, key_prefix: str) -> None:
        if client.get_encoder().decode_responses:
            raise InvalidInput("redis_client", "must not decode responses (ids are read as bytes)")
        self.client = client
        self.key_prefix = key_prefix
        self._reserve: Script = client.register_script(load_script("reserve"))
        self._release: Script = client.register_script(load_script("release"))
        self._set_capacity: Script = client.register_script(load_script("set_capacity"))
        self._rebuild_part: Script = client.register_script(load_script("rebuild_part"))
        self._rebuild_swap: Script = client.register_script(load_script("rebuild_swap"))
        self._rebuild_units: Script = client.register_script(load_script("rebuild_units"))

    def keys(self, resource_id: str) -> tuple[str, str, str]:
        """The resource's hash, holds set and units hash (:func:`resource_keys`)."""
        return resource_keys(self.key_prefix, resource_id)

    def slot_groups(self, resource_ids: Sequence[str]) -> list[list[int]]:
        """The positions of ``resource_ids`` grouped by hash slot, each group and the groups
        in the given order: one group on a single server (a script may name any keys there)."""
        if not is_cluster(self.client):
            return [list(range(len(resource_ids)))] if resource_ids else []
        groups: dict[int, list[int]] = {}
        for position, resource_id in enumerate(resource_ids):
            groups.setdefault(key_slot(resource_id.encode()), []).append(position)
        return list(groups.values())

    def _keys_of(self, resource_ids: Iterable[str]) -> list[str]:
        return [key for resource_id in resource_ids for key in self.keys(resource_id)]

    # -- reserve ------------------------------------------------------------------------

    def reserve(
        self,
        order_id: str,
        expires_at_ms: int,
        now_ms: int,
        holds: Sequence[tuple[str, int]],
        names: Mapping[str, Sequence[str]] | None = None,
    ) -> Reservation:
        """Make the order a member of each known resource of ``holds`` (resource id, units),
        all or none (see ``reserve.lua``), unless a unit of ``names`` (resource id -> the
        units asked for by name) is taken. A refusal writes nothing; a server that refuses
        the call (out of memory, an ACL) raises :class:`ServerRefused`, nothing written."""
        ids = [resource_id for resource_id, _ in holds]
        if len(set(ids)) < len(ids):
            raise InvalidInput("holds", "names a resource twice")
        if any(units < 1 for _, units in holds):
            raise InvalidInput("holds", "units must be 1 or more")
        if expires_at_ms <= now_ms:
            raise InvalidInput("expires_at_ms", "must be after now_ms")
        groups = self.slot_groups(ids)
        if not groups:
            return Reservation(None, None)
        head: list[str | int] = [order_id, expires_at_ms, now_ms]
        asks = _asks(holds, names or {})
        if len(groups) <= 1:
            keys = self._keys_of(ids)
            with redis_errors("reserve", refused=ServerRefused):
                try:
                    # EVALSHA itself, as UnpaidIndex.admit: the hot path of a create.
                    reply = self.client.evalsha(self._reserve.sha, len(keys), *keys, *head, *asks)
                except NoScriptError:
                    reply = self._reserve(keys=keys, args=[*head, *asks])
            return self._reservation(ids, [(list(range(len(ids))), list(reply))])
        return self._reserve_per_slot(order_id, head, holds, asks, groups)

    def _reserve_per_slot(
        self,
        order_id: str,
        head: list[str | int],
        holds: Sequence[tuple[str, int]],
        asks: list[bytes],
        groups: list[list[int]],
    ) -> Reservation:
        """One ``reserve.lua`` call per slot group, sent at once; the groups that reserved
        are released again when another refused or failed."""
        packer = CallPacker(self._reserve, [str(arg).encode() for arg in head])
        for group in groups:
            keys = self._keys_of(holds[i][0] for i in group)
            packer.add_call([k.encode() for k in keys], [asks[i] for i in group])
        ids = [resource_id for resource_id, _ in holds]
        try:
            with redis_errors("reserve", refused=ServerRefused):
                replies = send_calls(self.client, packer).read()
        except StoreUnavailable:
            # Some groups may have run: take back whatever this order holds in the cart.
            self._compensate(order_id, ids, groups)
            raise
        failed = [reply for reply in replies if isinstance(reply, Exception)]
        if failed:
            self._compensate(order_id, ids, groups)
            with redis_errors("reserve", refused=ServerRefused):
                raise failed[0]
        reservation = self._reservation(ids, list(zip(groups, replies, strict=True)))
        if reservation.refused is not None:
            reserved = [g for g, r in zip(groups, replies, strict=True) if int(r[0]) == 1]
            self._compensate(order_id, ids, reserved)
        return reservation

    def _compensate(self, order_id: str, ids: list[str], groups: list[list[int]]) -> None:
        """Release the order from the resources of ``groups`` (a refused or failed cart)."""
        if not groups:
            return
        try:
            self._run_per_group("release", [(order_id, ids, groups)])
        except StoreUnavailable as exc:
            # The holds stay until reconcile rebuilds the resources: pessimistic for a while,
            # never an oversell. The caller's outcome (refused, or the failure) stands.
            log.warning("could not undo a failed reserve of order %s: %s", order_id, exc)

    @staticmethod
    def _reservation(ids: list[str], replies: list[tuple[list[int], list[Any]]]) -> Reservation:
        """The per-group replies of ``reserve.lua`` as one :class:`Reservation`: the refusal
        of the resource first in the cart's order, every group's unknowns."""
        refused: int | None = None
        free: int | None = None
        taken: tuple[str, ...] = ()
        unknown: list[int] = []
        for group, reply in replies:
            code = int(reply[0])
            if code == -2:
                position = group[int(reply[1]) - 1]
                if refused is None or position < refused:
                    refused, free = position, None
                    taken = tuple(text_of(name) for name in reply[3 : 3 + int(reply[2])])
                continue
            unknown += [group[int(p) - 1] for p in reply[3:]]
            if code == -1 and (refused is None or group[int(reply[1]) - 1] < refused):
                refused, free, taken = group[int(reply[1]) - 1], max(int(reply[2]), 0), ()
        return Reservation(
            ids[refused] if refused is not None else None,
            free,
            tuple(ids[p] for p in sorted(unknown)),
            taken,
        )

    def hold_units(self, order_id: str, names: Mapping[str, Sequence[str]]) -> None:
        """After a create's commit: its named units (resource id -> names) are held by it,
        so that the next ask for one is refused here (``reserve.lua``)."""
        listed = {rid: "\n".join(units) for rid, units in names.items() if units}
        if not listed:
            return
        with redis_errors("hold_units"):
            pipe = self.client.pipeline(transaction=False)
            for rid, units in names.items():
                pairs = [field for unit in units for field in (unit, order_id)]
                pipe.hset(self.keys(rid)[2], items=[*pairs, "#" + order_id, listed[rid]])
            pipe.execute()

    # -- release, sell, move ------------------------------------------------------------

    def release(self, order_id: str, resource_ids: Sequence[str]) -> None:
        """Take the order's member out of each resource (``release.lua``); idempotent."""
        self.release_many([(order_id, resource_ids)])

    def release_many(self, pairs: Iterable[tuple[str, Sequence[str]]]) -> None:
        """:meth:`release` for many (order id, resource ids), one round trip per node."""
        calls = []
        for order_id, resource_ids in pairs:
            ids = list(resource_ids)
            calls.append((order_id, ids, self.slot_groups(ids)))
        self._run_per_group("release", calls)

    def sell(self, order_id: str, resource_ids: Sequence[str]) -> None:
        """Move the order's units from held to sold where it is a member (``release.lua``
        with ``sold``); elsewhere nothing changes. Idempotent."""
        ids = list(resource_ids)
        self._run_per_group("sell", [(order_id, ids, self.slot_groups(ids))])

    def _run_per_group(
        self, op: str, calls: list[tuple[str, list[str], list[list[int]]]]
    ) -> list[Any]:
        """``release.lua`` once per (order, slot group), its KEYS the group's keys and its
        ARGV the order id (and ``sold`` when ``op`` is ``sell``), all sent at once; the
        replies in order (an error reply is raised)."""
        packer = CallPacker(self._release, [])
        flag = [b"sold"] if op == "sell" else []
        for order_id, ids, groups in calls:
            for group in groups:
                keys = self._keys_of(ids[i] for i in group)
                packer.add_call([k.encode() for k in keys], [order_id.encode(), *flag])
        if not packer.calls:
            return []
        with redis_errors(op):
            replies = send_calls(self.client, packer).read()
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    def move(self, order_id: str, resource_ids: Sequence[str], expires_at_ms: int) -> None:
        """Give the order's member of each resource the expiry ``expires_at_ms`` where it is
        a member (ZADD XX: a released or sold order does not come back), for an extension."""
        with redis_errors("move"):
            pipe = self.client.pipeline(transaction=False)
            for resource_id in resource_ids:
                pipe.zadd(self.keys(resource_id)[1], {order_id: expires_at_ms}, xx=True)
            pipe.execute()

    # -- capacity, rebuild, forget ------------------------------------------------------

    def set_capacity(self, resource_id: str, capacity: int) -> bool:
        """Write the capacity where the resource is known; True if written (a missing
        resource stays unknown until rebuilt)."""
        with redis_errors("set_capacity"):
            return bool(self._set_capacity(keys=[self.keys(resource_id)[0]], args=[capacity]))

    def rebuild(
        self,
        resource_id: str,
        capacity: int,
        sold: int,
        held: Sequence[tuple[str, int, int]],
        now_ms: int,
        named: Sequence[tuple[str, str, str | None]] = (),
    ) -> None:
        """Replace the resource's keys with exactly this state: ``held`` is (order id, units,
        expiry ms) per member, those expired at ``now_ms`` left out; ``named`` the named
        units (name, state, order id), those of live members and those sold written.
        Written under temporary keys, :data:`REBUILD_CHUNK` members a call, then swapped in
        by one script: a reader sees the old state or the new, never half."""
        live = {order_id: (units, expiry) for order_id, units, expiry in held if expiry > now_ms}
        members = [(o, u, e) for o, (u, e) in live.items()]
        build = resource_build_keys(self.key_prefix, resource_id, uuid.uuid4().hex)
        ttl = b"%d" % REBUILD_TTL_MS
        with redis_errors("rebuild"):
            for start in range(0, max(len(members), 1), REBUILD_CHUNK):
                first = (b"%d" % capacity, b"%d" % sold) if start == 0 else (b"", b"")
                args = [ttl, *first]
                for order_id, units, expiry in members[start : start + REBUILD_CHUNK]:
                    args += [order_id.encode(), b"%d" % units, b"%d" % expiry]
                self._rebuild_part(keys=list(build[:2]), args=args)
            fields = _unit_fields(named, live)
            for start in range(0, len(fields), 2 * REBUILD_CHUNK):
                part = fields[start : start + 2 * REBUILD_CHUNK]
                self._rebuild_units(keys=[build[2]], args=[ttl, *part])
            swapped = self._rebuild_swap(keys=[*build, *self.keys(resource_id)])
        if not swapped:
            raise StoreUnavailable("redis", "rebuild failed: its temporary keys were lost")

    def forget(self, resource_id: str) -> None:
        """Delete the resource's keys (one slot: one DEL)."""
        with redis_errors("forget"):
            self.client.delete(*self.keys(resource_id))

    # -- reads ----------------------------------------------------------------------------

    def snapshot(self, resource_id: str, now_ms: int) -> ResourceSnapshot | None:
        """The resource as a reserve at ``now_ms`` would count it, or None when unknown (no
        hash, or a hash and a holds set that disagree)."""
        res, holds, units_key = self.keys(resource_id)
        with redis_errors("snapshot"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(res)
            pipe.zrange(holds, 0, -1, withscores=True, score_cast_func=text_of)
            pipe.hgetall(units_key)
            fields, scored, unit_fields = pipe.execute()
        state = {text_of(k): int(v) for k, v in fields.items()}
        units = {k[2:]: v for k, v in state.items() if k.startswith("o:")}
        if "cap" not in state or len(units) != len(scored):
            return None
        expiry = {text_of(member): int(Decimal(score)) for member, score in scored}
        members = {o: (u, expiry[o]) for o, u in units.items() if expiry.get(o, 0) > now_ms}
        expired = sum(u for o, u in units.items() if o not in members)
        holders = {text_of(k): text_of(v) for k, v in unit_fields.items()}
        named = {
            unit: holder
            for unit, holder in holders.items()
            if not unit.startswith("#") and (holder.startswith("!") or holder in members)
        }
        return ResourceSnapshot(
            state["cap"], state.get("sold", 0), state.get("held", 0) - expired, members, named
        )

    def scan_resources(self, *, chunk: int = 500) -> Generator[list[str]]:
        """The ids of the resources that have a hash, a SCAN batch at a time, on every
        primary of a cluster (close the iterator when stopping early)."""
        prefix = self.key_prefix
        yield from scan_named(
            self.client,
            "scan_resources",
            resource_pattern(prefix),
            chunk,
            lambda key: resource_of(key, prefix),
            self._foreign,
        )

    def _foreign(self, key: bytes | str, what: str) -> None:
        metrics.FOREIGN_KEYS.inc()
        log.debug("skipping foreign data under the key prefix (%s): key %r", what, key[:80])


def _asks(holds: Sequence[tuple[str, int]], names: Mapping[str, Sequence[str]]) -> list[bytes]:
    """``reserve.lua``'s ARGV of each resource: its units, then the names asked for."""
    asks = []
    for rid, count in holds:
        asked = names.get(rid, ())
        asks.append(b"\n".join([b"%d" % count, *(name.encode() for name in asked)]))
    return asks


def _unit_fields(
    units: Sequence[tuple[str, str, str | None]], live: Mapping[str, object]
) -> list[str]:
    """The units hash of a rebuild as ``rebuild_units.lua``'s (field, value) pairs: each
    unit held by a live member and each sold, and the list of each holder's units."""
    fields: list[str] = []
    listed: dict[str, list[str]] = {}
    for name, state, order_id in units:
        if order_id is None:
            continue
        if state == "sold":
            fields += [name, "!" + order_id]
        elif state == "held" and order_id in live:
            fields += [name, order_id]
            listed.setdefault(order_id, []).append(name)
    for order_id, names in listed.items():
        fields += ["#" + order_id, "\n".join(names)]
    return fields
