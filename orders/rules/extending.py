"""extend_order: more time for an open unpaid order, within its policy's maximum lifetime.

A compare-and-set against the sweep (:data:`orders.sql.transitions.EXTEND_OPEN`): an order
closed, paid or cancelled first cannot be extended, nor can one whose time is already up
(its slot may have been reused). The cap is the order's own: ``created_at`` plus the
maximum lifetime of the policy it was created under (the default policy's
without one); an order whose policy does not expire has nothing to extend. The policy is
read in the same transaction, before the compare-and-set: it never changes on an order, so
the read cannot race. Redis follows the commit (the member's new score).
"""

from __future__ import annotations

from orders import metrics
from orders.config import Settings
from orders.domain import Actor, Order, OrderStatus, refusal
from orders.errors import InvalidInput, OrderExpired
from orders.policies import NEVER_EXPIRES_MS
from orders.rules.transition import Transitioner, extend_attempt
from orders.validation import check_order_id, check_ttl_ms


class Extender:
    """Extends orders over the transitions of one service (its records and admission)."""

    def __init__(self, transitions: Transitioner, settings: Settings) -> None:
        self.records = transitions.records
        self.transitions = transitions
        self.settings = settings

    def extend(self, order_id: object, extra_s: object, actor: Actor, now_ms: int) -> Order:
        """The order with its new expiry, or the typed refusal (module docstring)."""
        oid = check_order_id(order_id, self.settings.max_order_id_length)
        extra_ms = check_ttl_ms(extra_s, self.settings.default_policy.longest_ttl_s)

        attempt = extend_attempt(self.records, self.settings, oid, now_ms, extra_ms, actor)
        order, won = self.transitions.run(
            oid, now_ms, attempt, redis_after=self.transitions.admitter.followups.move_after_commit
        )
        if won:
            metrics.EXTENSIONS.labels("api").inc()
            return order
        if order.status is not OrderStatus.UNPAID:
            raise refusal(order)
        if order.expires_at_ms == NEVER_EXPIRES_MS:
            raise InvalidInput("order_id", "has a policy that does not expire: nothing to extend")
        if order.expires_at_ms <= now_ms:
            raise OrderExpired(oid)
        raise InvalidInput("extra_s", "would move the expiry past the maximum lifetime")
