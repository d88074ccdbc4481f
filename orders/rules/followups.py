"""The Redis writes that follow a SQL decision: the index made to agree with a commit.

SQL decides first (a payment, a cancel, an extension, a failed create); then the order's
member is removed or moved. These writes never undo the decision: when Redis cannot be
reached the member expires by its score, or the next reconcile fixes it, and the failure is
only logged. A member is never added back for an order that is no longer open: a move goes
through ``ZADD XX`` (only a member still there moves).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from orders.domain import Order, OrderStatus
from orders.errors import OrdersError, StoreUnavailable
from orders.index.unpaid import UnpaidIndex
from orders.rules.holding import Holding
from orders.sql.records import OrderRecords

log = logging.getLogger(__name__)


class Followups:
    """The index's side of a decision SQL has committed (see the module docstring)."""

    def __init__(
        self, index: UnpaidIndex, records: OrderRecords, holding: Holding | None = None
    ) -> None:
        self.index = index
        self.records = records
        #: The resources' index, where the service keeps one (:mod:`orders.rules.holding`).
        self.holding = holding
        #: Told the resources whose units a cancel or close released, once Redis followed
        #: (the waiting lists' serve: :mod:`orders.rules.waiting`); None: nobody is told.
        self.freed: Callable[[list[str]], object] | None = None

    def settle(self, order_id: str, now_ms: int, *, user_id: str | None = None) -> None:
        """Make the order's member agree with its row, after a call that was cut off half-way
        (a cancelled task, an interrupt): SQL may or may not have committed, Redis may or
        may not have run. An open order gets its member at its expiry; any other (or none
        at all) loses it. Best effort: what fails here, reconcile repairs.
        """
        try:
            order = self.records.find(order_id, now_ms)
            if order is not None and order.is_open:
                self.rescore_after_commit(order)
            elif order is not None:
                self.release_of(order)
            elif user_id is not None:
                self.release_after_commit(user_id, order_id)
        except OrdersError:
            log.warning("settling an interrupted call failed; reconcile will fix it")

    def release_after_commit(
        self, user_id: str, order_id: str, *, forget_admission: bool = False
    ) -> None:
        """Remove a member after SQL decided; a Redis failure only delays the cleanup.
        ``forget_admission``: the create failed (see :meth:`UnpaidIndex.release`)."""
        try:
            self.index.release(user_id, order_id, forget_admission=forget_admission)
        except StoreUnavailable:
            log.warning(
                "redis release failed; the member expires by its score or at reconcile",
                extra={"order_id": order_id, "user_id": user_id},
            )

    def release_of(self, order: Order) -> None:
        """:meth:`release_after_commit` of a transition's order (paid, cancelled), and its
        holds sold or released."""
        self.release_after_commit(order.user_id, order.id)
        if self.holding is not None:
            self.holding.after_transition(order)
        released = order.status in (OrderStatus.CANCELLED, OrderStatus.CLOSED)
        if self.freed is not None and order.holds and released:
            self.freed(sorted(order.holds))

    def rescore(self, wanted: Mapping[str, Mapping[str, int]], now_ms: int) -> None:
        """Move the members given (user -> order -> expiry) to those scores, in one round
        trip per node; a user's other members are left as they are (reconcile's extras)."""
        batch = {user: dict(members) for user, members in wanted.items()}
        self.index.reconcile_batch(batch, now_ms=now_ms, dry_run=False).read()

    def move_after_commit(self, order: Order) -> None:
        """Move the member of an order whose expiry SQL moved (an extension) to its new
        score, only if it is still a member (``ZADD XX``): a payment or cancel that commits
        between the extension's commit and this call has removed the member, and it must not
        come back to hold a slot for a paid order. A member Redis had lost stays missing:
        the SQL slot guard counts the order meanwhile, and reconcile restores it."""
        wanted = {order.user_id: {order.id: order.expires_at_ms}}
        self.follow_commit(order, lambda: self.index.rescore_present(wanted))
        if self.holding is not None:
            self.holding.moved(order)

    def rescore_after_commit(self, order: Order) -> None:
        """Give an open order its member at its expiry after SQL decided (added if missing)."""
        wanted = {order.user_id: {order.id: order.expires_at_ms}}
        self.follow_commit(order, lambda: self.rescore(wanted, order.read_at_ms))

    @staticmethod
    def follow_commit(order: Order, write: Callable[[], None]) -> None:
        """Run a Redis write that follows a commit; its failure only delays the repair."""
        try:
            write()
        except StoreUnavailable:
            log.warning(
                "redis rescore failed; reconcile will fix it",
                extra={"order_id": order.id, "user_id": order.user_id},
            )
