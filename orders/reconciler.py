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
that Redis lost its data and a rebuild is due. Data under the key prefix that the service
did not write (a key that names no user, a member that is not UTF-8, a key of another type)
is skipped, counted in the report and logged once: it never stops a rebuild.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

from orders import metrics
from orders.domain import Clock
from orders.index import UnpaidIndex
from orders.records import OrderRecords
from orders.validation import check_count, check_user_id


@dataclass
class ReconcileReport:
    """What a reconcile found, and fixed unless it was a dry run (counts of members)."""

    users: int = 0
    added: int = 0
    rescored: int = 0
    removed_terminal: int = 0
    removed_expired: int = 0
    kept_in_flight: int = 0
    #: Keys or members under the prefix the service did not write: skipped, left alone.
    foreign_skipped: int = 0
    dry_run: bool = False

    @property
    def fixes(self) -> int:
        """Members that were wrong (expired ones are routine: the sweep drops them too)."""
        return self.added + self.rescored + self.removed_terminal

    def as_dict(self) -> dict[str, int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Reconciler:
    """Repairs the index from the records (see the module docstring)."""

    def __init__(
        self, records: OrderRecords, index: UnpaidIndex, clock: Clock, *, max_user_id_length: int
    ) -> None:
        self.records = records
        self.index = index
        self.clock = clock
        self.max_user_id_length = max_user_id_length

    def reconcile(
        self,
        *,
        user_id: str | None = None,
        dry_run: bool = False,
        chunk_size: int = 500,
        on_progress: Callable[[int], None] | None = None,
    ) -> ReconcileReport:
        """Make the Redis index equal to SQL, for one user or for everyone.

        ``on_progress`` is called with the number of users handled after each chunk.
        """
        check_count("chunk_size", chunk_size, 1, 10_000)
        now_ms = self.clock()
        report = ReconcileReport(dry_run=dry_run)
        foreign_before = self.index.foreign_seen
        if user_id is not None:
            uid = check_user_id(user_id, self.max_user_id_length)
            chunks: Iterator[tuple[list[str], bool]] = iter([([uid], False)])
        else:
            # Then every key SCAN finds, less the users the first pass already covered.
            chunks = _chain(
                ((users, False) for users in self._sql_users(now_ms, chunk_size)),
                ((users, True) for users in self.index.scan_users(chunk=chunk_size)),
            )
        for users, skip_open in chunks:
            self._reconcile_users(users, now_ms, dry_run, report, skip_open=skip_open)
            if on_progress is not None:
                on_progress(report.users)
        report.foreign_skipped = self.index.foreign_seen - foreign_before
        if user_id is None and not dry_run:
            self.index.set_epoch(str(now_ms))
        if not dry_run:
            for kind in ("added", "rescored", "removed_terminal", "removed_expired"):
                metrics.RECONCILE_FIXES.labels(kind).inc(getattr(report, kind))
        return report

    def _sql_users(self, now_ms: int, chunk_size: int) -> Iterator[list[str]]:
        """Users with open unpaid orders, in user-id order, a chunk per query."""
        after = ""
        while users := self.records.users_with_open(now_ms, after, chunk_size):
            yield users
            after = users[-1]

    def _reconcile_users(
        self,
        users: list[str],
        now_ms: int,
        dry_run: bool,
        report: ReconcileReport,
        *,
        skip_open: bool,
    ) -> None:
        """Repair these users' keys. ``skip_open``: leave out users SQL has open orders for
        (the pass over SQL's users handled them; a user only just given one is indexed)."""
        wanted = self.records.open_by_user(users, now_ms)
        if skip_open:
            users = [user for user in users if not wanted[user]]
            if not users:
                return
        present = self.index.members_of(users)
        users = [user for user in users if user in present]  # foreign keys are left out
        extra = [
            order_id
            for user in users
            for order_id, score in present[user].items()
            if order_id not in wanted[user] and score > now_ms
        ]
        owners = self.records.open_owners(extra, now_ms)
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
            self.index.repair(user, now_ms=now_ms, remove=remove, add=add)
            added += [(user, o) for o in add]
        if added:
            self._undo_stale_adds(added, now_ms)

    def _undo_stale_adds(self, added: list[tuple[str, str]], now_ms: int) -> None:
        """Remove what we just added if its order stopped being open meanwhile.

        A payment commits, then removes its member; if our add landed after that removal,
        it would linger until expiry. Reading SQL after the add closes the gap: whichever
        order the two happen in, one of the removals comes last.
        """
        owners = self.records.open_owners([order_id for _, order_id in added], now_ms)
        for user, order_id in added:
            if owners.get(order_id) != user:
                self.index.release(user, order_id)


def _chain(*parts: Iterator[tuple[list[str], bool]]) -> Iterator[tuple[list[str], bool]]:
    for part in parts:
        yield from part
