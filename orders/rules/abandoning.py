"""Abandons: undoing an admission whose outcome is unknown.

When the admission's Redis step fails without an answer (a timeout, a broken connection, an
interrupt), the script may have run, or may still be queued in a stalled server. The
admission then abandons the attempt (:meth:`Abandoner.abandon`): ``abandon.lua`` is sent
after the process's next admission that Redis answers (at once after an interrupt), which
removes the member if that attempt added it and otherwise makes a late run of the attempt
add nothing.

What none of this reaches (the abandon waits in a process that makes no more admissions, or
the process died inside its host's transaction) is found by any process's refusal: the
admission script names the members whose create started ``SUSPECT_AFTER_MS`` ago or more,
and :meth:`Abandoner.clear_dead` asks SQL about those few (:mod:`orders.sql.inflight`).
Reconcile asks the same, and removes the rest once the admission window has passed.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence

from orders.errors import OrdersError, StoreUnavailable
from orders.index.unpaid import UnpaidIndex
from orders.sql.records import OrderRecords

log = logging.getLogger("orders.admission")  # the logger it had inside the admission

#: Abandons kept for Redis to take later (about 100 bytes each); past it the oldest is
#: dropped, and its member, if any, left to reconcile.
UNSENT_ABANDONS_MAX = 10_000


class Abandoner:
    """Abandons admissions of unknown outcome, now or after Redis answers again (see the
    module docstring)."""

    def __init__(self, index: UnpaidIndex, records: OrderRecords) -> None:
        self.index = index
        self.records = records
        #: Abandons Redis did not take (user id, order id, attempt's start): sent after
        #: the next admission Redis answers. Bounded: past it, reconcile.
        self.unsent: deque[tuple[str, str, int]] = deque(maxlen=UNSENT_ABANDONS_MAX)
        self._unsent_lock = threading.Lock()

    def abandon(
        self, user_id: str, order_id: str, started_ms: int, *, send_now: bool = True
    ) -> None:
        """Undo the admission a create started at ``started_ms`` may have sent, when its
        outcome is unknown; a stalled server that runs it later then adds nothing.

        A concurrent twin's order (the id open for this user in SQL) keeps its member.
        Unless ``send_now``, and whenever Redis does not take it (still stalled: a new
        connection cannot even say hello), it is sent after this process's next admission
        that Redis answers.
        A member that stays anyway names its create's start, so reconcile removes it once
        the create is certainly over.
        """
        try:
            existing = self.records.find(order_id, started_ms)
        except OrdersError:
            existing = None
        if existing is not None and existing.user_id == user_id and existing.is_open:
            return
        with self._unsent_lock:
            self.unsent.append((user_id, order_id, started_ms))
        if send_now:
            self.send()

    def send(self, freeing: str | None = None) -> bool:
        """Send the abandons Redis has not taken yet, oldest first, until one fails; True
        if one removed a member of user ``freeing``."""
        freed = False
        while True:
            with self._unsent_lock:
                if not self.unsent:
                    return freed
                user_id, order_id, started_ms = self.unsent.popleft()
            try:
                removed = self.index.abandon(user_id, order_id, started_ms=started_ms)
            except StoreUnavailable:
                with self._unsent_lock:
                    self.unsent.appendleft((user_id, order_id, started_ms))
                log.warning(
                    "redis abandon failed; sent again after the next admission",
                    extra={"order_id": order_id, "user_id": user_id},
                )
                return freed
            freed = freed or (removed and user_id == freeing)

    def clear_dead(self, user_id: str, suspects: Sequence[tuple[str, int]]) -> bool:
        """A refusal's suspects, (order id, start ms): those SQL has a row of are confirmed
        (no refusal names them again); those whose create is over without one are abandoned
        by their start, so a member a later attempt admitted again stays. True if a member
        went. A store that fails leaves the refusal as it was."""
        try:
            fates = self.records.in_flight.fates([order_id for order_id, _ in suspects])
            if fates is None:
                return False
            if fates.committed:
                self.index.confirm([(user_id, order_id) for order_id in fates.committed])
            removed = [
                self.index.abandon(user_id, order_id, started_ms=started_ms)
                for order_id, started_ms in suspects
                if order_id in fates.dead
            ]
        except OrdersError as exc:
            log.warning("could not check the refusal's old admissions: %s", exc)
            return False
        if any(removed):
            log.info("removed members of creates that died", extra={"user_id": user_id})
        return any(removed)
