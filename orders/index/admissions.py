"""What ``admit.lua`` is asked and what it answers: an admission's request, its reply read
as a result, and its ARGV in the script's order (for :class:`~orders.index.unpaid.UnpaidIndex`
and for the bench's raw EVALSHA alike)."""

from __future__ import annotations

import enum
from dataclasses import KW_ONLY, dataclass
from decimal import Decimal
from typing import Any

from orders.config.values import CreateRate
from orders.index.keys import text_of

#: How old (ms) a create's admission must be before a refusal names its member as a suspect
#: (``admit.lua``), for the caller to ask SQL whether the create committed, still runs, or
#: died (:mod:`orders.rules.ghosts`). A create is between its Redis and SQL steps for
#: milliseconds; one still there after this waits on a starved pool or a connect, and losing
#: its member then costs nothing of the limit (SQL's slot guard decides, and writes it back).
SUSPECT_AFTER_MS = 5_000


class Admission(enum.IntEnum):
    ADMITTED = 1
    EXISTS = 0
    REFUSED = -1
    #: A late run of an attempt its caller abandoned (``abandon.lua``): nothing written.
    ABANDONED = -2
    #: The user's create rate is used up (``Settings.create_rate``): nothing written.
    RATE_LIMITED = -3


@dataclass(frozen=True, slots=True)
class AdmitRequest:
    """One admission asked of ``admit.lua`` (:meth:`UnpaidIndex.admit`): add ``order_id`` to
    ``user_id``'s set with the score ``expires_at_ms`` unless the user is at ``limit`` or
    has used up its ``rate`` of creates; ``now_ms``: when the create behind it started."""

    user_id: str
    order_id: str
    _: KW_ONLY
    expires_at_ms: int
    now_ms: int
    limit: int
    #: Count it as a create against this rate (None: not a create, or no rate).
    rate: CreateRate | None = None


@dataclass(frozen=True, slots=True)
class AdmitResult:
    outcome: Admission
    #: Open orders of the user after the call (including this one unless refused).
    open_count: int
    #: ADMITTED/EXISTS: the order's expiry; REFUSED: the earliest open expiry;
    #: RATE_LIMITED: the start of the create whose leaving the window lets the next one in
    #: (and ``open_count`` is how many creates the window holds).
    score_ms: int
    #: REFUSED: the limit the script applied (the user's own, when its key is set).
    limit: int | None = None
    #: REFUSED: (order id, start ms) of the members whose create started at least
    #: :data:`SUSPECT_AFTER_MS` ago and is not confirmed: it may be over without a row.
    suspects: tuple[tuple[str, int], ...] = ()


def score_of(value: bytes | str | float) -> int:
    """A sorted-set score as Redis printed it, as the integer milliseconds it is."""
    # Redis prints integer-valued doubles in full; Decimal also copes with exponent form.
    if isinstance(value, float):
        return int(value)
    try:
        return int(value)  # digits (the common reply): no Decimal
    except ValueError:
        return int(Decimal(text_of(value)))


def admit_result(reply: list[Any]) -> AdmitResult:
    """``admit.lua``'s reply (its header says what each element is)."""
    code, count, score = reply[:3]
    applied = int(reply[3]) if len(reply) > 3 else None
    pairs = reply[4:]
    suspects = (
        tuple((text_of(o), int(s)) for o, s in zip(pairs[::2], pairs[1::2], strict=True))
        if pairs
        else ()
    )
    return AdmitResult(Admission(int(code)), int(count), score_of(score), applied, suspects)


def admit_args(
    order_id: str,
    *,
    expires_at_ms: int,
    now_ms: int,
    limit: int,
    window_ms: int,
    rate: CreateRate | None = None,
) -> list[str | int]:
    """``admit.lua``'s ARGV, in its header's order: for :meth:`UnpaidIndex.admit` and for
    the bench's raw EVALSHA alike (whose KEYS are the user's key and :func:`admits_key`:
    without a ``rate`` the script reads no other)."""
    rate_count, rate_window_ms = rate or (0, 0)
    return [
        order_id,
        expires_at_ms,
        now_ms,
        limit,
        window_ms,
        rate_count,
        rate_window_ms,
        SUSPECT_AFTER_MS,
    ]
