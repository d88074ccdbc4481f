"""Per-user limits as a use case: SQL records the limit, then Redis gets its copy.

SQL is the record (:mod:`orders.sql.user_limits`); the SQL guard reads the row inside its
insert, so a lowered limit holds whatever Redis lost. The admission script reads a copy in
the user's hash slot (:meth:`orders.index.limits.LimitCopies.write`), written after
the commit: a Redis failure there is logged, and the repair after the guard's next refusal,
or reconcile, writes the copy from SQL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from orders.config import Settings
from orders.domain import Actor, Clock
from orders.errors import StoreUnavailable
from orders.index.unpaid import UnpaidIndex
from orders.sql.transactions import Transactions
from orders.sql.user_limits import (
    LimitChange,
    UserLimit,
    delete_limit,
    read_history,
    read_limit,
    write_limit,
)
from orders.validation import check_user_id, check_user_limit

log = logging.getLogger("orders.service")


@dataclass(eq=False)
class UserLimits:
    """Sets, clears and reads users' own limits (see the module docstring)."""

    tx: Transactions
    index: UnpaidIndex
    settings: Settings
    clock: Clock

    def set(self, user_id: str | int, limit: int, actor: str | Actor | None) -> UserLimit:
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        own = check_user_limit(limit)
        cause = Actor.of(actor)
        result = write_limit(self.tx, uid, own, self.clock(), cause)
        self.copy(uid, own)
        return result

    def clear(self, user_id: str | int, actor: str | Actor | None) -> UserLimit:
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        delete_limit(self.tx, uid, self.clock(), Actor.of(actor))
        self.copy(uid, None)
        return UserLimit(uid, self.settings.unpaid_limit)

    def history(self, user_id: str | int, limit: int) -> list[LimitChange]:
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        return read_history(self.tx, uid, limit)

    def read(self, user_id: str | int) -> UserLimit:
        uid = check_user_id(user_id, self.settings.max_user_id_length)
        return read_limit(self.tx, uid, self.settings.unpaid_limit)

    def copy(self, user_id: str, limit: int | None) -> None:
        """Write the user's copy in Redis (None: remove it); a failure is only logged."""
        try:
            self.index.limits.write({user_id: limit})
        except StoreUnavailable:
            log.warning(
                "redis limit write failed; reconcile will fix it", extra={"user_id": user_id}
            )
