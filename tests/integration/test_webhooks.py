"""Webhooks against a real HTTP server on loopback that answers, fails, hangs and is late.

The consumer's retries move with the manual clock (the jitter draw is fixed at 1.0, so a
retry is due exactly ``backoff_s * 2**(n-1)`` later): nothing sleeps to wait for one. Only
the receiver's hang and lateness are real time, bounded by the sender's timeout.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, select

from orders.config import Settings
from orders.config.urls import Secret, SecretUrl
from orders.domain import EventKind
from orders.errors import InvalidInput
from orders.events.admin import ParkedAction, act_on_parked, list_parked
from orders.events.consumer import EventConsumer
from orders.events.webhooks import (
    IDEMPOTENCY_HEADER,
    SIGNATURE_HEADER,
    WEBHOOK_CONSUMER_NAME,
    SignatureInvalid,
    WebhookSender,
    verify_signature,
    webhook_consumer,
)
from orders.scheduler.jobs import WEBHOOK_JOB_ID, build_scheduler
from orders.scheduler.sweeper import Sweeper
from orders.service import OrderService
from orders.sql.models import retries_table
from tests.support.clocks import ManualClock
from tests.support.receiver import HANG, Late, Receiver, running_receiver

SECRET = "whsec-test-0123456789abcdef"
HOUR_S = 3600
#: Added to the sender's timeout for what a loaded machine may add to a timed-out call.
TIMEOUT_MARGIN_S = 3.0


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with running_receiver() as started:
        yield started


def consumer_for(
    engine: Engine,
    receiver: Receiver,
    clock: ManualClock,
    *,
    timeout_s: float = 5.0,
    max_attempts: int = 10,
    **options: Any,
) -> EventConsumer:
    sender = WebhookSender(receiver.url, SECRET, timeout_s=timeout_s, clock=clock)
    return EventConsumer(
        engine,
        WEBHOOK_CONSUMER_NAME,
        sender,
        clock=clock,
        backoff_s=1,
        max_attempts=max_attempts,
        rand=lambda: 1.0,
        **options,
        start="oldest",
    )


def retry_rows(engine: Engine) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(retries_table)).all()


def verified(receiver: Receiver, clock: ManualClock) -> list[dict[str, Any]]:
    """Every request's body, each checked with the receiver's helper."""
    bodies = []
    for request in receiver.received:
        verify_signature(
            SECRET, request.headers[SIGNATURE_HEADER], request.body, now_s=clock() / 1000
        )
        bodies.append(json.loads(request.body))
    return bodies


def test_an_event_arrives_as_signed_json_that_the_helper_verifies(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    order = service.create_unpaid_order("u1", metadata={"cart": "c-7"})
    consumer = consumer_for(engine, receiver, clock)

    result = consumer.run_once()

    assert (result.handled, result.failed) == (1, 0)
    [request] = receiver.received
    assert request.path == "/hooks/orders"
    assert request.headers["Content-Type"] == "application/json"
    signed_at = verify_signature(
        SECRET, request.headers[SIGNATURE_HEADER], request.body, now_s=clock() / 1000
    )
    assert signed_at == clock() // 1000
    body = json.loads(request.body)
    assert request.headers[IDEMPOTENCY_HEADER] == str(body["id"])
    assert body["kind"] == "created"
    assert (body["order_id"], body["user_id"]) == (order.id, "u1")
    assert body["at_ms"] == clock()
    assert body["at"] == "2027-01-15T08:00:00.000Z"
    assert body["actor_kind"] == "application"
    assert isinstance(body["data"], dict)
    # The same bytes under another secret, or altered, do not verify.
    with pytest.raises(SignatureInvalid) as forged:
        verify_signature(
            "another-secret-0123456789",
            request.headers[SIGNATURE_HEADER],
            request.body,
            now_s=clock() / 1000,
        )
    assert forged.value.reason == "mismatch"
    with pytest.raises(SignatureInvalid):
        verify_signature(
            SECRET,
            request.headers[SIGNATURE_HEADER],
            request.body.replace(b"u1", b"u2"),
            now_s=clock() / 1000,
        )


def test_a_receiver_answering_500_is_retried_after_its_backoff_and_then_delivered(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    receiver.answer_with(500, 200)
    service.create_unpaid_order("u1")
    consumer = consumer_for(engine, receiver, clock)

    first = consumer.run_once()
    [row] = retry_rows(engine)
    assert (first.handled, first.failed) == (0, 1)
    assert row.attempts == 1
    assert row.last_error.startswith("WebhookDeliveryFailed: webhook POST to http://127.0.0.1:")
    assert row.last_error.endswith("answered 500")
    assert row.next_at_ms == clock() + 1000  # backoff_s * 2**0, jitter draw 1.0

    clock.advance(ms=999)
    assert consumer.run_once().retried_ok == 0  # not due yet: nothing sent
    assert len(receiver.received) == 1
    clock.advance(ms=1)
    assert consumer.run_once().retried_ok == 1

    assert retry_rows(engine) == []
    first_try, second_try = receiver.received
    assert first_try.body == second_try.body
    assert first_try.headers[IDEMPOTENCY_HEADER] == second_try.headers[IDEMPOTENCY_HEADER]
    # Each try is signed at its own time, so a retry after the tolerance still verifies.
    assert first_try.headers[SIGNATURE_HEADER] != second_try.headers[SIGNATURE_HEADER]
    assert len(verified(receiver, clock)) == 2


def test_a_receiver_that_hangs_is_given_up_after_the_timeout_and_retried_later(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    receiver.answer_with(HANG, 200)
    service.create_unpaid_order("u1")
    consumer = consumer_for(engine, receiver, clock, timeout_s=0.5)

    started = time.monotonic()
    result = consumer.run_once()
    elapsed_s = time.monotonic() - started

    assert (result.handled, result.failed) == (0, 1)
    assert 0.5 <= elapsed_s < 0.5 + TIMEOUT_MARGIN_S, elapsed_s
    [row] = retry_rows(engine)
    assert row.last_error.endswith("no answer within 0.5 s")
    clock.advance(s=1)
    assert consumer.run_once().retried_ok == 1
    assert len(receiver.received) == 2


def test_a_receiver_answering_late_but_within_the_timeout_counts_as_delivered(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    receiver.answer_with(Late(delay_s=0.3))
    service.create_unpaid_order("u1")
    consumer = consumer_for(engine, receiver, clock, timeout_s=5)

    result = consumer.run_once()

    assert (result.handled, result.failed) == (1, 0)
    assert retry_rows(engine) == []


def test_an_unreachable_receiver_is_a_failure_to_retry(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    service.create_unpaid_order("u1")
    sender = WebhookSender("http://127.0.0.1:1/hooks", SECRET, timeout_s=2, clock=clock)
    consumer = EventConsumer(engine, WEBHOOK_CONSUMER_NAME, sender, clock=clock, start="oldest")

    assert consumer.run_once().failed == 1

    [row] = retry_rows(engine)
    assert row.last_error.startswith("WebhookDeliveryFailed: webhook POST to http://127.0.0.1:1")
    assert "not delivered" in row.last_error


def test_a_redirect_is_a_failure_not_a_delivery(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    receiver.answer_with(307)
    service.create_unpaid_order("u1")

    assert consumer_for(engine, receiver, clock).run_once().failed == 1
    assert retry_rows(engine)[0].last_error.endswith("answered 307")


def test_an_event_is_parked_after_its_attempts_and_delivered_once_requeued(
    service: OrderService, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    receiver.answer_with(503)
    service.create_unpaid_order("u1")
    # Created events only: the requeue writes a `requeued` event of its own.
    consumer = consumer_for(engine, receiver, clock, max_attempts=3, kinds=[EventKind.CREATED])

    parked = 0
    for _ in range(5):
        parked += consumer.run_once().parked
        clock.advance(s=HOUR_S)

    assert parked == 1
    assert len(receiver.received) == 3  # three attempts, then no more
    [entry] = list_parked(engine, consumer=WEBHOOK_CONSUMER_NAME)
    assert str(entry.last_error).endswith("answered 503")

    receiver.answer_with(200)
    act_on_parked(engine, ParkedAction.REQUEUE, WEBHOOK_CONSUMER_NAME, entry.event_id, clock=clock)
    assert consumer.run_once().retried_ok == 1

    assert list_parked(engine) == []
    assert retry_rows(engine) == []
    delivered = receiver.received[-1]
    assert json.loads(delivered.body)["id"] == entry.event_id
    assert {r.headers[IDEMPOTENCY_HEADER] for r in receiver.received} == {str(entry.event_id)}
    now_s = clock() / 1000
    verify_signature(SECRET, delivered.headers[SIGNATURE_HEADER], delivered.body, now_s=now_s)
    # The first try, signed hours ago, is refused now as a replay.
    first = receiver.received[0]
    with pytest.raises(SignatureInvalid) as replayed:
        verify_signature(SECRET, first.headers[SIGNATURE_HEADER], first.body, now_s=now_s)
    assert replayed.value.reason == "stale"


def test_only_the_configured_kinds_are_posted(
    make_service: Any, engine: Engine, clock: ManualClock, receiver: Receiver
) -> None:
    service: OrderService = make_service(
        webhook_url=receiver.url, webhook_secret=SECRET, webhook_kinds="paid, cancelled"
    )
    a = service.create_unpaid_order("u1")
    b = service.create_unpaid_order("u2")
    service.mark_paid(a.id)
    service.cancel_order(b.id)
    consumer = webhook_consumer(engine, service.settings, clock=clock)
    assert consumer is not None

    assert consumer.run_once().handled == 2

    assert [(b["kind"], b["order_id"]) for b in verified(receiver, clock)] == [
        ("paid", a.id),
        ("cancelled", b.id),
    ]


def test_the_scheduler_runs_the_webhook_job_when_a_url_is_set(
    make_service: Any, receiver: Receiver
) -> None:
    plain = Sweeper(make_service())
    assert WEBHOOK_JOB_ID not in {
        job.id for job in build_scheduler(plain, blocking=False).get_jobs()
    }
    plain.close()

    service = make_service(webhook_url=receiver.url, webhook_secret=SECRET)
    sweeper = Sweeper(service)
    scheduler = build_scheduler(sweeper, blocking=False)
    assert WEBHOOK_JOB_ID in {job.id for job in scheduler.get_jobs()}
    service.create_unpaid_order("u1")
    scheduler.start()
    try:
        deadline = time.monotonic() + 20
        while not receiver.received and time.monotonic() < deadline:
            receiver.release.wait(0.05)  # polling the receiver, not waiting for a retry
    finally:
        scheduler.shutdown(wait=True)
        sweeper.close()

    assert [json.loads(r.body)["kind"] for r in receiver.received][:1] == ["created"]


# --- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"webhook_url": "ftp://hooks.example/x", "webhook_secret": SECRET}, "webhook_url"),
        ({"webhook_url": "hooks.example/x", "webhook_secret": SECRET}, "webhook_url"),
        ({"webhook_url": "https:///x", "webhook_secret": SECRET}, "webhook_url"),
        ({"webhook_url": "https://a:b@hooks.example/x", "webhook_secret": SECRET}, "webhook_url"),
        ({"webhook_url": "https://hooks.example/x"}, "webhook_secret"),
        ({"webhook_secret": SECRET}, "webhook_url"),
        ({"webhook_url": "https://hooks.example/x", "webhook_secret": "x" * 15}, "webhook_secret"),
        ({"webhook_kinds": "closed,shipped"}, "webhook_kinds"),
        ({"webhook_timeout_s": 0}, "webhook_timeout_s"),
    ],
)
def test_bad_webhook_settings_are_invalid_input(settings: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        Settings(**settings)
    assert refused.value.field == field
    assert SECRET not in str(refused.value)


@pytest.mark.parametrize(
    ("url", "secret", "field"),
    [
        ("file:///etc/passwd", SECRET, "webhook_url"),
        ("https://hooks.example/x", "short", "webhook_secret"),
        ("https://hooks.example/x", 1234567890123456789, "webhook_secret"),
    ],
)
def test_the_sender_refuses_what_the_settings_refuse(url: str, secret: Any, field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        WebhookSender(url, secret)
    assert refused.value.field == field


def test_the_secret_is_never_shown(receiver: Receiver) -> None:
    settings = Settings(webhook_url=receiver.url + "?token=t0ken-value", webhook_secret=SECRET)
    sender = WebhookSender(settings.webhook_url, settings.webhook_secret)  # type: ignore[arg-type]
    shown = [repr(settings), str(settings.describe()), repr(sender), f"{settings.webhook_secret}"]
    assert not any(SECRET in text or "t0ken-value" in text for text in shown), shown
    assert settings.webhook_secret == Secret(SECRET)


def test_the_settings_come_from_the_environment(receiver: Receiver) -> None:
    settings = Settings.from_env(
        {
            "ORDERS_WEBHOOK_URL": receiver.url,
            "ORDERS_WEBHOOK_SECRET": SECRET,
            "ORDERS_WEBHOOK_KINDS": "closed",
            "ORDERS_WEBHOOK_TIMEOUT_S": "2.5",
        }
    )
    assert settings.webhook_url == SecretUrl(receiver.url)
    assert (settings.webhook_kinds, settings.webhook_timeout_s) == ("closed", 2.5)
    assert Settings().webhook_url is None
