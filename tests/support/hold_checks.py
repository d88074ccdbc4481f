"""What the tests of holds (issue 43) check in both stores, read straight from the tables
(never through the code under test's own reads, which a bug would share).

* :func:`sql_problems`: in SQL, no resource oversold (held + sold <= capacity), every
  hold's status follows its order's (unpaid: held; paid: sold; cancelled or closed:
  released), and each resource's ``held`` and ``sold`` are the sums of its held and sold
  holds (nothing sold twice, nothing released twice, no counter drifted from its rows).
* :func:`index_problems`: the Redis index of each resource equal to SQL at ``now_ms``:
  capacity, sold, and the live held members with their units and expiry.

Named units and waiting lists (issue 44), over one resource:

* :func:`seat_sample` reads its units, the live orders' ``holds`` and its waiting entries in
  one statement (one snapshot); :func:`seat_problems` (each unit held or sold by at most
  one order, agreeing with it) and :func:`fifo_problems` (served entries a prefix of the
  queue) judge a sample.
* :func:`unit_problems`: the units agree with the resource's counters and the holds' rows;
  :func:`waiting_problems`: each served entry has exactly its one order ``waiting-<id>``;
  :func:`unit_index_problems`: the index's units hash equal to SQL's holders and buyers.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

from sqlalchemy import Engine, String, cast, literal, null, select, union_all

from orders.index.resources import ResourceIndex
from orders.sql.inventory_tables import holds_table, resources_table, units_table, waiting_table
from orders.sql.models import orders_table

HOLD = holds_table.c
ORDER = orders_table.c
RESOURCE = resources_table.c
UNIT = units_table.c
WAIT = waiting_table.c

#: The status of a hold, by the status of its order.
FOLLOWS = {"unpaid": "held", "paid": "sold", "cancelled": "released", "closed": "released"}

#: What the index must hold of a resource: (cap, sold, held, {order id: (units, expiry)}).
IndexState = tuple[int, int, int, dict[str, tuple[int, int]]]


def sql_problems(engine: Engine) -> list[str]:
    """Every breach of the SQL rules of holds (module docstring); [] when none."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(HOLD.order_id, HOLD.resource_id, HOLD.quantity, HOLD.status, ORDER.status).join(
                orders_table, ORDER.id == HOLD.order_id
            )
        ).all()
        resources = conn.execute(
            select(RESOURCE.id, RESOURCE.capacity, RESOURCE.held, RESOURCE.sold)
        ).all()
    problems: list[str] = []
    taken: defaultdict[str, int] = defaultdict(int)
    sold: defaultdict[str, int] = defaultdict(int)
    held: defaultdict[str, int] = defaultdict(int)
    for order_id, resource_id, units, status, order_status in rows:
        if FOLLOWS[order_status] != status:
            problems.append(f"{order_id} is {order_status} but its {resource_id} is {status}")
        if status in ("held", "sold"):
            taken[resource_id] += units
        if status == "sold":
            sold[resource_id] += units
        if status == "held":
            held[resource_id] += units
    for resource_id, capacity, held_count, sold_count in resources:
        if taken[resource_id] > capacity:
            problems.append(f"{resource_id} oversold: {taken[resource_id]} of {capacity}")
        if sold_count != sold[resource_id]:
            problems.append(f"{resource_id} sold {sold_count}, sold holds {sold[resource_id]}")
        if held_count != held[resource_id]:
            problems.append(f"{resource_id} held {held_count}, held holds {held[resource_id]}")
    return problems


def sql_state(engine: Engine, resource_id: str, now_ms: int) -> IndexState:
    """What the index must hold of ``resource_id`` at ``now_ms``, read from SQL: the held
    holds of unpaid orders whose expiry is ahead are its members."""
    with engine.connect() as conn:
        capacity, sold = conn.execute(
            select(RESOURCE.capacity, RESOURCE.sold).where(RESOURCE.id == resource_id)
        ).one()
        held = conn.execute(
            select(HOLD.order_id, HOLD.quantity, ORDER.expires_at_ms)
            .join(orders_table, ORDER.id == HOLD.order_id)
            .where(
                HOLD.resource_id == resource_id,
                HOLD.status == "held",
                ORDER.status == "unpaid",
                ORDER.expires_at_ms > now_ms,
            )
        ).all()
    members = {order_id: (int(units), int(expiry)) for order_id, units, expiry in held}
    return int(capacity), int(sold), sum(u for u, _ in members.values()), members


def index_state(index: ResourceIndex, resource_id: str, now_ms: int) -> IndexState | None:
    """The resource as the Redis index counts it at ``now_ms`` (None: unknown)."""
    snap = index.snapshot(resource_id, now_ms)
    return None if snap is None else (snap.cap, snap.sold, snap.held, snap.members)


def index_problems(
    index: ResourceIndex, engine: Engine, resource_ids: list[str], now_ms: int
) -> list[str]:
    """Each resource whose index differs from SQL at ``now_ms``; [] when all agree."""
    problems = []
    for resource_id in resource_ids:
        want, got = sql_state(engine, resource_id, now_ms), index_state(index, resource_id, now_ms)
        if got != want:
            problems.append(f"{resource_id}: redis {got}, sql {want}")
    return problems


# --- named units and waiting lists (issue 44) ------------------------------------------

#: The state of a named unit, by the status of the live order holding it.
UNIT_FOLLOWS = {"unpaid": "held", "paid": "sold"}
#: The statuses of a waiting entry in a run that never leaves a queue nor sets ``until``.
FIFO = ("served", "waiting")


@dataclass(frozen=True)
class SeatSample:
    """One resource's units, the live orders' names and its waiting list, as one SQL
    statement saw them (one snapshot)."""

    #: unit name -> (state, order id of the holder or last holder, that order's status).
    units: dict[str, tuple[str, str | None, str | None]]
    #: live (unpaid or paid) order id -> (status, what its ``holds`` JSON names of the
    #: resource: a list of names, or whatever else it holds there).
    claims: dict[str, tuple[str, object]]
    #: the resource's waiting entries in id order: (id, status, order id).
    entries: list[tuple[int, str, str | None]]


def seat_sample(engine: Engine, resource_id: str) -> SeatSample:
    """:class:`SeatSample` of ``resource_id`` in ONE statement (a UNION ALL), so the units,
    the orders and the queue are read at the same moment on both engines."""
    text = String()
    units = (
        select(
            literal("u", text).label("kind"),
            UNIT.name.label("key"),
            UNIT.state.label("state"),
            UNIT.order_id.label("ref"),
            ORDER.status.label("status"),
            cast(null(), text).label("names"),
        )
        .select_from(units_table.outerjoin(orders_table, ORDER.id == UNIT.order_id))
        .where(UNIT.resource_id == resource_id)
    )
    claims = select(
        literal("o", text),
        ORDER.id,
        ORDER.status,
        cast(null(), text),
        cast(null(), text),
        cast(ORDER.holds, text),
    ).where(ORDER.status.in_(list(UNIT_FOLLOWS)), ORDER.holds.is_not(None))
    entries = select(
        literal("w", text),
        cast(WAIT.id, text),
        WAIT.status,
        WAIT.order_id,
        cast(null(), text),
        cast(null(), text),
    ).where(WAIT.resource_id == resource_id)
    with engine.connect() as conn:
        rows = conn.execute(union_all(units, claims, entries)).all()
    sample = SeatSample({}, {}, [])
    for kind, key, state, ref, status, names in rows:
        if kind == "u":
            sample.units[key] = (state, ref, status)
        elif kind == "o":
            held = json.loads(names) or {}
            if resource_id in held:
                sample.claims[key] = (state, held[resource_id])
        else:
            sample.entries.append((int(key), state, ref))
    sample.entries.sort()
    return sample


def seat_problems(sample: SeatSample) -> list[str]:
    """Every unit held or sold by at most one order, and in agreement with it: a held unit's
    holder unpaid, a sold one's paid; each live order's names held (unpaid) or sold (paid)
    by that very order; no name claimed by two live orders; [] when all hold."""
    problems: list[str] = []
    claimed: defaultdict[str, list[str]] = defaultdict(list)
    for order_id, (status, names) in sorted(sample.claims.items()):
        if not isinstance(names, list):
            problems.append(f"{order_id} ({status}) holds {names!r}, not named units")
            continue
        for name in names:
            claimed[name].append(order_id)
            unit, of, _ = sample.units.get(name, ("missing", None, None))
            if (unit, of) != (UNIT_FOLLOWS[status], order_id):
                problems.append(f"{order_id} ({status}) names {name}: {unit} for {of}")
    for name, owners in sorted(claimed.items()):
        if len(owners) > 1:
            problems.append(f"{name} claimed by {len(owners)} live orders: {owners}")
    for name, (state, last, its_status) in sorted(sample.units.items()):
        holder = last or "nobody"
        if state == "free":
            continue
        if its_status is None or UNIT_FOLLOWS.get(its_status) != state:
            problems.append(f"{name} is {state} for {holder}, which is {its_status}")
        elif holder not in claimed[name]:
            problems.append(f"{name} is {state} for {holder}, whose holds do not name it")
    return problems


def fifo_problems(sample: SeatSample) -> list[str]:
    """The served entries a prefix, in id order, of the served and waiting ones (a queue
    whose entries never leave nor expire, all of quantity 1, of distinct users, under a
    generous unpaid limit: nothing may be skipped); [] when it holds."""
    problems = [f"entry {e} is {status}" for e, status, _ in sample.entries if status not in FIFO]
    first_waiting = next((e for e, status, _ in sample.entries if status == "waiting"), None)
    if first_waiting is not None:
        jumped = [e for e, status, _ in sample.entries if status == "served" and e > first_waiting]
        if jumped:
            problems.append(f"entries {jumped[:5]} served while entry {first_waiting} waits")
    return problems


def unit_problems(engine: Engine, resource_id: str) -> list[str]:
    """:func:`seat_problems`, and the units agree with the counters and the holds: as many
    units held (sold) as the resource's ``held`` (``sold``), and each hold of an order as
    many units as its names."""
    sample = seat_sample(engine, resource_id)
    problems = seat_problems(sample)
    with engine.connect() as conn:
        held, sold = conn.execute(
            select(RESOURCE.held, RESOURCE.sold).where(RESOURCE.id == resource_id)
        ).one()
        holds = dict(
            conn.execute(
                select(HOLD.order_id, HOLD.quantity).where(
                    HOLD.resource_id == resource_id, HOLD.status.in_(["held", "sold"])
                )
            ).all()
        )
    states = Counter(state for state, _, _ in sample.units.values())
    if (states["held"], states["sold"]) != (held, sold):
        problems.append(f"units {dict(states)}, resource held {held} sold {sold}")
    for order_id, (status, names) in sorted(sample.claims.items()):
        count = len(names) if isinstance(names, list) else None
        if holds.get(order_id) != count:
            problems.append(
                f"{order_id} ({status}) names {count} units, holds {holds.get(order_id)}"
            )
    return problems


def waiting_problems(engine: Engine, resource_id: str) -> list[str]:
    """Each entry served exactly once: a served entry has the one order ``waiting-<id>``, of
    its user, whose metadata names it; no other order names it or bears its id, and no
    entry that is not served has one; [] when it holds."""
    with engine.connect() as conn:
        entries = {
            int(row.id): row
            for row in conn.execute(
                select(WAIT.id, WAIT.user_id, WAIT.status, WAIT.order_id).where(
                    WAIT.resource_id == resource_id
                )
            )
        }
        orders = conn.execute(select(ORDER.id, ORDER.user_id, ORDER["metadata"])).all()
    made: defaultdict[int, list[str]] = defaultdict(list)
    problems: list[str] = []
    for order_id, user_id, metadata in orders:
        named = (metadata or {}).get("waiting_entry")
        own = re.fullmatch(r"waiting-(\d+)", order_id)
        by_id = int(own[1]) if own else None
        if named is None and by_id is None and not order_id.startswith("waiting-"):
            continue
        if named != by_id:
            problems.append(f"{order_id} names entry {named}")
        key = by_id if by_id is not None else named
        entry = None if key is None else entries.get(int(str(key)))
        if entry is None:
            problems.append(f"{order_id}: no entry {key}")
            continue
        made[entry.id].append(order_id)
        if user_id != entry.user_id:
            problems.append(f"{order_id} is {user_id}'s, entry {entry.id} {entry.user_id}'s")
    for entry_id, entry in sorted(entries.items()):
        want = [f"waiting-{entry_id}"] if entry.status == "served" else []
        if sorted(made[entry_id]) != want or entry.order_id != (want[0] if want else None):
            problems.append(
                f"entry {entry_id} {entry.status} (order {entry.order_id}): orders {made[entry_id]}"
            )
    return problems


def unit_index_problems(
    index: ResourceIndex, engine: Engine, resource_id: str, now_ms: int
) -> list[str]:
    """The index's units of the resource (unit -> live holder, or ``!`` + buyer) equal to
    SQL's at ``now_ms``; [] when they agree."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(UNIT.name, UNIT.state, UNIT.order_id, ORDER.status, ORDER.expires_at_ms)
            .join(orders_table, ORDER.id == UNIT.order_id)
            .where(UNIT.resource_id == resource_id, UNIT.state.in_(["held", "sold"]))
        ).all()
    want = {
        name: ("!" + order_id if state == "sold" else order_id)
        for name, state, order_id, status, expires_at_ms in rows
        if state == "sold" or (status == "unpaid" and expires_at_ms > now_ms)
    }
    snap = index.snapshot(resource_id, now_ms)
    got = None if snap is None else snap.units
    return [] if got == want else [f"{resource_id} units: redis {got}, sql {want}"]
