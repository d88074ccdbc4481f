"""redis-py's exceptions as the service's :class:`StoreUnavailable`, for every module of
the index (the admission index, the epoch marker, the lease, the heartbeat) and the
dashboard's Redis reads: one place decides what a caller is told."""

from __future__ import annotations

import ssl

import redis
from redis.exceptions import OutOfMemoryError

from orders import metrics
from orders.errors import StoreUnavailable


class ServerRefused(StoreUnavailable):
    """Redis answered the admission with an error (out of memory, an ACL refusal, ...):
    unlike a timeout or a broken connection, the script certainly wrote nothing. Only
    :meth:`UnpaidIndex.admit` raises it; the admission turns it into a plain
    :class:`StoreUnavailable` for its caller."""


class redis_errors:
    """redis-py's exceptions as :class:`StoreUnavailable`; an error Redis answered with is
    raised as ``refused`` (:class:`ServerRefused` where the caller needs to tell). A class,
    not a generator: it wraps every Redis call, the admission's among them."""

    __slots__ = ("action", "refused")

    def __init__(self, action: str, *, refused: type[StoreUnavailable] = StoreUnavailable) -> None:
        self.action = action
        self.refused = refused

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        action = self.action
        if isinstance(exc, redis.ResponseError):
            metrics.STORE_ERRORS.labels("redis").inc()
            if out_of_memory(exc):
                raise self.refused(
                    "redis", f"{action} failed: out of memory (maxmemory reached, noeviction)"
                ) from exc
            raise self.refused("redis", f"{action} failed: {type(exc).__name__}") from exc
        if isinstance(exc, redis.RedisError):
            metrics.STORE_ERRORS.labels("redis").inc()
            raise StoreUnavailable("redis", f"{action} failed: {failure(exc)}") from exc


def no_cluster_node(where: object, exc: BaseException) -> StoreUnavailable:
    """A cluster client could not read the slot map from the node ``where`` names (it does
    at once when built): the error to raise, ``from None`` (the cause may quote a URL)."""
    return StoreUnavailable("redis", f"no cluster node answered at {where} ({failure(exc)})")


def failure(exc: BaseException) -> str:
    """What went wrong, safe to show: the exception's class, or why a TLS handshake failed.

    redis-py raises a ConnectionError from the ``ssl`` error it met while connecting; a
    server certificate that does not verify (an unknown CA, a name that does not match)
    is a setting to fix, not an outage, so its reason is named. OpenSSL's reason names
    the check that failed (and the host name asked for), never a password.
    """
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"the server's TLS certificate did not verify ({cause.verify_message})"
        if isinstance(cause, ssl.SSLError):
            return f"TLS handshake failed ({cause.reason or type(cause).__name__})"
        cause = cause.__cause__ or cause.__context__
    return type(exc).__name__


def out_of_memory(exc: redis.ResponseError) -> bool:
    """Whether Redis refused a write for want of memory (maxmemory under noeviction).

    redis-py names the class when the reply starts with OOM (7.x passes a script's OOM on
    as it is); 6.2 wraps it in "ERR Error running script ...". Only the kind is shown to
    callers, never the text.
    """
    return isinstance(exc, OutOfMemoryError) or "OOM command not allowed" in str(exc)
