"""Bulk actions: cancel or extend every unpaid order a filter matches, for operators.

A bulk action is many single-order transitions, never one wide UPDATE:

1. the input is checked first, and a filter that names nothing is refused
   (:class:`~orders.errors.InvalidInput`): a bulk action never means "every order";
2. the matching unpaid orders are read a page of ``batch_size`` at a time along the
   partial indexes, by keyset (:mod:`orders.sql.matching`);
3. each order then goes through the same compare-and-set as ``cancel_order`` or
   ``extend_order``, in a transaction of its own, with Redis following after its commit.
   A payment (or a close, or another cancel) that commits first wins: the compare-and-set
   loses and the order is counted as skipped, never changed. An extension keeps to the
   order's policy's maximum lifetime; one past it, of a policy that does not expire, or of
   an order whose time is already up, is counted as refused.

The clock is read once per page: the page's transitions share that ``now_ms``. A dry run
reads the same pages and writes nothing. A filter that matches nothing is a no-op.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from orders import metrics
from orders.config import Settings
from orders.domain import Actor, Order, OrderStatus
from orders.errors import InvalidInput, OrderNotFound
from orders.policies import check_deadline
from orders.rules.transition import Transitioner, extend_attempt
from orders.sql.matching import Keyset, OrderFilter, keyset_of, matching_page
from orders.validation import check_count, check_user_id

#: Orders read and changed per page unless the caller says otherwise, and the bounds.
DEFAULT_BATCH_SIZE = 500
MAX_BATCH_SIZE = 10_000
#: A metadata filter compares at most this many keys, each of a bounded length.
MAX_METADATA_KEYS = 16
METADATA_TEXT_MAX_LENGTH = 200


@dataclass
class BulkReport:
    """What a bulk action did (or, in a dry run, found).

    ``matched``: unpaid orders the filter found; ``changed``: cancelled or extended (0 in
    a dry run); ``skipped``: paid, closed or cancelled by someone else first; ``refused``:
    extensions the order's terms did not allow (past the maximum lifetime, a policy that
    does not expire, the time already up).
    """

    action: str
    dry_run: bool
    matched: int = 0
    changed: int = 0
    skipped: int = 0
    refused: int = 0
    batches: int = 0


#: Called after each page with the page's orders as they were read and the totals so far.
OnBatch = Callable[[Sequence[Order], BulkReport], None]
#: One order's transition at ``now_ms``: the order after it, and whether it won.
Change = Callable[[Order, int], tuple[Order, bool]]


@dataclass(frozen=True, slots=True)
class BulkRun:
    """What every bulk action is given, checked: the filter, who acts, whether it is a dry
    run, the page size, and what to call after each page."""

    wanted: OrderFilter
    actor: Actor
    dry_run: bool = False
    batch_size: int = DEFAULT_BATCH_SIZE
    on_batch: OnBatch | None = None


def checked_filter(
    settings: Settings,
    *,
    user_id: str | int | None = None,
    created_before: datetime | None = None,
    expiring_before: datetime | None = None,
    metadata: Mapping[str, str] | None = None,
) -> OrderFilter:
    """The filter as the SQL reads it, checked; InvalidInput when it names nothing."""
    wanted = OrderFilter(
        user_id=None if user_id is None else check_user_id(user_id, settings.max_user_id_length),
        created_before_ms=(
            None if created_before is None else check_deadline(created_before, "created_before")
        ),
        expiring_before_ms=(
            None if expiring_before is None else check_deadline(expiring_before, "expiring_before")
        ),
        metadata=check_metadata_filter(metadata or {}),
    )
    if wanted.empty:
        raise InvalidInput(
            "filter",
            "is empty: give user_id, created_before, expiring_before or metadata "
            "(a bulk action never applies to every order)",
        )
    return wanted


def check_metadata_filter(value: object) -> dict[str, str]:
    """``metadata``: a mapping of text keys to the text values they must equal."""
    if not isinstance(value, Mapping):
        raise InvalidInput("metadata", "must map keys to values")
    if len(value) > MAX_METADATA_KEYS:
        raise InvalidInput("metadata", f"must have at most {MAX_METADATA_KEYS} keys")
    for key, text in value.items():
        for part in (key, text):
            if not isinstance(part, str) or not 0 < len(part) <= METADATA_TEXT_MAX_LENGTH:
                raise InvalidInput(
                    "metadata",
                    f"keys and values must be text of 1-{METADATA_TEXT_MAX_LENGTH} characters",
                )
    return dict(value)


def parse_metadata_pairs(pairs: Sequence[str]) -> dict[str, str]:
    """``key=value`` texts (the CLI's ``--metadata``) as a metadata filter."""
    parsed: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip() or not value:
            raise InvalidInput("metadata", f"must be key=value, got {pair[:70]!r}")
        parsed[key.strip()] = value
    return check_metadata_filter(parsed)


def check_batch_size(value: object) -> int:
    return check_count("batch_size", value, 1, MAX_BATCH_SIZE)


class BulkActions:
    """Cancels or extends the orders a filter matches, one compare-and-set each."""

    def __init__(
        self, transitions: Transitioner, settings: Settings, now_ms: Callable[[], int]
    ) -> None:
        self.records = transitions.records
        self.transitions = transitions
        self.settings = settings
        self.now_ms = now_ms

    def cancel(self, run: BulkRun, reason: str | None) -> BulkReport:
        """Cancel every unpaid order ``run.wanted`` matches (module docstring)."""

        def one(order: Order, now_ms: int) -> tuple[Order, bool]:
            return self.transitions.run(
                order.id,
                now_ms,
                lambda conn: self.records.cancel(conn, order.id, now_ms, reason, run.actor),
            )

        report = self.walk(run, "cancel", one)
        metrics.CANCELS.inc(report.changed)
        return report

    def extend(self, run: BulkRun, extra_ms: int) -> BulkReport:
        """Move the expiry of every open order ``run.wanted`` matches ``extra_ms`` later,
        each within its policy's maximum lifetime (module docstring)."""

        def one(order: Order, now_ms: int) -> tuple[Order, bool]:
            attempt = extend_attempt(
                self.records, self.settings, order.id, now_ms, extra_ms, run.actor
            )
            moved = self.transitions.admitter.followups.move_after_commit
            return self.transitions.run(order.id, now_ms, attempt, redis_after=moved)

        report = self.walk(run, "extend", one)
        if report.changed:
            metrics.EXTENSIONS.labels("bulk").inc(report.changed)
        return report

    def walk(self, run: BulkRun, action: str, change: Change) -> BulkReport:
        """Read the pages and run ``change`` on each order (not in a dry run)."""
        report = BulkReport(action, run.dry_run)
        after: Keyset = None
        while True:
            now_ms = self.now_ms()
            page = matching_page(self.records.tx, run.wanted, after, run.batch_size, now_ms)
            if not page:
                return report
            report.matched += len(page)
            report.batches += 1
            if not run.dry_run:
                for order in page:
                    tally(report, order, change, now_ms)
            if run.on_batch is not None:
                run.on_batch(page, report)
            if len(page) < run.batch_size:
                return report
            after = keyset_of(page[-1])


def tally(report: BulkReport, order: Order, change: Change, now_ms: int) -> None:
    """Run one order's transition and count what became of it."""
    try:
        after, won = change(order, now_ms)
    except OrderNotFound:  # deleted since the page was read
        report.skipped += 1
        return
    if won:
        report.changed += 1
    elif after.status is not OrderStatus.UNPAID:
        report.skipped += 1
    else:
        report.refused += 1
