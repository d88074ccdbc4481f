"""SweeperLease: which scheduler process is the active one, kept in one Redis key.

The key is ``<prefix>[sweeper-lease]``: under the users' prefix (one ACL pattern covers
both), yet never a user's key, because ``[`` is refused in user ids. Its value is the
holder's owner token; ``lease.lua`` takes or renews it and ``lease_release.lua`` gives it
up, each only for its owner. Every redis-py exception becomes :class:`StoreUnavailable`.
"""

from __future__ import annotations

from typing import Any

from redis.commands.core import Script

from orders.index.errors import redis_errors
from orders.index.nodes import RedisClient
from orders.index.unpaid import load_script
from orders.validation import check_count, check_token


class SweeperLease:
    """The sweeper lease on a redis-py client, under ``key_prefix``."""

    def __init__(self, client: RedisClient, *, key_prefix: str) -> None:
        self.client = client
        #: The lease's key, the one place its name is built.
        self.key = f"{key_prefix}[sweeper-lease]"
        self._lease: Script = client.register_script(load_script("lease"))
        self._lease_release: Script = client.register_script(load_script("lease_release"))

    def acquire(self, owner: str, ttl_ms: int) -> bool:
        """Take the lease for ``ttl_ms`` if it is free, or renew it if ``owner`` holds it.

        One script, one round trip. False: another owner holds it (and keeps it). On a
        Redis at maxmemory under noeviction both still work (GET, then PEXPIRE or nothing);
        only a free lease cannot be taken: StoreUnavailable naming out of memory.
        """
        _check_lease_args(owner, ttl_ms)
        with redis_errors("acquire_lease"):
            reply: Any = self._lease(keys=[self.key], args=[owner, ttl_ms])
        return int(reply) == 1

    def release(self, owner: str) -> bool:
        """Delete the lease if ``owner`` holds it; True if it did."""
        _check_lease_args(owner, 1)
        with redis_errors("release_lease"):
            reply: Any = self._lease_release(keys=[self.key], args=[owner])
        return int(reply) == 1

    def owner(self) -> str | None:
        """The owner token of the current holder, or None if the lease is free."""
        with redis_errors("lease_owner"):
            value: bytes | str | None = self.client.get(self.key)
        if value is None:
            return None
        return value.decode("utf-8") if isinstance(value, bytes) else value


def _check_lease_args(owner: str, ttl_ms: int) -> None:
    check_token("owner", owner)
    check_count("ttl_ms", ttl_ms, 1)
