"""Rebuild or repair the Redis index from SQL.

Redis can lose data at any time (a restart without persistence, FLUSHALL, a failover that
dropped the last writes, eviction), and a crash between a create's two steps or a Redis
outage during a payment leaves members SQL no longer wants. :func:`reconcile` makes each
user's set equal to SQL's view:

* an unpaid order whose expiry is ahead gets its member, with its exact expiry as score;
* a member whose order is paid, cancelled or closed, or whose expiry has passed, goes;
* a member with no SQL row at all stays (a create may be between its Redis and SQL steps)
  until its own expiry drops it;
* a key left with no members disappears (Redis deletes empty sets).

It walks users in chunks, first the users SQL says have open orders, then every key that
SCAN finds, so memory stays bounded by the chunk size, however many orders there are.
A full run finishes by writing the index epoch marker: its absence tells the scheduler
that Redis lost its data and a rebuild is due.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from sqlalchemy import select

from orders import metrics
from orders.config import check_int_range
from orders.domain import check_user_id
from orders.models import UNPAID_PREDICATE, orders_table, sql_errors
from orders.service import OrderService

OC = orders_table.c


@dataclass
class ReconcileReport:
    """What a reconcile found, and fixed unless it was a dry run (counts of members)."""

    users: int = 0
    added: int = 0
    rescored: int = 0
    removed_terminal: int = 0
    removed_expired: int = 0
    kept_in_flight: int = 0
    dry_run: bool = False

    @property
    def fixes(self) -> int:
        """Members that were wrong (expired ones are routine: the sweep drops them too)."""
        return self.added + self.rescored + self.removed_terminal

    def as_dict(self) -> dict[str, int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def reconcile(
    service: OrderService,
    *,
    user_id: str | None = None,
    dry_run: bool = False,
    chunk_size: int = 500,
    on_progress: Callable[[int], None] | None = None,
) -> ReconcileReport:
    """Make the Redis index equal to SQL, for one user or for everyone.

    ``on_progress`` is called with the number of users handled after each chunk.
    """
    check_int_range("chunk_size", chunk_size, 1, 10_000)
    now_ms = service.clock()
    report = ReconcileReport(dry_run=dry_run)
    if user_id is not None:
        chunks: Iterator[tuple[list[str], bool]] = iter(
            [([check_user_id(user_id, service.settings.max_user_id_length)], False)]
        )
    else:
        # Then every key SCAN finds, less the users the first pass already covered.
        chunks = _chain(
            ((users, False) for users in _sql_users(service, now_ms, chunk_size)),
            ((users, True) for users in service.index.scan_users(chunk=chunk_size)),
        )
    for users, skip_open in chunks:
        _reconcile_users(service, users, now_ms, dry_run, report, skip_open=skip_open)
        if on_progress is not None:
            on_progress(report.users)
    if user_id is None and not dry_run:
        service.index.set_epoch(str(now_ms))
    if not dry_run:
        for kind in ("added", "rescored", "removed_terminal", "removed_expired"):
            metrics.RECONCILE_FIXES.labels(kind).inc(getattr(report, kind))
    return report


def _chain(*parts: Iterator[tuple[list[str], bool]]) -> Iterator[tuple[list[str], bool]]:
    for part in parts:
        yield from part


def _sql_users(service: OrderService, now_ms: int, chunk_size: int) -> Iterator[list[str]]:
    """Users with open unpaid orders, in user-id order, a chunk per query (keyset paging)."""
    after = ""
    while True:
        query = (
            select(OC.user_id)
            .where(UNPAID_PREDICATE, OC.expires_at_ms > now_ms, OC.user_id > after)
            .group_by(OC.user_id)
            .order_by(OC.user_id)
            .limit(chunk_size)
        )
        with sql_errors(), service.engine.connect() as conn:
            users = list(conn.scalars(query))
        if not users:
            return
        yield users
        after = users[-1]


def _open_orders(service: OrderService, users: list[str], now_ms: int) -> dict[str, dict[str, int]]:
    query = select(OC.user_id, OC.id, OC.expires_at_ms).where(
        OC.user_id.in_(users), UNPAID_PREDICATE, OC.expires_at_ms > now_ms
    )
    wanted: dict[str, dict[str, int]] = {user: {} for user in users}
    with sql_errors(), service.engine.connect() as conn:
        for user, order_id, expires_at_ms in conn.execute(query):
            wanted[user][order_id] = expires_at_ms
    return wanted


def _owners_of_open(
    service: OrderService, order_ids: list[str], now_ms: int
) -> dict[str, str | None]:
    """For each id that has a SQL row: its user if the order is open, else None."""
    found: dict[str, str | None] = {}
    for start in range(0, len(order_ids), 500):
        query = select(OC.id, OC.user_id, OC.status, OC.expires_at_ms).where(
            OC.id.in_(order_ids[start : start + 500])
        )
        with sql_errors(), service.engine.connect() as conn:
            for order_id, user, status, expires_at_ms in conn.execute(query):
                is_open = status == "unpaid" and expires_at_ms > now_ms
                found[order_id] = user if is_open else None
    return found


def _reconcile_users(
    service: OrderService,
    users: list[str],
    now_ms: int,
    dry_run: bool,
    report: ReconcileReport,
    *,
    skip_open: bool,
) -> None:
    """Repair these users' keys. ``skip_open``: leave out users SQL has open orders for
    (the pass over SQL's users handled them; a user only just given one is indexed)."""
    wanted = _open_orders(service, users, now_ms)
    if skip_open:
        users = [user for user in users if not wanted[user]]
        if not users:
            return
    present = service.index.members_of(users)
    extra = [
        order_id
        for user in users
        for order_id, score in present[user].items()
        if order_id not in wanted[user] and score > now_ms
    ]
    owners = _owners_of_open(service, extra, now_ms)
    added: list[tuple[str, str]] = []
    for user in users:
        have, want = present[user], wanted[user]
        expired = sum(1 for score in have.values() if score <= now_ms)
        remove = [
            o
            for o, s in have.items()
            if o not in want and s > now_ms and o in owners and owners[o] != user
        ]
        in_flight = sum(
            1 for o, s in have.items() if o not in want and s > now_ms and o not in owners
        )
        add = {o: exp for o, exp in want.items() if have.get(o) != exp}
        report.users += 1
        report.removed_expired += expired
        report.removed_terminal += len(remove)
        report.kept_in_flight += in_flight
        report.added += sum(1 for o in add if o not in have)
        report.rescored += sum(1 for o in add if o in have)
        if dry_run or not (expired or remove or add):
            continue
        service.index.repair(user, now_ms=now_ms, remove=remove, add=add)
        added += [(user, o) for o in add]
    if added:
        _undo_stale_adds(service, added, now_ms)


def _undo_stale_adds(service: OrderService, added: list[tuple[str, str]], now_ms: int) -> None:
    """Remove what we just added if its order stopped being open meanwhile.

    A payment commits, then removes its member; if our add landed after that removal, it
    would linger until expiry. Reading SQL after the add closes the gap: whichever order the
    two happen in, one of the removals comes last.
    """
    owners = _owners_of_open(service, [order_id for _, order_id in added], now_ms)
    for user, order_id in added:
        if owners.get(order_id) != user:
            service.index.release(user, order_id)
