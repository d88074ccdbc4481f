"""Many admissions (``admit.lua``) in one round trip per node, for combined creates.

Each admission is the same script on the same keys as :meth:`UnpaidIndex.admit`, so each
is atomic on its user's keys as before; only the transport is shared. The calls are packed
by hand (:mod:`orders.index.pipeline`) and written at once; on a cluster, one batch per
node. A reply the server answered with an error (out of memory, an ACL) belongs to its call
alone: that call wrote nothing, the others stand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from orders.errors import StoreUnavailable
from orders.index.admissions import AdmitRequest, AdmitResult, admit_result
from orders.index.errors import ServerRefused, redis_errors
from orders.index.pipeline import CallPacker, send_calls
from orders.index.unpaid import UnpaidIndex


def _encoded(value: str | int) -> bytes:
    return value.encode() if isinstance(value, str) else b"%d" % value


def admit_all(
    index: UnpaidIndex, requests: Sequence[AdmitRequest]
) -> list[AdmitResult | ServerRefused]:
    """Each request's admission, in order; a call Redis refused comes back as the
    :class:`ServerRefused` it would have raised alone (nothing written for it).

    Raises :class:`StoreUnavailable` when the round trip itself failed (a timeout, a broken
    connection): then any of the scripts may have run, or may still run.
    """
    packer = CallPacker(index.admit_script, ())
    for request in requests:
        keys, args = index.admit_call(request)
        packer.add_call([key.encode() for key in keys], [_encoded(arg) for arg in args])
    with redis_errors("admit", refused=ServerRefused):
        replies: list[Any] = send_calls(index.client, packer).read()
    return [_result(reply) for reply in replies]


def _result(reply: Any) -> AdmitResult | ServerRefused:
    if not isinstance(reply, redis.RedisError):
        return admit_result(reply)
    try:
        with redis_errors("admit", refused=ServerRefused):
            raise reply
    except ServerRefused as refused:
        return refused
    except StoreUnavailable as failed:  # not an error reply: never expected per call
        return ServerRefused(failed.store, failed.detail)
