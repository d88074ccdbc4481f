"""The incident pause: hold every close by expiry, then give the shoppers the time back.

``pause`` opens a pause in SQL (:mod:`orders.sql.pauses`); from then on, the statements that
close or remind by expiry find nothing, on every host, while creates, payments and cancels
go on. ``resume`` moves each unpaid order's expiry later by the part of the pause it lived
through, in batches that each commit with their ``extended`` events and the pause's cursor,
then gives the moved orders their members at the new scores, added where an admission
dropped them while paused (their score had passed), and taken again from those no longer
unpaid when read after that write; then closes the pause. A resume cut short (a crash,
Redis down) is finished by running it again: no order moves twice, and a member left out
is restored by the next reconcile (until then the SQL guard counts the order).
"""

from __future__ import annotations

import logging

from orders import metrics
from orders.domain import Actor, Clock
from orders.errors import InvalidInput, StoreUnavailable
from orders.rules.followups import Followups
from orders.sql.pauses import Pause, Pauses
from orders.validation import TEXT_MAX_LENGTH, check_count, check_optional_text

log = logging.getLogger("orders.pausing")

DEFAULT_RESUME_BATCH = 500


class Pausing:
    """Pause and resume over the service's stores (composed by :class:`OrderService`)."""

    def __init__(self, pauses: Pauses, followups: Followups, clock: Clock) -> None:
        self.pauses = pauses
        self.followups = followups
        self.clock = clock

    def pause(self, reason: object, actor: Actor) -> Pause:
        """Open a pause (:class:`~orders.errors.InvalidInput` while one is open)."""
        text = check_optional_text("reason", reason, TEXT_MAX_LENGTH)
        if not text or not text.strip():
            raise InvalidInput("reason", "must say why (it is shown to every operator)")
        pause = self.pauses.start(text, self.clock, actor)
        log.warning("orders paused: nothing closes by expiry", extra={"reason": text})
        return pause

    def resume(self, actor: Actor, batch_size: int = DEFAULT_RESUME_BATCH) -> Pause:
        """Move the unpaid orders' expiries by the pause and close it (module docstring);
        :class:`~orders.errors.InvalidInput` when nothing is paused."""
        size = check_count("batch_size", batch_size, 1, 10_000)
        pause = self.pauses.begin_resume(self.clock(), actor)
        while True:
            now_ms = self.clock()
            moved = self.pauses.shift_batch(pause, now_ms, size, actor)
            if moved is None:
                break
            metrics.EXTENSIONS.labels("resume").inc(len(moved))
            wanted: dict[str, dict[str, int]] = {}
            for order_id, user_id, expires_at_ms in moved:
                wanted.setdefault(user_id, {})[order_id] = expires_at_ms
            try:
                self.followups.rescore(wanted, now_ms)
                left = self.pauses.no_longer_unpaid([order_id for order_id, _, _ in moved])
                self.followups.index.remove_members(left)
            except StoreUnavailable:
                log.warning("the index restore after a resume batch failed; reconcile will fix it")
        done = self.pauses.finish(pause, self.clock())
        log.warning(
            "orders resumed",
            extra={"pause_id": done.id, "shifted": done.shifted, "paused_ms": done.length_ms(0)},
        )
        return done

    def current(self) -> Pause | None:
        return self.pauses.current()
