"""The incident pause: hold every close by expiry, then give the shoppers the time back.

``pause`` opens a pause in SQL (:mod:`orders.sql.pauses`); from then on, the statements that
close or remind by expiry find nothing, on every host, while creates, payments and cancels
go on. ``resume`` moves each unpaid order's expiry later by the part of the pause it lived
through, in batches that each commit with their ``extended`` events and the pause's cursor,
then rescores the members still in Redis, batch by batch (never adding one back: an order
paid meanwhile has lost its member), and closes the pause. A resume
cut short (a crash, Redis down) is finished by running it again: no order moves twice, and
a member left with its old score is rescored by the next reconcile (until then the SQL
guard still counts the order, so the limit holds).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from orders import metrics
from orders.domain import Actor, Clock
from orders.errors import InvalidInput, StoreUnavailable
from orders.sql.pauses import Pause, Pauses
from orders.validation import TEXT_MAX_LENGTH, check_count, check_optional_text

log = logging.getLogger("orders.pausing")

#: Moves the members of the orders given (user -> order -> new expiry) to their new scores,
#: where they are still members (a member removed by a payment meanwhile stays removed).
Rescore = Callable[[Mapping[str, Mapping[str, int]]], None]
DEFAULT_RESUME_BATCH = 500


class Pausing:
    """Pause and resume over the service's stores (composed by :class:`OrderService`)."""

    def __init__(self, pauses: Pauses, rescore: Rescore, clock: Clock) -> None:
        self.pauses = pauses
        self.rescore = rescore
        self.clock = clock

    def pause(self, reason: object, actor: Actor) -> Pause:
        """Open a pause (:class:`~orders.errors.InvalidInput` while one is open)."""
        text = check_optional_text("reason", reason, TEXT_MAX_LENGTH)
        if not text or not text.strip():
            raise InvalidInput("reason", "must say why (it is shown to every operator)")
        pause = self.pauses.start(text, self.clock(), actor)
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
                self.rescore(wanted)
            except StoreUnavailable:
                log.warning("redis rescore after a resume batch failed; reconcile will fix it")
        done = self.pauses.finish(pause, self.clock())
        log.warning(
            "orders resumed",
            extra={"pause_id": done.id, "shifted": done.shifted, "paused_ms": done.length_ms(0)},
        )
        return done

    def current(self) -> Pause | None:
        return self.pauses.current()
