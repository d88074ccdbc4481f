"""Rebuild or repair the Redis index from SQL.

Redis can lose data at any time (a restart without persistence, FLUSHALL, a failover that
dropped the last writes, eviction), and a crash between a create's two steps or a Redis
outage during a payment leaves members SQL no longer wants. :func:`reconcile` makes each
user's set equal to SQL's view:

* an unpaid order whose expiry is ahead gets its member, with its exact expiry as score;
* a member whose order is paid, cancelled or closed, or whose expiry has passed, goes;
* a member with no SQL row at all stays while its create may still be between its Redis
  and SQL steps (its admission, on record beside the set, started less than the admission
  window ago); once the create is certainly over (it started longer ago, or no admission
  of it is on record: every record outlives the window, or, ``SUSPECT_AFTER_MS`` after its
  start, SQL says no transaction can still write it: :mod:`orders.sql.inflight`), it goes;
* a key left with no members disappears (Redis deletes empty sets).

A full run makes two passes; ``now`` is read once at the start, and every SCAN batch and
every page reads SQL afresh.

1. SCAN pass: the keys of users SQL has no open order for (one SQL query per SCAN batch;
   users with one are left to the SQL pass). All their members are extras. After a flush
   it finds nothing, so a rebuild costs the SQL pass alone.
2. SQL pass: SQL's open orders once, in (user, expiry, id) order, a page at a time, each
   page one pipelined round trip (a ``reconcile.lua`` script per user); while Redis runs a
   page, the next one is read and packed.

SQL and Redis round trips grow with the number of pages and SCAN batches, not of users,
and memory stays bounded by the page size. Writes landing during the run:

* A create writes its member itself. If its row is committed when its user's page is read,
  the SQL pass lists it; if not, the member is an extra without a row and stays.
* A payment or cancel commits, then removes its member. If the user still has an open
  order when its page is read, the SQL pass fixes the whole key (a removal that failed
  included); if the page listed the order and our add lands after that removal, the
  stale-add check (SQL read after the add) takes it out again.
* Not promised by one run: a user whose last open order closes after its SCAN batch and
  before its page (or whose first one opens between the passes) may be fixed by neither
  pass (or counted twice). Members it held before the run then wait for the next run or
  their own expiry; the run itself never leaves a wrong member behind. The passes the
  other way round had the mirror case.

The users' own limits (``oes_user_limits``) have a key each, which ``admit.lua`` reads: a full
run writes every one from SQL (a page of rows per round trip), then SCANs the limit keys and
removes those whose row is gone (written first, removed second: a limit cleared during the
run loses its key at the latest in the second step). A one-user run fixes that user's key.

A full run finishes by writing the index epoch marker, naming the run of the Redis server
(its ``run_id``, read before the run's first write) it was rebuilt on: its absence tells the
scheduler that Redis lost its data, and another run id that Redis restarted or failed over
(perhaps from an older snapshot); either way a rebuild is due. Data under the key prefix
that the service did not write (a key that names no user, a member that is not UTF-8, a key
of another type) is skipped, counted in the report and logged once: it never stops a rebuild.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, fields

from orders import metrics
from orders.domain import Clock
from orders.index.admissions import SUSPECT_AFTER_MS
from orders.index.reconcile_batch import KeysChecked, ReconcileBatch
from orders.index.unpaid import UnpaidIndex
from orders.rules.holding import Holding, reconcile_resources
from orders.sql.records import OrderRecords
from orders.validation import check_count, check_user_id

#: The logger keeps the name operators configure (docs/operations.md), whatever the module.
log = logging.getLogger("orders.reconciler")

#: Order rows per SQL page and keys per SCAN call: 1,000 measured best (scripts/reconcile_rate.py).
DEFAULT_CHUNK_SIZE = 1000
#: Seconds between two progress lines of a long rebuild.
PROGRESS_LOG_INTERVAL_S = 5.0


@dataclass
class ReconcileReport:
    """What a reconcile found, and fixed unless it was a dry run (counts of members)."""

    users: int = 0
    added: int = 0
    rescored: int = 0
    removed_terminal: int = 0
    removed_expired: int = 0
    #: Members with no SQL row whose create is certainly over (it started more than the
    #: admission window ago, no admission of it is on record, or SQL says it died): removed.
    removed_abandoned: int = 0
    #: Members with no SQL row whose create may still be running: kept.
    kept_in_flight: int = 0
    #: Keys or members under the prefix the service did not write: skipped, left alone.
    foreign_skipped: int = 0
    #: Users' own limits written from SQL, and limit keys removed (their SQL row is gone).
    limits_written: int = 0
    limits_removed: int = 0
    #: Counted resources compared with SQL; of those, rebuilt because the index lacked
    #: them or counted them wrongly; and resources only the index had, removed.
    resources: int = 0
    resources_missing: int = 0
    resources_stale: int = 0
    resources_removed: int = 0
    dry_run: bool = False

    @property
    def fixes(self) -> int:
        """Members that were wrong (expired ones are routine: the sweep drops them too)."""
        return self.added + self.rescored + self.removed_terminal + self.removed_abandoned

    def as_dict(self) -> dict[str, int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Reconciler:
    """Repairs the index from the records (see the module docstring)."""

    def __init__(
        self,
        records: OrderRecords,
        index: UnpaidIndex,
        clock: Clock,
        *,
        max_user_id_length: int,
        holding: Holding | None = None,
    ) -> None:
        self.holding = holding
        self.reads = records.reads
        self.in_flight = records.in_flight
        self.index = index
        self.clock = clock
        self.max_user_id_length = max_user_id_length

    def reconcile(
        self,
        user_id: str | None,
        dry_run: bool,
        chunk_size: int,
        on_progress: Callable[[int], None] | None,
    ) -> ReconcileReport:
        """Make the Redis index equal to SQL, for one user or for everyone.

        ``chunk_size`` is the number of order rows per SQL page and of keys asked of each
        SCAN call (one SQL query per batch). ``on_progress`` is called with the number of
        users handled so far after each SCAN batch and each page: keep it cheap. What it
        raises ends the run (the SCAN call or page in flight is given up) and propagates.
        """
        check_count("chunk_size", chunk_size, 1, 10_000)
        now_ms = self.clock()
        report = ReconcileReport(dry_run=dry_run)
        foreign_before = self.index.foreign_seen
        progress = _Progress(on_progress, logged=user_id is None)
        whole = user_id is None and not dry_run
        # The servers' runs before the first write: one restarted during the run is named
        # wrongly by its marker, so the next check rebuilds it again.
        runs = self.index.epoch.server_runs() if whole else {}
        if user_id is not None:
            uid = check_user_id(user_id, self.max_user_id_length)
            self._fix(self.reads.open_by_user([uid], now_ms), now_ms, dry_run, report)
            self._fix_limits([uid], dry_run, report)
            progress.step(report.users)
        else:
            self._scan_pass(now_ms, chunk_size, dry_run, report, progress)
            self._sql_pass(now_ms, chunk_size, dry_run, report, progress)
            self._limits_pass(chunk_size, dry_run, report)
            if self.holding is not None:
                drift = reconcile_resources(self.holding, now_ms, dry_run, chunk_size)
                report.resources = drift.checked
                report.resources_missing = drift.missing
                report.resources_stale = drift.stale
                report.resources_removed = drift.removed
        report.foreign_skipped = self.index.foreign_seen - foreign_before
        if whole:
            self.index.epoch.set(str(now_ms), runs)
        if not dry_run:
            for kind in (
                "added",
                "rescored",
                "removed_terminal",
                "removed_expired",
                "removed_abandoned",
            ):
                metrics.RECONCILE_FIXES.labels(kind).inc(getattr(report, kind))
        progress.done(report)
        return report

    def _scan_pass(
        self, now_ms: int, size: int, dry_run: bool, report: ReconcileReport, progress: _Progress
    ) -> None:
        """The keys of users SQL has no open order for, a SCAN batch at a time; a user with
        one is left to the SQL pass."""
        with closing(self.index.scan_users(chunk=size)) as batches:
            for users in batches:
                idle = self.reads.users_without_open(users, now_ms)
                if idle:
                    self._fix({user: {} for user in idle}, now_ms, dry_run, report)
                progress.step(report.users)

    def _sql_pass(
        self, now_ms: int, size: int, dry_run: bool, report: ReconcileReport, progress: _Progress
    ) -> None:
        """SQL's open orders, a page at a time, the two stores kept busy together: while
        Redis runs page N's scripts, page N+1 is read from SQL and packed; once N's replies
        are in, N+1 goes out, and N's extras and adds are settled while Redis runs it. At
        most one page's replies are outstanding; whatever ends the pass early (an error,
        ``on_progress`` raising) closes the connection they would come back on."""
        pages = self._open_pages(now_ms, size)
        wanted = next(pages, None)
        in_flight: ReconcileBatch | None = None
        try:
            if wanted is not None:
                in_flight = self._batch(wanted, now_ms, dry_run)
                in_flight.send()
            while wanted is not None and in_flight is not None:
                following = next(pages, None)
                upcoming = None if following is None else self._batch(following, now_ms, dry_run)
                found = in_flight.read()
                if upcoming is not None:
                    upcoming.send()
                in_flight = upcoming
                self._record(found, wanted, now_ms, dry_run, report)
                progress.step(report.users)
                wanted = following
        finally:
            if in_flight is not None:
                in_flight.abandon()  # nothing when its replies were read

    def _limits_pass(self, size: int, dry_run: bool, report: ReconcileReport) -> None:
        """Every user's own limit key written from SQL, then the keys with no row removed."""
        after: str | None = None
        while True:
            page = self.reads.limits_page(after, size)
            if not dry_run:
                self.index.limits.write(page)
            report.limits_written += len(page)
            if len(page) < size:
                break
            after = next(reversed(page))
        with closing(self.index.limits.scan_users(chunk=size)) as batches:
            for users in batches:
                self._fix_limits(users, dry_run, report, scanned=True)

    def _fix_limits(
        self, users: list[str], dry_run: bool, report: ReconcileReport, *, scanned: bool = False
    ) -> None:
        """Make these users' limit keys say what SQL does. ``scanned``: they came from the
        SCAN of limit keys, after every row was written: only keys without a row are left."""
        own = self.reads.limits_of(users)
        gone: dict[str, int | None] = {user: None for user in users if user not in own}
        if not scanned:
            report.limits_written += len(own)
            if not dry_run:
                self.index.limits.write(dict(own))
        if not dry_run:
            report.limits_removed += self.index.limits.write(gone)
        elif scanned:
            report.limits_removed += len(gone)
        else:
            report.limits_removed += sum(self.index.limits.read(user) is not None for user in gone)

    def _open_pages(self, now_ms: int, size: int) -> Iterator[dict[str, dict[str, int]]]:
        """SQL's open orders as {user: {order id: expiry}}, a page of ``size`` rows per
        query, in user order (each user's orders by expiry, as in the set). A user whose
        orders run past a page's end is held over to the next page, so each page holds
        every open order of its users."""
        wanted: dict[str, dict[str, int]] = {}
        after: tuple[str, str, int] | None = None
        while True:
            rows = self.reads.open_page(now_ms, after, size)
            for user, order_id, expires_at_ms in rows:
                wanted.setdefault(user, {})[order_id] = expires_at_ms
            if len(rows) < size:
                if wanted:
                    yield wanted
                return
            after = rows[-1]
            last_user = after[0]
            held = wanted.pop(last_user)
            if wanted:
                yield wanted
            wanted = {last_user: held}

    def _batch(
        self, wanted: dict[str, dict[str, int]], now_ms: int, dry_run: bool
    ) -> ReconcileBatch:
        return self.index.reconcile_batch(wanted, now_ms=now_ms, dry_run=dry_run)

    def _fix(
        self, wanted: dict[str, dict[str, int]], now_ms: int, dry_run: bool, report: ReconcileReport
    ) -> None:
        """Make these users' keys hold ``wanted`` (users in SQL's order), in one go."""
        found = self._batch(wanted, now_ms, dry_run).read()
        self._record(found, wanted, now_ms, dry_run, report)

    def _record(
        self,
        found: KeysChecked,
        wanted: dict[str, dict[str, int]],
        now_ms: int,
        dry_run: bool,
        report: ReconcileReport,
    ) -> None:
        """Count what the scripts found; then one SQL read and one round trip each for
        extras and for what was written."""
        report.users += found.users
        report.removed_expired += found.expired
        report.added += found.added
        report.rescored += found.rescored
        if found.extras:
            self._settle_extras(found.extras, now_ms, dry_run, report)
        if found.written and not dry_run:
            added = [(user, order_id) for user in found.written for order_id in wanted[user]]
            self._undo_stale_adds(added, now_ms)

    def _settle_extras(
        self, extras: list[tuple[str, str]], now_ms: int, dry_run: bool, report: ReconcileReport
    ) -> None:
        """Live members SQL did not list for their user: one whose order is open for another
        user or no longer open goes; one just opened for its user stays; one with no SQL row
        stays while its create may be between its Redis and SQL steps, and goes once that
        create is certainly over (see the module docstring)."""
        owners = self.reads.open_owners([order_id for _, order_id in extras], now_ms)
        remove = [(u, o) for u, o in extras if o in owners and owners[o] != u]
        report.removed_terminal += len(remove)
        rowless = [(u, o) for u, o in extras if o not in owners]
        starts = self.index.admission_starts(rowless)
        over = now_ms - self.index.window_ms
        abandoned = [member for member in rowless if starts.get(member, over) <= over]
        suspects = [m for m in rowless if over < starts.get(m, over) <= now_ms - SUSPECT_AFTER_MS]
        fates = suspects and self.in_flight.fates([order_id for _, order_id in suspects])
        if fates:
            abandoned += [member for member in suspects if member[1] in fates.dead]
        report.removed_abandoned += len(abandoned)
        report.kept_in_flight += len(rowless) - len(abandoned)
        if not dry_run:
            self.index.remove_members(remove + abandoned)

    def _undo_stale_adds(self, added: list[tuple[str, str]], now_ms: int) -> None:
        """Remove what we just added if its order stopped being open meanwhile.

        A payment commits, then removes its member; if our add landed after that removal,
        it would linger until expiry. Reading SQL after the add closes the gap: whichever
        order the two happen in, one of the removals comes last. One read of the users'
        range (``added`` is in SQL's user order) covers the whole page.
        """
        still_open = self.reads.open_in_range(added[0][0], added[-1][0], now_ms)
        self.index.remove_members([(u, o) for u, o in added if o not in still_open])


class _Progress:
    """Reports a run's progress: ``on_progress`` after each step and, for a full run, a log
    line at most every :data:`PROGRESS_LOG_INTERVAL_S` seconds and one at the end."""

    def __init__(self, on_progress: Callable[[int], None] | None, *, logged: bool) -> None:
        self.on_progress = on_progress
        self.logged = logged
        self.started = self.last_line = time.monotonic()

    def step(self, users: int) -> None:
        if self.on_progress is not None:
            self.on_progress(users)
        now = time.monotonic()
        if self.logged and now - self.last_line >= PROGRESS_LOG_INTERVAL_S:
            self.last_line = now
            log.info("reconcile: %d users so far, %.0f users/s", users, self._rate(users, now))

    def done(self, report: ReconcileReport) -> None:
        if not self.logged:
            return
        now = time.monotonic()
        log.info(
            "reconcile done%s: %d users in %.1f s (%.0f users/s); %d fixes",
            " (dry run)" if report.dry_run else "",
            report.users,
            now - self.started,
            self._rate(report.users, now),
            report.fixes,
        )

    def _rate(self, users: int, now: float) -> float:
        return users / max(now - self.started, 1e-9)
