"""Erasure of a user: the user id replaced by a keyed pseudonym, and what names the user or
the user's payments cleared, in both stores.

The pseudonym is ``erased-`` and the first 32 hex digits of HMAC-SHA256(``erasure_key``,
user id): the same user always gets the same one (so an erasure can be found again and
finished), and without the key nobody can tell whose it is. Without ``erasure_key`` an
erasure is refused (InvalidInput) before anything is read.

Steps, each safe to run again, so an erasure cut off anywhere is finished by running it
again:

1. Refuse (:class:`~orders.errors.RefundOwed`, nothing written) while a refused payment of
   the user's orders has no refund marked handled: its reference is needed for the refund.
2. Delete the user's waiting-list entries (a cancel below frees units, which would serve
   them), then cancel every unpaid order of the user, each by ``cancel_order``'s
   compare-and-set (as the
   bulk cancel does, reason ``erased``): a payment that commits first wins, and that order
   is kept, paid, like the other paid ones.
3. In one SQL transaction (:mod:`orders.sql.erasure`): the pseudonym in place of the user
   id in the orders, their events and refused payments; the orders' metadata and payment
   references cleared, and the references in event data and refusals; the user's own limit
   and its history deleted, and any waiting-list entry added since step 2; one ``erased``
   event with the pseudonym and the counts (on the user's latest order: a user who had only
   an own limit or waiting-list entries gets none, and a second erasure of it is then
   UnknownUser). Step 1's check is made again inside it, after the orders' rows
   are taken, so a refusal that committed meanwhile rolls it back (RefundOwed).
4. After the commit, the user's Redis keys are deleted. If Redis fails, StoreUnavailable is
   raised: SQL is done; running the erasure again deletes them.

Erasing a user erased before (nothing under the user id, an ``erased`` event under the
pseudonym) writes nothing in SQL, runs step 4 again and returns the recorded counts with
``already`` set. A user never seen is :class:`~orders.errors.UnknownUser`.

A create for the user racing the erasure can land after step 2: its order stays under the
user id, unpaid. The caller stops taking orders for a user it erases; running the erasure
again then takes that order too. Events already handed to consumers or webhooks keep what
they carried.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from dataclasses import dataclass

from orders.config import Settings
from orders.config.urls import Secret
from orders.domain import ERASED_REASON, Actor
from orders.errors import InvalidInput, RefundOwed, UnknownUser
from orders.index.unpaid import UnpaidIndex
from orders.rules.bulk import BulkActions, BulkRun
from orders.sql.erasure import (
    ErasedRows,
    erase_rows,
    erasure_on_record,
    holds_rows,
    pending_refunds,
)
from orders.sql.matching import OrderFilter
from orders.sql.records import OrderRecords
from orders.sql.waiting import forget_user
from orders.validation import check_user_id

#: The name an erasure's events give when the caller names no actor.
DEFAULT_ACTOR_NAME = "erasure"
PSEUDONYM_PREFIX = "erased-"
PSEUDONYM_HEX_DIGITS = 32


@dataclass(frozen=True)
class Erasure:
    """What an erasure did (``already``: what the erasure on record did; nothing now but the
    Redis keys, if any were left)."""

    pseudonym: str
    already: bool
    #: The SQL counts (see :class:`orders.sql.erasure.ErasedRows`).
    orders: int
    cancelled: int
    events: int
    refusals: int
    limit_removed: bool
    #: Redis keys of the user deleted by this call.
    redis_keys: int


def pseudonym(key: Secret, user_id: str) -> str:
    """The user's pseudonym under ``key`` (module docstring)."""
    digest = hmac.new(key.reveal().encode(), user_id.encode(), hashlib.sha256).hexdigest()
    return PSEUDONYM_PREFIX + digest[:PSEUDONYM_HEX_DIGITS]


@dataclass(eq=False)
class Eraser:
    """Erases users over the records, the bulk cancel and the index (module docstring)."""

    records: OrderRecords
    bulk: BulkActions
    index: UnpaidIndex
    settings: Settings
    now_ms: Callable[[], int]

    def erase(self, user_id: object, actor: object) -> Erasure:
        key = self.settings.erasure_key
        if key is None:
            raise InvalidInput("erasure_key", "is not set (ORDERS_ERASURE_KEY): nothing erased")
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        who = Actor.of(DEFAULT_ACTOR_NAME if actor is None else actor)
        alias = pseudonym(key, uid)
        tx = self.records.tx
        with tx.read() as conn:
            owed = pending_refunds(conn, uid)
            held = holds_rows(conn, uid)
            before = None if held else erasure_on_record(conn, alias)
        if owed:
            raise RefundOwed(uid, owed)
        if before is not None:
            return self.result(alias, before, already=True, uid=uid)
        if not held:
            raise UnknownUser(uid)
        # Out of every waiting list before the cancels free units, which would serve them.
        with tx.write() as conn:
            forget_user(conn, uid)
            tx.commit(conn, None)
        self.bulk.cancel(BulkRun(OrderFilter(user_id=uid), who), ERASED_REASON)
        with tx.write() as conn:
            rows = erase_rows(conn, uid, alias, self.now_ms(), who)
            tx.commit(conn, None)
        return self.result(alias, rows, already=False, uid=uid)

    def result(self, alias: str, rows: ErasedRows, *, already: bool, uid: str) -> Erasure:
        """Step 4 (the Redis keys), then the erasure's summary."""
        return Erasure(
            pseudonym=alias,
            already=already,
            orders=rows.orders,
            cancelled=rows.cancelled,
            events=rows.events,
            refusals=rows.refusals,
            limit_removed=rows.limit_removed,
            redis_keys=self.index.forget_user(uid),
        )
