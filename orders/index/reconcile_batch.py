"""One reconcile batch: the ``reconcile.lua`` calls of many users, sent at once, read later.

:meth:`orders.index.unpaid.UnpaidIndex.reconcile_batch` builds it; the packing and the
connection it keeps are :mod:`orders.index.pipeline`'s. Foreign data in the replies (a key
of another type, a member that is not UTF-8) is reported and left out, never an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import redis

from orders.index.errors import redis_errors
from orders.index.keys import text_of
from orders.index.nodes import RedisClient
from orders.index.pipeline import CallPacker, ClusterCalls, Foreign, SentCalls, send_calls


@dataclass(slots=True)
class KeysChecked:
    """What the reconcile script found in a batch of users' keys (and fixed, unless a dry
    run); a key of another type is foreign and left out."""

    users: int = 0
    expired: int = 0
    added: int = 0
    rescored: int = 0
    #: Live members SQL did not list for their user, left in place: (user id, order id).
    extras: list[tuple[str, str]] = field(default_factory=list)
    #: Users whose key had members added or re-scored, in the order sent.
    written: list[str] = field(default_factory=list)


@dataclass(eq=False)
class ReconcileBatch:
    """The reconcile scripts of a batch of users: :meth:`send` writes them all and returns
    at once, :meth:`read` collects the outcome (sending first if need be). Once sent, read
    or :meth:`abandon` must follow, so no reply is left on a pooled connection."""

    client: RedisClient
    users: list[str]
    packer: CallPacker
    _: KW_ONLY
    user_key: Callable[[str], str]
    foreign: Foreign
    sent: SentCalls | ClusterCalls | None = field(default=None, init=False)

    def send(self) -> SentCalls | ClusterCalls:
        with redis_errors("reconcile"):
            self.sent = send_calls(self.client, self.packer)
        return self.sent

    def abandon(self) -> None:
        """Give up replies not read yet (closes their connection); else nothing."""
        if self.sent is not None:
            self.sent.abandon()

    def read(self) -> KeysChecked:
        """Collect the replies. Foreign data (a key of another type, a member that is not
        UTF-8) is reported through ``foreign`` and left out."""
        sent = self.send() if self.sent is None else self.sent
        with redis_errors("reconcile"):
            replies = sent.read()
        found = KeysChecked(users=len(self.users))
        for user_id, reply in zip(self.users, replies, strict=True):
            if reply == 0:  # the key was right already
                continue
            if type(reply) is not list:
                self._failed(user_id, reply, found)
                continue
            found.expired += reply[0]
            found.added += reply[1]
            found.rescored += reply[2]
            if reply[1] or reply[2]:
                found.written.append(user_id)
            for member in reply[3:]:  # rare: most fixed keys have none
                try:
                    found.extras.append((user_id, text_of(member)))
                except UnicodeDecodeError:
                    self.foreign(self._key(user_id), "member")
        return found

    def _failed(self, user_id: str, reply: Any, found: KeysChecked) -> None:
        if isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE"):
            self.foreign(self._key(user_id), "not a sorted set")
            found.users -= 1
            return
        with redis_errors("reconcile"):  # NOPERM, OOM, ...: the store failed, not the data
            raise reply

    def _key(self, user_id: str) -> bytes:
        return self.user_key(user_id).encode("utf-8", "surrogatepass")
