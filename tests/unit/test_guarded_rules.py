"""Rules that no other test guarded: which characters a user id refuses, the metadata limit
in bytes, and a password spilled into a URL's path.

Each test here is named by a break in ``scripts/drill_mutations_guarded.py`` that it must
catch (the mutation drill checks it does).
"""

from __future__ import annotations

import pytest

from orders.config.urls import SecretUrl, redact_url
from orders.errors import InvalidInput
from orders.validation import check_metadata, check_user_id

# --- user ids --------------------------------------------------------------------------------

#: Spelled out here, not read from orders.validation: a character dropped there must show.
REFUSED_IN_USER_IDS = ["{", "}", "*", "?", "[", "]", "\u2028", "\u2029"]


@pytest.mark.parametrize("ch", REFUSED_IN_USER_IDS, ids=lambda ch: f"U+{ord(ch):04X}")
def test_a_user_id_with_a_key_unsafe_or_line_separating_character_is_refused(ch: str) -> None:
    with pytest.raises(InvalidInput) as info:
        check_user_id(f"shop{ch}42", 128)
    assert info.value.field == "user_id"


def test_a_user_id_with_punctuation_outside_the_refused_set_is_kept() -> None:
    # The refusals above are about those characters, not about punctuation in general.
    assert check_user_id("shop(42)-a.b:c/d", 128) == "shop(42)-a.b:c/d"


# --- metadata ----------------------------------------------------------------------------------


def test_the_metadata_limit_counts_utf8_bytes_not_characters() -> None:
    # '{"n": "' + "€" * k + '"}': 9 ASCII bytes and k characters of 3 bytes each.
    limit = 9 + 3 * 100
    assert check_metadata({"n": "€" * 100}, limit) == {"n": "€" * 100}
    with pytest.raises(InvalidInput, match="bytes") as info:
        check_metadata({"n": "€" * 101}, limit)  # 110 characters, 312 bytes
    assert info.value.field == "metadata"


# --- secrets in URLs ----------------------------------------------------------------------------


def test_a_password_spilled_into_a_urls_path_is_hidden() -> None:
    # A password with a "/" typed without percent-encoding: the URL parser reads "app:12" as
    # user and port, and the rest of the password as the start of the path.
    raw = "postgresql://app:12/hunter2@db.example/shop"
    shown = [redact_url(raw), str(SecretUrl(raw)), repr(SecretUrl(raw)), f"{SecretUrl(raw)}"]
    assert redact_url(raw) == "postgresql://app:12/***"
    assert not [text for text in shown if "hunter2" in text]
    assert SecretUrl(raw).reveal() == raw


def test_a_plain_path_is_still_shown() -> None:
    assert redact_url("postgresql://app@db.example/shop") == "postgresql://app@db.example/shop"
