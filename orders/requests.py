"""A use case's arguments, checked against the settings before anything is read or written.

Each check of a single value lives in :mod:`orders.validation`; this module puts them
together per use case, with the limits :class:`~orders.config.Settings` sets, and turns
the result into what the use case works with: a create's :class:`~orders.domain.NewOrder`, a
payment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from orders.config import Settings
from orders.domain import Actor, NewOrder, Payment
from orders.errors import InvalidInput
from orders.policies import ExpiryPolicy, check_deadline, check_policy_name
from orders.validation import (
    TEXT_MAX_LENGTH,
    check_amount,
    check_currency,
    check_currency_needs_amount,
    check_expiry_ms,
    check_hold_names,
    check_holds,
    check_limit,
    check_metadata,
    check_on_limit,
    check_optional_text,
    check_order_id,
    check_ttl_ms,
    check_user_id,
)


def checked_money(amount: object, currency: object) -> tuple[Decimal | None, str | None]:
    """An amount and its currency: each valid, and no currency without an amount."""
    amt = check_amount(amount)
    cur = check_currency(currency)
    check_currency_needs_amount(amt, cur)
    return amt, cur


def checked_payment(payment_ref: object, amount: object, currency: object) -> Payment:
    """What ``mark_paid`` was told about the payment."""
    ref = check_optional_text("payment_ref", payment_ref, TEXT_MAX_LENGTH)
    return Payment(ref, *checked_money(amount, currency))


@dataclass(frozen=True, slots=True)
class CreateRequest:
    """``create_unpaid_order``'s arguments, checked, with the settings' defaults filled in."""

    user_id: str
    #: The caller's own id, or None (the service makes one).
    order_id: str | None
    ttl_ms: int
    limit: int
    amount: Decimal | None
    currency: str | None
    actor: Actor
    #: What to do at the limit (``Settings.on_limit`` unless the call says).
    on_limit: str
    #: The expiry policy's name (None: the settings' default one) and the policy.
    policy: str | None
    terms: ExpiryPolicy
    metadata: dict[str, Any] = field(default_factory=dict)
    #: ``expires_at`` in ms (None: ``ttl_ms`` after the creation).
    deadline_ms: int | None = None
    #: The units it holds, sorted by resource id (``validation.check_holds``).
    holds: tuple[tuple[str, int], ...] = ()
    #: The named units asked for by name (``validation.check_hold_names``).
    names: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def checked(
        cls,
        settings: Settings,
        user_id: object,
        *,
        order_id: object,
        ttl_s: object,
        limit: object,
        amount: object,
        currency: object,
        metadata: Mapping[str, Any] | None,
        actor: object,
        on_limit: object = None,
        policy: object = None,
        expires_at: object = None,
        holds: object = None,
    ) -> CreateRequest:
        s = settings
        # Neither amount nor currency (most creates): nothing to check.
        amt, cur = (
            (None, None) if amount is None and currency is None else checked_money(amount, currency)
        )
        name = None if policy is None else check_policy_name(policy)
        terms = s.policy(name)
        if expires_at is not None and ttl_s is not None:
            raise InvalidInput("expires_at", "and ttl_s exclude each other: give one")
        if not terms.expires and (expires_at is not None or ttl_s is not None):
            raise InvalidInput("policy", f"{name} does not expire: no ttl_s or expires_at")
        return cls(
            user_id=check_user_id(user_id, s.max_user_id_length),
            order_id=None if order_id is None else check_order_id(order_id, s.max_order_id_length),
            ttl_ms=check_ttl_ms(terms.ttl_s if ttl_s is None else ttl_s, terms.longest_ttl_s),
            limit=s.unpaid_limit if limit is None else check_limit(limit),
            amount=amt,
            currency=cur,
            metadata=check_metadata(metadata, s.max_metadata_bytes),
            actor=Actor.of(actor),
            on_limit=s.on_limit if on_limit is None else check_on_limit(on_limit),
            policy=name,
            terms=terms,
            deadline_ms=None if expires_at is None else check_deadline(expires_at),
            holds=() if holds is None else check_holds(holds),
            names=() if holds is None else check_hold_names(holds),
        )

    def new_order(self, order_id: str, now_ms: int, trace: dict[str, str] | None) -> NewOrder:
        """The create, started at ``now_ms`` (InvalidInput if its expiry would not be exact
        as a Redis score, or its ``expires_at`` is not ahead of ``now_ms``); ``trace``: the
        caller's trace context."""
        terms = self.terms
        expiry_ms = terms.expiry_ms(now_ms, self.ttl_ms, self.deadline_ms)
        expires_at_ms = check_expiry_ms(now_ms, expiry_ms - now_ms)
        return NewOrder(
            order_id,
            self.user_id,
            now_ms,
            expires_at_ms,
            self.limit,
            self.actor,
            caller_id=self.order_id is not None,
            amount=self.amount,
            currency=self.currency,
            metadata=self.metadata,
            remind_at_ms=terms.remind_at_ms(now_ms, expires_at_ms),
            policy=self.policy,
            trace=trace,
            holds=self.holds,
            names=self.names,
        )
