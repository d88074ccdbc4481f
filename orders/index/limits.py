"""The Redis copy of users' own limits, beside each user's set, read by ``admit.lua``.

SQL's ``oes_user_limits`` is the record (:mod:`orders.sql.user_limits`); this is its copy,
one string key per user in the user's hash slot (:func:`orders.index.keys.limit_key`), so
the admission script reads it in the same call. A missing key means the settings' limit.
The use case writes it after the commit (:mod:`orders.rules.user_limits`); the SQL guard's repair
and reconcile write it back from SQL.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

from orders.index.errors import redis_errors
from orders.index.keys import LIMIT_TAG, glob_escape, limit_key, user_of_limit_key
from orders.index.nodes import RedisClient
from orders.index.pipeline import Foreign, scan_named


@dataclass(eq=False)
class LimitCopies:
    """Users' own limit keys on a redis-py client (see the module docstring)."""

    client: RedisClient
    _: KW_ONLY
    key_prefix: str
    #: The user's set's key (:meth:`orders.index.unpaid.UnpaidIndex.key`).
    user_key: Callable[[str], str]
    #: Where a key under the limit tag that names no user is reported.
    foreign: Foreign

    def key(self, user_id: str) -> str:
        """The user's own limit, as ``admit.lua`` reads it (see :func:`limit_key`)."""
        return limit_key(self.user_key(user_id), self.key_prefix)

    def write(self, limits: Mapping[str, int | None]) -> int:
        """Set each user's own limit key (None: delete it, the settings' limit applies), in
        one pipelined round trip; returns how many keys were deleted. SQL's
        ``oes_user_limits`` is the record, this its copy."""
        if not limits:
            return 0
        with redis_errors("write_limits"):
            pipe = self.client.pipeline(transaction=False)
            for user_id, limit in limits.items():
                if limit is None:
                    pipe.delete(self.key(user_id))
                else:
                    pipe.set(self.key(user_id), limit)
            replies: list[Any] = pipe.execute()
        return sum(
            int(reply)
            for reply, limit in zip(replies, limits.values(), strict=True)
            if limit is None
        )

    def read(self, user_id: str) -> int | None:
        """The user's own limit as Redis holds it (None: no key)."""
        with redis_errors("read_limit"):
            value: Any = self.client.get(self.key(user_id))
        return None if value is None else int(value)

    def scan_users(self, *, chunk: int = 500) -> Generator[list[str]]:
        """The users that have an own limit key, as
        :meth:`orders.index.unpaid.UnpaidIndex.scan_users` finds users' keys; a key under
        the limit tag that names no user is foreign, skipped and counted."""
        pattern = glob_escape(self.key_prefix + LIMIT_TAG) + "*"
        yield from scan_named(
            self.client,
            "scan_limit_users",
            pattern,
            chunk,
            lambda key: user_of_limit_key(key, self.key_prefix),
            self.foreign,
        )
