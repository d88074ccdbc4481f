"""A create's way through the rules, once checked: combined with concurrent ones where
``Settings.combine_creates`` is on, or admitted alone; each outcome counted in
``orders_creates_total``. Replacing the oldest order is a step of it, taken only under
``on_limit="replace_oldest"`` and only once the create is refused at the limit.

With ``on_limit="replace_oldest"`` a create refused at the limit (by Redis or by the SQL
slot guard) makes room once, and is then admitted again through the same path as any
create, so the limit stays exact: the slot guard still decides who gets the freed slot.

Making room never cancels a paid order, nor one the host says is being paid:

1. the victim is the user's oldest open unpaid order (by ``created_at_ms``, then id);
2. the pre-close check, if set, is asked about it first: an answer other than None (a
   payment in flight), a raise or a timeout keeps the order and the create is refused;
3. it is cancelled by the same compare-and-set as ``cancel_order`` (reason ``replaced``,
   its event naming the new order and the create's actor); a payment or cancel that
   committed first makes the compare-and-set lose, and the create is refused.

A second admission that is refused (a concurrent create took the freed slot) is the
create's refusal: the cancelled order stays cancelled (its event then names an order that
never came to exist) and no second order is cancelled, so one create cancels at most one
order. Trying again could chase concurrent creates without end; the caller may retry.

A create in the host's transaction (``connection=``) is refused at the limit as with
``"refuse"``: the cancel's Redis release would wait for the host's commit, so the second
admission could not find the room.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import Connection

from orders import metrics
from orders.domain import REPLACED_REASON, NewOrder, Order
from orders.errors import CreateRateLimited, HoldRefused, OrderConflict, UnpaidOrderLimitReached
from orders.rules.combining import CreateCombiner
from orders.rules.sweep import Sweep
from orders.rules.transition import Transitioner
from orders.validation import ON_LIMIT_REPLACE_OLDEST

log = logging.getLogger(__name__)


class Creating:
    """Runs a checked create (module docstring)."""

    def __init__(
        self, transitions: Transitioner, sweep: Sweep, combiner: CreateCombiner | None
    ) -> None:
        self.admitter = transitions.admitter
        self.records = transitions.records
        self.transitions = transitions
        self.sweep = sweep
        self.combiner = combiner
        self._counts: dict[str, Any] = {}

    def create(self, new: NewOrder, on_limit: str, host: Connection | None) -> tuple[Order, bool]:
        """The order, and whether this call created it (False: a retry found it)."""
        try:
            order, created = self._create(new, on_limit, host)
        except UnpaidOrderLimitReached as refused:
            self.count(f"refused_{refused.source}")
            raise
        except CreateRateLimited:
            self.count("refused_rate")
            raise
        except HoldRefused as refused:
            metrics.HOLDS.labels(f"refused_{refused.reason}").inc()
            raise
        except OrderConflict:
            self.count("conflict")
            raise
        self.count("admitted" if created else "retry")
        if created and new.holds:
            metrics.HOLDS.labels("taken").inc(len(new.holds))
        return order, created

    def count(self, result: str) -> None:
        """One create more in ``orders_creates_total`` under ``result`` (each label's child
        looked up once: a refusal is cheap, and so is counting it)."""
        child = self._counts.get(result)
        if child is None:
            child = self._counts[result] = metrics.CREATES.labels(result)
        child.inc()

    def _create(self, new: NewOrder, on_limit: str, host: Connection | None) -> tuple[Order, bool]:
        if on_limit != ON_LIMIT_REPLACE_OLDEST:
            combiner = None if new.holds else self.combiner  # holds: a transaction each
            return (combiner or self.admitter).create(new, host)
        try:
            return self.admitter.create(new, host)
        except UnpaidOrderLimitReached as refused:
            if host is not None:  # the cancel's release would wait for the host's commit
                raise
            self.make_room(refused, new)
        return self.admitter.create(new)

    def oldest(self, user_id: str, now_ms: int) -> Order | None:
        """The user's oldest open unpaid order, or None."""
        held = self.records.list_open(user_id, now_ms)
        return min(held, key=lambda o: (o.created_at_ms, o.id), default=None)

    def make_room(self, refused: UnpaidOrderLimitReached, new: NewOrder) -> Order:
        """Cancel the oldest open order of ``new``'s user for it; returns it cancelled.
        Raises ``refused`` when no order may be cancelled."""
        now_ms = new.created_at_ms
        victim = self.oldest(new.user_id, now_ms)
        if victim is None or self.payment_in_flight(victim):
            raise refused
        cancelled, won = self.transitions.run(
            victim.id,
            now_ms,
            lambda conn: self.records.cancel(
                conn, victim.id, now_ms, REPLACED_REASON, new.actor, replaced_by=new.id
            ),
        )
        if not won:  # paid or cancelled first
            raise refused
        metrics.REPLACED.inc()
        return cancelled

    def payment_in_flight(self, order: Order) -> bool:
        """The pre-close check's answer about ``order``: True keeps it (the check asked for
        time, raised, or timed out)."""
        check = self.sweep.pre_close
        if check is None:
            return False
        (answer,) = self.sweep.hooks.ask(check, [order], self.sweep.settings.pre_close_timeout_s)
        if answer.failed:
            log.warning(
                "pre-close check failed or timed out; the oldest order is kept",
                extra={"order_id": order.id, "user_id": order.user_id},
            )
        return answer.failed or answer.value is not None
