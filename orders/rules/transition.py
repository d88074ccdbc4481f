"""The shape every transition of one order shares: its compare-and-set, then Redis.

The compare-and-set (and its event) runs in one SQL transaction, ours or the host's; if
it won, the Redis follow-up runs after the commit: by default the order's member leaves
the index. In the host's transaction the follow-up waits for the host's commit (and does
not run if the host rolls back). A call cut off half-way (a cancelled task, an interrupt)
may have committed, so Redis is made to follow the row as it stands.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from sqlalchemy import Connection, Row

from orders.config import Settings
from orders.domain import Actor, Order
from orders.rules.admission import Admitter, interrupted
from orders.sql.host import follow
from orders.sql.records import OrderRecords

#: One transition's SQL: the compare-and-sets to try in the transaction; the row after
#: the one that won, or None.
Attempt = Callable[[Connection], Row[Any] | None]


class Transitioner:
    """Runs one order's transitions over the records and the admission index."""

    def __init__(self, records: OrderRecords, admitter: Admitter) -> None:
        self.records = records
        self.admitter = admitter

    def run(
        self,
        order_id: str,
        now_ms: int,
        attempt: Attempt,
        *,
        redis_after: Callable[[Order], None] | None = None,
        host: Connection | None = None,
    ) -> tuple[Order, bool]:
        """The order after ``attempt`` and whether it won (when it lost: the order as it
        stands, for the caller to say what the loss means). Raises OrderNotFound."""
        try:
            order, won = self.records.transition_or_current(order_id, now_ms, attempt, host)
            if won:
                self.after_commit(order, host, redis_after or self.admitter.followups.release_of)
        except BaseException as stop:
            if interrupted(stop):  # it may have committed: Redis must follow the row
                self.admitter.followups.settle(order_id, now_ms)
            raise
        return order, won

    @staticmethod
    def after_commit(order: Order, host: Connection | None, step: Callable[[Order], None]) -> None:
        """Run ``step(order)`` now (our transaction committed) or at the host's commit."""
        if host is None:
            step(order)
        else:
            follow(host, on_commit=functools.partial(step, order))


def extend_attempt(
    records: OrderRecords,
    settings: Settings,
    order_id: str,
    now_ms: int,
    extra_ms: int,
    actor: Actor,
) -> Attempt:
    """The compare-and-set of one extension (``extend_order``'s and the bulk extend's),
    within the maximum lifetime of the order's policy; it loses for a policy that does not
    expire."""

    def attempt(conn: Connection) -> Row[Any] | None:
        # The order's policy never changes: reading it first cannot race.
        found = records.current(conn, order_id, now_ms)
        terms = settings.order_terms(None if found is None else found.policy)
        if not terms.expires:
            return None
        return records.extend_open(conn, order_id, now_ms, extra_ms, terms.max_lifetime_ms, actor)

    return attempt
