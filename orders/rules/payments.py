"""mark_paid: who wins between a payment and an expiry, and what happens to the loser's money.

A payment is first a compare-and-set, unpaid -> paid (under ``strict_expiry``: only while
the expiry is ahead; an expired order is closed instead). When it loses, the order as it
stands decides (:func:`decide`):

* paid with the same reference (or the payment gives none): a retry, the order is returned;
* closed by expiry within the late window of its policy (the default policy's without
  one) of its expiry: a *late payment*. The
  host's late-payment check is asked (the stock may be gone), under the rules of
  :mod:`orders.hooks`: a check that refuses, raises or runs out of time refuses the
  payment. Accepted, a second compare-and-set turns the order closed -> paid, its event
  marked ``late``; it holds no slot then, so no user's limit is at stake;
* anything else is a refusal: in one transaction that holds the order's lock, the
  decision is made again on the locked row and, if it stands, a ``payment_refused``
  event and its ``oes_payment_refusals`` row (:mod:`orders.sql.refusals`) are written.
  Only then does the caller get its error, carrying the event's position.

A payment that states an amount is compared with the order's first (amounts never change,
so the read needs no lock): a mismatch never pays the order and is refused the same way.

A payment for an order SQL does not hold (retention pruned it, or it never existed) raises
OrderNotFound, once its refusal (``unknown_order``, no user, no event) is recorded in a
transaction of its own (the host's, given one): the money was taken all the same.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from enum import Enum

from sqlalchemy import Connection

from orders import metrics
from orders.config import Settings
from orders.domain import Actor, Order, OrderStatus, Payment, RefusalReason
from orders.errors import (
    HoldRefused,
    OrderAlreadyPaid,
    OrderClosed,
    OrderNotFound,
    OrdersError,
    PaymentMismatch,
)
from orders.hooks import HookRunner
from orders.rules.transition import Transitioner
from orders.sql.holds import check_retake
from orders.sql.records import EXPIRED_REASON, to_order
from orders.sql.refusals import record_refusal, record_unknown_order
from orders.sql.transitions import Changed

log = logging.getLogger("orders.service")

#: ``check(order, payment)``: True accepts a late payment for the closed ``order``.
LatePaymentCheck = Callable[[Order, Payment], bool]


class Decision(Enum):
    PAY = "pay"
    REPEAT = "repeat"
    LATE = "late"
    REFUSE = "refuse"


def decide(
    order: Order, payment: Payment, now_ms: int, *, window_ms: int, strict: bool
) -> tuple[Decision, RefusalReason | None]:
    """What ``payment`` does to ``order`` as it stands at ``now_ms``: the one rule."""
    if order.status is OrderStatus.PAID:
        if payment.ref is None or payment.ref == order.payment_ref:
            return Decision.REPEAT, None
        return Decision.REFUSE, RefusalReason.ALREADY_PAID
    if order.status is OrderStatus.CANCELLED:
        return Decision.REFUSE, RefusalReason.CANCELLED
    # Closed by expiry, or (strict_expiry) unpaid past its expiry: too late, unless late
    # payments are accepted and this one is within the window.
    too_late = order.status is OrderStatus.CLOSED or (strict and order.expires_at_ms <= now_ms)
    if too_late:
        by_expiry = order.status is OrderStatus.UNPAID or order.close_reason == EXPIRED_REASON
        if not (by_expiry and window_ms > 0 and now_ms <= order.expires_at_ms + window_ms):
            return Decision.REFUSE, RefusalReason.CLOSED
    mismatch = payment.mismatch(order)
    if mismatch is not None:
        return Decision.REFUSE, mismatch
    return (Decision.LATE, None) if too_late else (Decision.PAY, None)


class Payments:
    """The payment use case over the transitions of one service."""

    def __init__(self, transitioner: Transitioner, settings: Settings) -> None:
        self.transitioner = transitioner
        self.records = transitioner.records
        self.settings = settings
        self.late_check: LatePaymentCheck | None = None
        self.hooks = HookRunner("orders-late-payment")

    def close(self) -> None:
        self.hooks.close()

    def pay(
        self, order_id: str, payment: Payment, actor: Actor, now_ms: int, host: Connection | None
    ) -> Order:
        """Mark the order paid, or raise the refusal once it is recorded (module docstring)."""
        try:
            return self._pay(order_id, payment, actor, now_ms, host)
        except OrderNotFound:
            with self.records.tx.write(host) as conn:
                record_unknown_order(conn, order_id, payment, now_ms)
                self.records.tx.commit(conn, host)
            raise

    def _pay(
        self, order_id: str, payment: Payment, actor: Actor, now_ms: int, host: Connection | None
    ) -> Order:
        strict = self.settings.strict_expiry

        def attempt(conn: Connection) -> Changed | None:
            if payment.amount is not None:
                current = self.records.current(conn, order_id, now_ms)
                if current is not None and payment.mismatch(current) is not None:
                    return None  # refused below, under the order's lock
            row = self.records.pay(conn, order_id, now_ms, payment, actor, strict=strict)
            if row is None and strict:
                # Expired before the payment: closed now; a late payment may yet reopen it.
                row = self._close_for(conn, order_id, payment, actor, now_ms)
            return row

        order, won = self.transitioner.run(order_id, now_ms, attempt, host=host)
        if won and order.status is OrderStatus.PAID:
            late = order.expires_at_ms <= now_ms
            _count_paid(order, "late_before_close" if late else "on_time")
            return order
        decision, _ = self._decide(order, payment, now_ms)
        if decision is Decision.REPEAT:
            metrics.PAYMENTS.labels("repeat").inc()
            return order
        late_refusal = RefusalReason.LATE_PAYMENT_REFUSED
        if decision is Decision.LATE and self._late_check_accepts(order, payment):
            try:
                paid = self._pay_late(order, payment, actor, now_ms, host)
            except HoldRefused:
                paid, late_refusal = None, RefusalReason.UNITS_TAKEN
            if paid is not None:
                _count_paid(paid, "late_accepted")
                return paid
        closed_now = won  # strict_expiry: this payment's attempt closed the order
        return self._refuse(
            order_id, payment, actor, now_ms, host, closed_now=closed_now, late=late_refusal
        )

    def _close_for(
        self, conn: Connection, order_id: str, payment: Payment, actor: Actor, now_ms: int
    ) -> Changed | None:
        """strict_expiry: close the expired order a payment came too late for; its close
        event names the payment's reference."""
        data = {"trigger": "late_payment", "payment_ref": payment.ref}
        return self.records.close_expired(conn, order_id, now_ms, data, actor)

    def _decide(
        self, order: Order, payment: Payment, now_ms: int
    ) -> tuple[Decision, RefusalReason | None]:
        return decide(
            order,
            payment,
            now_ms,
            window_ms=self._late_window_ms(order),
            strict=self.settings.strict_expiry,
        )

    def _late_window_ms(self, order: Order) -> int:
        return round(self.settings.order_policy(order.policy).late_payment_window_s * 1000)

    def _late_check_accepts(self, order: Order, payment: Payment) -> bool:
        check = self.late_check
        if check is None:
            return True
        (answer,) = self.hooks.ask(
            lambda asked: check(*asked), [(order, payment)], self.settings.pre_close_timeout_s
        )
        if answer.failed or answer.value is not True:
            if answer.failed or answer.value is not False:
                log.warning(
                    "late-payment check failed, timed out or answered neither True nor "
                    "False; refusing the payment",
                    extra={"order_id": order.id, "user_id": order.user_id},
                )
            return False
        return True

    def _pay_late(
        self, closed: Order, payment: Payment, actor: Actor, now_ms: int, host: Connection | None
    ) -> Order | None:
        """Closed -> paid, within the late window of the order's policy; None if something
        else changed the order first. A closed order has no member in the index: nothing
        to do in Redis."""
        order_id = closed.id
        window_ms = self._late_window_ms(closed)

        def attempt(conn: Connection) -> Changed | None:
            return self.records.pay(
                conn, order_id, now_ms, payment, actor, late_window_ms=window_ms
            )

        if closed.holds:
            # Its units again, if free: checked and taken in one transaction, the
            # resources locked as a create locks them (HoldRefused: taken by others).
            with self.records.tx.write(host) as conn:
                check_retake(conn, closed.user_id, order_id)
                row = attempt(conn)
                self.records.tx.commit(conn, host)
            if row is None:
                return None
            # Sold again in SQL; the index is left for reconcile (it counts too few sold).
            metrics.HOLDS.labels("sold").inc(len(closed.holds))
            return to_order(row, now_ms)

        order, won = self.transitioner.run(
            order_id, now_ms, attempt, redis_after=_nothing, host=host
        )
        return order if won else None

    def _refuse(
        self,
        order_id: str,
        payment: Payment,
        actor: Actor,
        now_ms: int,
        host: Connection | None,
        *,
        closed_now: bool = False,
        late: RefusalReason = RefusalReason.LATE_PAYMENT_REFUSED,
    ) -> Order:
        """Decide again under the order's lock and record the refusal, in one transaction;
        then raise it. (Under the lock the order may turn out payable after all, or paid
        by this very payment: then it is paid, or returned.)"""
        records = self.records
        with records.tx.write(host) as conn:
            order = records.current(conn, order_id, now_ms, lock=True)
            if order is None:
                raise OrderNotFound(order_id)
            decision, reason = self._decide(order, payment, now_ms)
            if decision is Decision.LATE:
                # Late and still closed: the check refused it, or (a strict expiry's order
                # still unpaid) it was never asked; either way it is not accepted here.
                decision, reason = Decision.REFUSE, late
            if decision is Decision.PAY:
                row = records.pay(conn, order_id, now_ms, payment, actor, strict=False)
                records.tx.commit(conn, host)
                paid = to_order(row, now_ms) if row is not None else order
                self.transitioner.after_commit(
                    paid, host, self.transitioner.admitter.followups.release_of
                )
                _count_paid(paid, "on_time")
                return paid
            if decision is Decision.REPEAT or reason is None:
                records.tx.commit(conn, host)
                metrics.PAYMENTS.labels("repeat").inc()
                return order
            closed = None
            if order.status is OrderStatus.UNPAID and reason not in MISMATCHES:
                # strict_expiry: an unpaid order past its expiry is closed by its refusal.
                closed = self._close_for(conn, order_id, payment, actor, now_ms)
            position = record_refusal(conn, order, payment, reason, now_ms, actor)
            records.tx.commit(conn, host)
        if closed is not None:
            order = to_order(closed, now_ms)
            self.transitioner.after_commit(
                order, host, self.transitioner.admitter.followups.release_of
            )
        strict_close = closed_now or closed is not None
        metrics.PAYMENTS.labels("refused_strict" if strict_close else _OUTCOMES[reason]).inc()
        raise refusal_error(order, reason, position)


def _count_paid(order: Order, outcome: str) -> None:
    """A payment that turned ``order`` paid; with the order's reminder, if it had one (read
    from the payment's own RETURNING row)."""
    metrics.PAYMENTS.labels(outcome).inc()
    if order.reminded_at_ms is not None:
        metrics.PAID_AFTER_REMINDER.inc()


def refusal_error(order: Order, reason: RefusalReason, position: tuple[int, int]) -> OrdersError:
    """The error a refused payment raises, carrying its ``payment_refused`` event."""
    if reason is RefusalReason.ALREADY_PAID:
        return OrderAlreadyPaid(order.id, order.payment_ref, position)
    if reason is RefusalReason.AMOUNT_MISMATCH:
        return PaymentMismatch(order.id, "amount", position)
    if reason is RefusalReason.CURRENCY_MISMATCH:
        return PaymentMismatch(order.id, "currency", position)
    return OrderClosed(order.id, order.status.value, position)


MISMATCHES = (RefusalReason.AMOUNT_MISMATCH, RefusalReason.CURRENCY_MISMATCH)
#: The ``orders_payments_total`` outcome of each refusal.
_OUTCOMES = {
    RefusalReason.CLOSED: "refused_after_close",
    RefusalReason.CANCELLED: "refused_after_close",
    RefusalReason.ALREADY_PAID: "other_ref",
    RefusalReason.AMOUNT_MISMATCH: "refused_mismatch",
    RefusalReason.CURRENCY_MISMATCH: "refused_mismatch",
    RefusalReason.LATE_PAYMENT_REFUSED: "refused_late",
    RefusalReason.UNITS_TAKEN: "refused_late",
}


def _nothing(order: Order) -> None:
    """No Redis step (a late payment: a closed order holds no member)."""
