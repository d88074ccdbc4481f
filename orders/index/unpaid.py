"""UnpaidIndex: the Redis admission index, the only module that talks to Redis for it.

One sorted set per user, ``<prefix><user_id>``: member = order id, score = expiry in integer
milliseconds. The keys carry no expiry (its expires entry would cost about 45 bytes a user):
a set emptied of its last member vanishes, and reconcile drops any member left behind
(expired, or no longer open in SQL). The service's own keys sit under the same prefix in
brackets (the index epoch in :mod:`orders.index.epoch`, the lease in
:mod:`orders.index.lease`; ``[`` never occurs in a user id). Beside each user's set, for as
long as a create may be in flight, an admissions hash (:func:`orders.index.keys.admits_key`)
says when the create behind each member started, so a member left by a create that failed
can be told from one whose SQL row is still coming. Every command touches one key and
every script one user's keys, which share a hash slot, so the scripts run unchanged on a
Redis Cluster (:mod:`orders.index.nodes` says what a cluster changes).

Every redis-py exception becomes :class:`StoreUnavailable` (:mod:`orders.index.errors`).
Data under the prefix that the service did not write is skipped and reported, never an
error (:meth:`UnpaidIndex.foreign`).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from orders import metrics
from orders.config import Settings
from orders.errors import InvalidInput
from orders.index.admissions import AdmitRequest, AdmitResult, admit_args, admit_result, score_of
from orders.index.direct import packed, pool_of, run_packed
from orders.index.epoch import EpochMarker
from orders.index.errors import ServerRefused, redis_errors
from orders.index.keys import (
    ADMITS_TAG,
    LIMIT_TAG,
    RATE_TAG,
    admits_key,
    companion_key,
    companion_keys,
    glob_escape,
    text_of,
    user_of,
)
from orders.index.limits import LimitCopies
from orders.index.nodes import RedisClient
from orders.index.pipeline import CallPacker, run_per_key, scan_named
from orders.index.reconcile_batch import ReconcileBatch
from orders.index.server_config import server_warnings

log = logging.getLogger("orders.index")  # the package's name: operators configure it


#: ``admit.lua``'s KEYS after the user's set: its admissions hash, own limit, rate set.
_ADMIT_TAGS = (ADMITS_TAG, LIMIT_TAG, RATE_TAG)

#: How many distinct foreign keys one process logs (each once); past it, only counted.
_FOREIGN_LOG_CAP = 1000


def load_script(name: str) -> str:
    return resources.files("orders.index").joinpath("lua", f"{name}.lua").read_text("utf-8")


class UnpaidIndex:
    """Per-user sorted sets of open unpaid orders, kept on a redis-py client."""

    def __init__(
        self, client: RedisClient, *, key_prefix: str, window_ms: int | None = None
    ) -> None:
        self.client = client
        self.key_prefix = key_prefix
        #: How long a create may still be in flight (``Settings.admission_window_ms``).
        self.window_ms = Settings().admission_window_ms if window_ms is None else window_ms
        if client.get_encoder().decode_responses:
            raise InvalidInput("redis_client", "must not decode responses (ids are read as bytes)")
        #: Pieces of foreign data skipped so far (keys or members under the prefix that the
        #: service did not write: not UTF-8, not a user id, not a sorted set).
        self.foreign_seen = 0
        self._foreign_logged: set[bytes] = set()
        #: The index epoch marker (:mod:`orders.index.epoch`).
        self.epoch = EpochMarker(client, key_prefix=key_prefix)
        #: The users' own limits, copied from SQL (:mod:`orders.index.limits`).
        self.limits = LimitCopies(
            client, key_prefix=key_prefix, user_key=self.key, foreign=self.foreign
        )
        self._admit: Script = client.register_script(load_script("admit"))
        #: Where an admission (and a payment's ZREM) is sent packed by hiredis (None:
        #: through the client's call; :mod:`orders.index.direct`).
        self._admit_pool = pool_of(client)
        self._abandon: Script = client.register_script(load_script("abandon"))
        # Run through orders.index.pipeline (EVALSHA, SCRIPT LOAD on NOSCRIPT): redis-py's
        # pipelined scripts would also send SCRIPT EXISTS, a round trip and an ACL grant more.
        self._reconcile: Script = client.register_script(load_script("reconcile"))

    def key(self, user_id: str) -> str:
        """The one place a user's key name is built."""
        return f"{self.key_prefix}{user_id}"

    def admits_key(self, user_id: str) -> str:
        """The user's admissions hash (see :func:`admits_key`)."""
        return admits_key(self.key(user_id), self.key_prefix)

    def rate_key(self, user_id: str) -> str:
        """The user's recent creates, for the create rate (see ``admit.lua``)."""
        return companion_key(self.key(user_id), self.key_prefix, RATE_TAG)

    def admit_keys(self, user_id: str) -> list[str]:
        """``admit.lua``'s KEYS, in its header's order (all in the user's hash slot)."""
        key = self.key(user_id)
        return [key, *companion_keys(key, self.key_prefix, _ADMIT_TAGS)]

    def admit(self, request: AdmitRequest) -> AdmitResult:
        """Add the order unless the user is at the limit (expired members do not count)
        or has used up its rate of creates, noting that a create which started at
        ``now_ms`` added it (and, with a rate, counting it). The user's own limit key
        (:attr:`limits`), when set, replaces ``limit``; a refusal says which applied.

        A server that refuses the script (out of memory, an ACL) raises
        :class:`ServerRefused`: then nothing was written.
        """
        keys, args = self.admit_call(request)
        with redis_errors("admit", refused=ServerRefused):
            try:
                # EVALSHA itself: the hot path of every create (redis-py's Script wrapper
                # costs a few microseconds more; it still loads the script on NOSCRIPT).
                reply: list[Any]
                if self._admit_pool is not None:
                    command = ("EVALSHA", self._admit.sha, len(keys), *keys, *args)
                    reply = run_packed(self._admit_pool, packed(command))
                else:
                    reply = self.client.evalsha(self._admit.sha, len(keys), *keys, *args)
            except NoScriptError:
                reply = self._admit(keys=keys, args=args)
        return admit_result(reply)

    def admit_call(self, request: AdmitRequest) -> tuple[list[str], list[str | int]]:
        """``admit.lua``'s KEYS and ARGV for ``request``."""
        args = admit_args(
            request.order_id,
            expires_at_ms=request.expires_at_ms,
            now_ms=request.now_ms,
            limit=request.limit,
            window_ms=self.window_ms,
            rate=request.rate,
        )
        return self.admit_keys(request.user_id), args

    @property
    def admit_script(self) -> Script:
        """``admit.lua``, registered (for admissions packed by :mod:`orders.index.admit_batch`)."""
        return self._admit

    def abandon(self, user_id: str, order_id: str, *, started_ms: int) -> bool:
        """Undo the admission that a create started at ``started_ms`` may have sent, and
        make a late run of it add nothing (``abandon.lua``); True if a member went (its
        entry in the rate set goes with it: the attempt is no create)."""
        keys = [self.key(user_id), self.admits_key(user_id), self.rate_key(user_id)]
        with redis_errors("abandon"):
            return bool(self._abandon(keys=keys, args=[order_id, started_ms, self.window_ms]))

    def confirm(self, committed: Sequence[tuple[str, str]]) -> None:
        """Drop the admission entries of orders SQL has a row of, (user id, order id): a
        refusal names them no more (one ``HDEL`` per user, pipelined; reconcile and
        abandons go by the row)."""
        by_user: dict[str, list[str]] = {}
        for user_id, order_id in committed:
            by_user.setdefault(user_id, []).append(order_id)
        with redis_errors("confirm"):
            pipe = self.client.pipeline(transaction=False)
            for user_id, order_ids in by_user.items():
                pipe.hdel(self.admits_key(user_id), *order_ids)
            pipe.execute()

    def admission_starts(self, members: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
        """When the create that admitted each (user id, order id) started, for those the
        admissions hashes still name (an abandoned attempt's start too), in one pipelined
        round trip."""
        if not members:
            return {}
        with redis_errors("admission_starts"):
            pipe = self.client.pipeline(transaction=False)
            for user_id, order_id in members:
                pipe.hget(self.admits_key(user_id), order_id)
            replies: list[Any] = pipe.execute()
        return {
            member: abs(int(reply))
            for member, reply in zip(members, replies, strict=True)
            if reply is not None
        }

    def release(self, user_id: str, order_id: str, *, forget_admission: bool = False) -> bool:
        """Remove one order from its user's set; True if it was there.

        ``forget_admission``: also drop the note of its admission (the hash goes with its
        last note) and its entry in the rate set, for an admission undone because its create
        failed: the create then leaves nothing behind, and does not use up the create rate.
        The commands go in one round trip (the keys share a slot).
        A payment or a cancel keeps the note, which expires with the admission window,
        and costs one command.
        """
        with redis_errors("release"):
            if not forget_admission:  # every payment's and cancel's: packed when it can be
                if self._admit_pool is not None:
                    command = packed(("ZREM", self.key(user_id), order_id))
                    return bool(run_packed(self._admit_pool, command))
                return bool(self.client.zrem(self.key(user_id), order_id))
            pipe = self.client.pipeline(transaction=False)
            pipe.zrem(self.key(user_id), order_id)
            pipe.hdel(self.admits_key(user_id), order_id)
            pipe.zrem(self.rate_key(user_id), order_id)
            removed, _, _ = pipe.execute()
            return bool(removed)

    def forget_user(self, user_id: str) -> int:
        """Delete every key the index keeps for the user (its set, admissions hash, own
        limit copy and rate set: one hash slot, so one DEL); how many existed."""
        keys = self.admit_keys(user_id)
        with redis_errors("forget_user"):
            return int(self.client.delete(*keys))

    def drop_expired(self, user_ids: Iterable[str], now_ms: int) -> None:
        """``ZREMRANGEBYSCORE -inf now`` on each user's key, in one round trip, packed by
        hand: redis-py's pipeline cost the sweep more than the server's work."""
        keys = [self.key(user_id).encode() for user_id in dict.fromkeys(user_ids)]
        with redis_errors("drop_expired"):
            run_per_key(self.client, b"ZREMRANGEBYSCORE", keys, (b"-inf", b"%d" % now_ms))

    def members(self, user_id: str) -> dict[str, int]:
        """Every member of the user's set with its score, expired or not (for reads/tests)."""
        with redis_errors("members"):
            pairs: list[Any] = self.client.zrange(
                self.key(user_id), 0, -1, withscores=True, score_cast_func=text_of
            )
        return self._decode(user_id, pairs)

    def server_warnings(self) -> list[str]:
        """What about the server's configuration could lose the index (see
        :func:`orders.index.server_config.server_warnings`)."""
        return server_warnings(self.client)

    def scan_users(self, *, chunk: int = 500) -> Generator[list[str]]:
        """The user ids that have a key, ``chunk`` or so at a time (SCAN: no blocking); the
        next SCAN call runs on the server while the caller works on a batch, so close the
        iterator when stopping early (``contextlib.closing``).

        A key under the prefix that no user id can name (not UTF-8, not a valid id) is
        foreign: it is skipped and reported through :meth:`foreign`, never an error.
        """
        # "[^[]": not the service's own keys, whose names go on with "[" (no user id does).
        pattern = glob_escape(self.key_prefix) + "[^\\[]*"
        start = len(self.key_prefix)
        yield from scan_named(
            self.client, "scan_users", pattern, chunk, lambda key: user_of(key, start), self.foreign
        )

    def rescore_present(self, wanted: Mapping[str, Mapping[str, int]]) -> None:
        """Give the members given (user -> order -> expiry) those scores, in one pipelined
        round trip, but only where they are still members (ZADD XX): an order paid or
        cancelled meanwhile has had its member removed, and must not get it back."""
        with redis_errors("rescore_present"):
            pipe = self.client.pipeline(transaction=False)
            for user_id, members in wanted.items():
                pipe.zadd(self.key(user_id), dict(members), xx=True)
            pipe.execute()

    def members_of(self, user_ids: list[str]) -> dict[str, dict[str, int]]:
        """Every member with its score for each user, in one pipelined round trip.

        Foreign data is skipped and reported through :meth:`foreign`: a member that is not
        UTF-8, or a key of another type (that user is then left out of the answer).
        """
        with redis_errors("members_of"):
            pipe = self.client.pipeline(transaction=False)
            for user_id in user_ids:
                pipe.zrange(self.key(user_id), 0, -1, withscores=True, score_cast_func=text_of)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        found: dict[str, dict[str, int]] = {}
        for user_id, pairs in zip(user_ids, replies, strict=True):
            if isinstance(pairs, redis.ResponseError) and str(pairs).startswith("WRONGTYPE"):
                self.foreign(self.key(user_id).encode("utf-8", "surrogatepass"), "not a sorted set")
                continue
            if isinstance(pairs, Exception):  # NOPERM, OOM, ...: the store failed, not the data
                with redis_errors("members_of"):
                    raise pairs
            found[user_id] = self._decode(user_id, pairs)
        return found

    def _decode(self, user_id: str, pairs: list[Any]) -> dict[str, int]:
        """A ZRANGE WITHSCORES reply as {order id: score}; members not UTF-8 are foreign."""
        members: dict[str, int] = {}
        for member, score in pairs:
            try:
                members[text_of(member)] = score_of(score)
            except UnicodeDecodeError:
                self.foreign(self.key(user_id).encode("utf-8", "surrogatepass"), "member")
        return members

    def foreign(self, key: bytes | str, what: str) -> None:
        """Count a piece of foreign data under the prefix; log each key once per process."""
        metrics.FOREIGN_KEYS.inc()
        self.foreign_seen += 1
        name = key if isinstance(key, bytes) else key.encode("utf-8", "surrogatepass")
        if name in self._foreign_logged or len(self._foreign_logged) >= _FOREIGN_LOG_CAP:
            return
        self._foreign_logged.add(name)
        log.warning(
            "skipping foreign data under the key prefix (%s): key %s",
            what,
            repr(name[:80]),
        )

    def reconcile_batch(
        self, wanted: dict[str, dict[str, int]], *, now_ms: int, dry_run: bool
    ) -> ReconcileBatch:
        """The calls that make each user's set hold exactly ``wanted[user]`` (order id ->
        expiry, best in expiry order: a right key then costs least) plus its extras: one
        ``reconcile.lua`` per user, packed, to be sent at once (see :class:`ReconcileBatch`).

        Expired members go, wanted ones are added or re-scored; live members not wanted come
        back as extras, untouched. A dry run writes nothing.
        """
        head = (b"%d" % now_ms, b"1" if dry_run else b"0")
        packer = CallPacker(self._reconcile, head)
        prefix = self.key_prefix.encode()
        for user_id, orders in wanted.items():
            packer.add_pairs(prefix + user_id.encode(), orders)
        return ReconcileBatch(
            self.client, list(wanted), packer, user_key=self.key, foreign=self.foreign
        )

    def remove_members(self, members: list[tuple[str, str]]) -> None:
        """ZREM each (user id, order id), in one pipelined round trip."""
        if not members:
            return
        with redis_errors("remove_members"):
            pipe = self.client.pipeline(transaction=False)
            for user_id, order_id in members:
                pipe.zrem(self.key(user_id), order_id)
            pipe.execute()
