"""Webhooks: order events POSTed as signed JSON to a URL, and the receiver's check.

:class:`WebhookSender` is a handler for :class:`~orders.events.consumer.EventConsumer`: it
POSTs each event and raises :class:`WebhookDeliveryFailed` on a connection error, a
timeout or any answer outside 2xx, so the consumer retries the event with backoff, parks
it after its attempts and ``orders events requeue`` sends it again. Delivery is therefore
at least once: a receiver that answered 2xx too late, or whose answer was lost, gets the
event again. Each request carries the event id in ``Idempotency-Key`` (and in the body) so
a receiver can drop the duplicates.

Each request is signed the way Stripe signs its webhooks::

    Orders-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" with the secret>

``t`` is the time of this attempt (a retry is signed afresh), so a receiver can refuse
replays older than a tolerance: :func:`verify_signature` does both checks.

:func:`webhook_consumer` builds the consumer the scheduler runs from the settings
(``ORDERS_WEBHOOK_URL``, ``ORDERS_WEBHOOK_SECRET``, ``ORDERS_WEBHOOK_KINDS``,
``ORDERS_WEBHOOK_TIMEOUT_S``). The standard library's HTTP client does the POST (one small
request needs no dependency); redirects are not followed (a 3xx is a failure: a POST
turned into a GET would look delivered and be lost).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import urllib.request
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from http.client import HTTPException
from typing import Any
from urllib.error import HTTPError

from sqlalchemy import Engine

from orders.config import Settings
from orders.config.urls import Secret, SecretUrl, check_webhook_secret, check_webhook_url
from orders.config.values import parse_event_kinds
from orders.domain import Clock, EventKind, system_clock
from orders.errors import InvalidInput, OrdersError
from orders.events.consumer import EventConsumer
from orders.events.stream import OrderEvent
from orders.validation import check_seconds

SIGNATURE_HEADER = "Orders-Signature"
IDEMPOTENCY_HEADER = "Idempotency-Key"
#: The durable cursor (``orders events consumers``) of the configured webhook.
WEBHOOK_CONSUMER_NAME = "webhook"
#: How old (or how far ahead) a signature's ``t`` may be by default.
DEFAULT_TOLERANCE_S = 300


class WebhookDeliveryFailed(OrdersError):
    """The receiver was not reached in time or did not answer 2xx; the event is retried.

    ``status`` is the HTTP status when there was an answer (None: no answer). The message
    names the URL as :class:`~orders.config.urls.SecretUrl` shows it, never the secret.
    """

    def __init__(self, url: SecretUrl, problem: str, status: int | None = None) -> None:
        super().__init__(f"webhook POST to {url}: {problem}")
        self.status = status


class SignatureInvalid(OrdersError):
    """A webhook request whose ``Orders-Signature`` does not verify: refuse it (400).

    ``reason``: ``"malformed"`` (no ``t`` or no ``v1``), ``"mismatch"`` (no ``v1`` is the
    HMAC of this body with this secret) or ``"stale"`` (signed, but ``t`` is outside the
    tolerance: a replay, or a clock far off).
    """

    def __init__(self, reason: str, problem: str) -> None:
        super().__init__(f"webhook signature {reason}: {problem}")
        self.reason = reason


def sign(secret: str, timestamp_s: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``"<timestamp_s>.<body>"`` keyed with ``secret``."""
    message = str(timestamp_s).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def signature_header(secret: str, timestamp_s: int, body: bytes) -> str:
    """The ``Orders-Signature`` value of ``body`` sent at ``timestamp_s``."""
    return f"t={timestamp_s},v1={sign(secret, timestamp_s, body)}"


def verify_signature(
    secret: str | Secret,
    header: str | None,
    body: bytes,
    *,
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    now_s: float | None = None,
) -> int:
    """Check a webhook request: return its signing time ``t``, or raise
    :class:`SignatureInvalid`.

    ``body`` is the request body exactly as received (bytes, before any JSON parsing);
    ``header`` the ``Orders-Signature`` value (None when absent). The request verifies when
    one of its ``v1`` values equals the HMAC of ``"<t>.<body>"`` (compared in constant
    time) and ``t`` is within ``tolerance_s`` of ``now_s`` (the wall clock by default),
    either way. A receiver should also drop an event id it has seen (``Idempotency-Key``):
    a replay within the tolerance, or a retry, verifies.
    """
    key = secret.reveal() if isinstance(secret, Secret) else secret
    if not isinstance(key, str) or not key:
        raise InvalidInput("secret", "must be the webhook secret, a non-empty string")
    if not isinstance(body, bytes):
        raise InvalidInput("body", "must be the raw request body, as bytes")
    tolerance_s = check_seconds("tolerance_s", tolerance_s)
    timestamp_s, given = _parse_header(header)
    expected = sign(key, timestamp_s, body)
    if not any(hmac.compare_digest(expected, candidate) for candidate in given):
        raise SignatureInvalid("mismatch", "no v1 signature matches this body and secret")
    now = time.time() if now_s is None else now_s
    if abs(now - timestamp_s) > tolerance_s:
        raise SignatureInvalid("stale", f"signed {now - timestamp_s:.0f} s from now")
    return timestamp_s


def _parse_header(header: str | None) -> tuple[int, list[str]]:
    """``t`` and the ``v1`` values of a header; other schemes are ignored (as Stripe's)."""
    if not isinstance(header, str) or len(header) > 4096:
        raise SignatureInvalid("malformed", f"no {SIGNATURE_HEADER} header")
    timestamps, given = [], []
    for item in header.split(","):
        name, _, value = item.strip().partition("=")
        if name == "t":
            timestamps.append(value)
        elif name == "v1":
            given.append(value)
    if len(timestamps) != 1 or not timestamps[0].isascii() or not timestamps[0].isdigit():
        raise SignatureInvalid("malformed", "needs exactly one t=<unix seconds>")
    if not given:
        raise SignatureInvalid("malformed", "has no v1 signature")
    return int(timestamps[0]), given


def event_body(event: OrderEvent) -> bytes:
    """The JSON a receiver gets for ``event`` (UTF-8, keys sorted, no spaces)."""
    at = datetime.fromtimestamp(event.at_ms / 1000, UTC)
    payload: Mapping[str, Any] = {
        "id": event.id,
        "txid": event.txid,
        "kind": event.kind.value,
        "order_id": event.order_id,
        "user_id": event.user_id,
        "at_ms": event.at_ms,
        "at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "actor_kind": None if event.actor is None else event.actor.kind.value,
        "actor": None if event.actor is None else event.actor.name,
        "data": dict(event.data),
    }
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is an HTTPError like any other non-2xx (urllib would turn the POST
    into a GET without its body)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class WebhookSender:
    """POSTs each event it is called with to ``url``, signed with ``secret``.

    Use it as an :class:`~orders.events.consumer.EventConsumer` handler (or build the
    consumer with :func:`webhook_consumer`). ``timeout_s`` bounds the connect and each read
    of the answer (a receiver should answer at once and do its work afterwards). ``clock``
    gives the signing time in ms (the service's clock). Raises
    :class:`WebhookDeliveryFailed` unless the receiver answers 2xx. The secret is never in
    its repr, its errors or its logs.
    """

    def __init__(
        self,
        url: str | SecretUrl,
        secret: str | Secret,
        *,
        timeout_s: float = 5.0,
        clock: Clock | None = None,
    ) -> None:
        self.url = check_webhook_url(url.reveal() if isinstance(url, SecretUrl) else url)
        self.secret = check_webhook_secret(secret)
        self.timeout_s = check_seconds("timeout_s", timeout_s)
        self.clock = clock or system_clock
        # The environment's proxy settings apply (urllib's default handlers).
        self.opener = urllib.request.build_opener(_NoRedirects)

    def __repr__(self) -> str:
        return f"WebhookSender({self.url}, timeout_s={self.timeout_s})"

    def _problem(self, exc: BaseException) -> str:
        """What went wrong, without the library's text (which may quote the URL)."""
        # URLError wraps what failed at the connect (a refusal, a timeout) as its reason.
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            return f"no answer within {self.timeout_s} s"
        return f"not delivered ({type(reason).__name__})"

    def __call__(self, event: OrderEvent) -> None:
        body = event_body(event)
        timestamp_s = self.clock() // 1000
        # S310: the scheme was checked to be http or https (check_webhook_url).
        request = urllib.request.Request(  # noqa: S310
            self.url.reveal(),
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "User-Agent": "orders-webhook",
                IDEMPOTENCY_HEADER: str(event.id),
                SIGNATURE_HEADER: signature_header(self.secret.reveal(), timestamp_s, body),
            },
        )
        try:
            with self.opener.open(request, timeout=self.timeout_s) as response:
                status: int = response.status
        except HTTPError as answer:
            answer.close()
            raise WebhookDeliveryFailed(self.url, f"answered {answer.code}", answer.code) from None
        except (OSError, HTTPException) as exc:
            raise WebhookDeliveryFailed(self.url, self._problem(exc)) from None
        if not 200 <= status < 300:
            raise WebhookDeliveryFailed(self.url, f"answered {status}", status)


def webhook_consumer(
    engine: Engine,
    settings: Settings,
    *,
    clock: Clock | None = None,
    kinds: Iterable[EventKind] | None = None,
) -> EventConsumer | None:
    """The consumer the scheduler runs for ``settings.webhook_url`` (None when unset):
    named :data:`WEBHOOK_CONSUMER_NAME`, the settings' kinds (``kinds`` overrides them),
    timeout and ``event_max_attempts``.

    A new cursor starts at the oldest event retention kept: the first run sends every event
    the database holds.
    """
    if settings.webhook_url is None or settings.webhook_secret is None:
        return None
    sender = WebhookSender(
        settings.webhook_url,
        settings.webhook_secret,
        timeout_s=settings.webhook_timeout_s,
        clock=clock,
    )
    if kinds is None:
        kinds = parse_event_kinds("webhook_kinds", settings.webhook_kinds)
    return EventConsumer(
        engine,
        WEBHOOK_CONSUMER_NAME,
        sender,
        kinds=kinds,
        clock=clock,
        max_attempts=settings.event_max_attempts,
        start="oldest",
    )
