"""The receiver's check of ``Orders-Signature``: what it accepts and why it refuses.

The known answer below was computed with ``hmac``/``hashlib`` directly, outside the
module, so a signing slip (another message layout, another hash) fails here.
"""

from __future__ import annotations

import pytest

from orders.config.urls import Secret
from orders.errors import InvalidInput
from orders.events.webhooks import SignatureInvalid, signature_header, verify_signature

SECRET = "whsec-test-0123456789abcdef"
BODY = b'{"id":1}'
SIGNED_AT_S = 1_800_000_000
#: HMAC-SHA256 of b'1800000000.{"id":1}' keyed with SECRET.
KNOWN_V1 = "2af3824b457683b86fb5d5f5f1d63f4f7efdf4b058baef153b1fb16efacbbf20"
HEADER = f"t={SIGNED_AT_S},v1={KNOWN_V1}"


def test_the_header_is_stripe_shaped_with_the_known_hmac() -> None:
    assert signature_header(SECRET, SIGNED_AT_S, BODY) == HEADER


@pytest.mark.parametrize("now_s", [SIGNED_AT_S, SIGNED_AT_S + 300, SIGNED_AT_S - 300])
def test_a_genuine_request_within_the_tolerance_verifies(now_s: int) -> None:
    assert verify_signature(SECRET, HEADER, BODY, now_s=now_s) == SIGNED_AT_S
    assert verify_signature(Secret(SECRET), HEADER, BODY, now_s=now_s) == SIGNED_AT_S


def test_any_matching_v1_among_several_verifies() -> None:
    header = f"t={SIGNED_AT_S},v1={'0' * 64},v0=ignored,v1={KNOWN_V1}"
    assert verify_signature(SECRET, header, BODY, now_s=SIGNED_AT_S) == SIGNED_AT_S


@pytest.mark.parametrize(
    ("secret", "header", "body"),
    [
        ("another-secret-0123456789", HEADER, BODY),
        (SECRET, HEADER, b'{"id":2}'),
        (SECRET, HEADER, BODY + b" "),
        (SECRET, f"t={SIGNED_AT_S + 1},v1={KNOWN_V1}", BODY),  # the time moved, not re-signed
        (SECRET, f"t={SIGNED_AT_S},v1={KNOWN_V1.upper()}", BODY),
        (SECRET, f"t={SIGNED_AT_S},v1={KNOWN_V1[:-1]}", BODY),
    ],
    ids=["other-secret", "other-body", "body-with-a-space", "moved-time", "upper", "cut"],
)
def test_a_forged_request_is_refused_as_a_mismatch(secret: str, header: str, body: bytes) -> None:
    with pytest.raises(SignatureInvalid) as refused:
        verify_signature(secret, header, body, now_s=SIGNED_AT_S)
    assert refused.value.reason == "mismatch"


@pytest.mark.parametrize("now_s", [SIGNED_AT_S + 301, SIGNED_AT_S - 301, SIGNED_AT_S + 86_400])
def test_a_genuine_but_old_or_far_future_request_is_refused_as_stale(now_s: int) -> None:
    with pytest.raises(SignatureInvalid) as refused:
        verify_signature(SECRET, HEADER, BODY, now_s=now_s)
    assert refused.value.reason == "stale"


def test_the_tolerance_is_the_callers() -> None:
    assert verify_signature(SECRET, HEADER, BODY, tolerance_s=3600, now_s=SIGNED_AT_S + 3600)
    with pytest.raises(SignatureInvalid):
        verify_signature(SECRET, HEADER, BODY, tolerance_s=10, now_s=SIGNED_AT_S + 11)


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        KNOWN_V1,
        f"v1={KNOWN_V1}",
        f"t={SIGNED_AT_S}",
        f"t=soon,v1={KNOWN_V1}",
        f"t=-{SIGNED_AT_S},v1={KNOWN_V1}",
        f"t={SIGNED_AT_S},t={SIGNED_AT_S},v1={KNOWN_V1}",
        "t=1," + "v1=0," * 2000,
    ],
)
def test_a_malformed_header_is_refused_as_malformed(header: str | None) -> None:
    with pytest.raises(SignatureInvalid) as refused:
        verify_signature(SECRET, header, BODY, now_s=SIGNED_AT_S)
    assert refused.value.reason == "malformed"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("", HEADER, BODY), "secret"),
        ((SECRET, HEADER, BODY.decode()), "body"),
    ],
)
def test_bad_arguments_are_invalid_input(args: tuple[object, ...], field: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        verify_signature(*args, now_s=SIGNED_AT_S)  # type: ignore[arg-type]
    assert refused.value.field == field


def test_a_refusal_never_shows_the_secret() -> None:
    with pytest.raises(SignatureInvalid) as refused:
        verify_signature(SECRET, HEADER, b"tampered", now_s=SIGNED_AT_S)
    assert SECRET not in str(refused.value)
    assert KNOWN_V1 not in str(refused.value)
