"""Heartbeats: what each scheduler process last said about itself, in one Redis hash.

The lease (:mod:`orders.index.lease`) names the active scheduler only; an operator (the
dashboard) also wants the standbys, when each was last heard of, the active one's last
successful sweep and when its lease lapses. Each scheduler writes a :class:`SchedulerBeat`
at every tick into the hash ``<prefix>[schedulers]``, one field per owner token: one key,
so it works on a Redis Cluster, and under the users' prefix but never a user's key (``[``
is refused in user ids, as for the lease).

A scheduler that dies stops beating: ``heartbeat.lua`` drops its field once it is older
than the ``forget_after_ms`` its scheduler wrote with it, and the key itself expires that
long after the last beat of all. Times are the service clock's milliseconds, passed in, so
tests move them by hand. Every redis-py exception becomes :class:`StoreUnavailable`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from redis.commands.core import Script

from orders.index.errors import redis_errors
from orders.index.nodes import RedisClient
from orders.index.unpaid import load_script
from orders.validation import check_count, check_token


@dataclass(frozen=True, slots=True)
class SchedulerBeat:
    owner: str
    #: Holds the sweeper lease at this beat.
    active: bool
    #: Service-clock ms of this scheduler's last successful sweep (None: none yet).
    last_sweep_ms: int | None
    #: When its lease lapses unless renewed (None on standbys).
    lease_expires_ms: int | None
    #: Service-clock ms when it wrote this beat.
    seen_ms: int


class Heartbeats:
    """The schedulers' beats on a redis-py client, under ``key_prefix``."""

    def __init__(self, client: RedisClient, *, key_prefix: str) -> None:
        self.client = client
        #: The hash's key, the one place its name is built.
        self.key = f"{key_prefix}[schedulers]"
        self._heartbeat: Script = client.register_script(load_script("heartbeat"))

    def publish(self, beat: SchedulerBeat, *, forget_after_ms: int) -> None:
        """Write ``beat`` as its owner's field and forget the beats gone stale, at once.

        One script, one round trip; the hash expires ``forget_after_ms`` after this call
        unless someone beats again.
        """
        check_token("owner", beat.owner)
        check_count("forget_after_ms", forget_after_ms, 1)
        check_count("seen_ms", beat.seen_ms, 0)
        value = json.dumps({**asdict(beat), "forget_after_ms": forget_after_ms})
        with redis_errors("publish_heartbeat"):
            self._heartbeat(
                keys=[self.key], args=[beat.owner, value, beat.seen_ms, forget_after_ms]
            )

    def read(self, now_ms: int) -> list[SchedulerBeat]:
        """Every scheduler heard of within its forget window: the active first, then by owner.

        A field that is not a beat (written by something else) is skipped.
        """
        with redis_errors("read_heartbeats"):
            fields: dict[Any, Any] = self.client.hgetall(self.key)
        beats = [beat for raw in fields.values() if (beat := _parse(raw, now_ms)) is not None]
        return sorted(beats, key=lambda beat: (not beat.active, beat.owner))

    def remove(self, owner: str) -> None:
        """Drop ``owner``'s beat (a scheduler that stops cleanly says so at once)."""
        with redis_errors("remove_heartbeat"):
            self.client.hdel(self.key, owner)


def _parse(raw: bytes | str, now_ms: int) -> SchedulerBeat | None:
    """The beat in ``raw``, or None if it is not one or is older than its forget window."""
    try:
        found = json.loads(raw)
        beat = SchedulerBeat(
            owner=str(found["owner"]),
            active=bool(found["active"]),
            last_sweep_ms=_optional_int(found["last_sweep_ms"]),
            lease_expires_ms=_optional_int(found["lease_expires_ms"]),
            seen_ms=int(found["seen_ms"]),
        )
        forget_after_ms = int(found["forget_after_ms"])
    except (ValueError, TypeError, KeyError):
        return None
    return None if beat.seen_ms + forget_after_ms < now_ms else beat


def _optional_int(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("not an integer")
    return value
