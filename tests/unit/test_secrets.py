"""Passwords in connection settings never come out: not in a repr, a log line or an error.

The property test puts random passwords in every place a URL or DSN can carry one and
checks every way the settings get shown.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st

from orders.config import Settings
from orders.config.urls import redact_url
from orders.errors import InvalidInput
from orders.logs import JsonFormatter

#: Printable text of any script, plus the characters that mean something in a URL or DSN.
PASSWORDS = st.text(
    st.one_of(
        st.characters(blacklist_categories=("Cs", "Cc")),
        st.sampled_from("%@:/&=?# '\\+;"),
    ),
    min_size=4,
    max_size=40,
)


def libpq_quoted(value: str) -> str:
    """A libpq key/value DSN value: single-quoted, backslash and quote escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def placements(password: str) -> Iterator[tuple[str, str]]:
    """(setting, value) pairs that carry ``password`` the ways drivers accept it."""
    encoded = quote(password, safe="")
    yield "database_url", f"postgresql://app:{encoded}@db.example:5432/shop"
    yield "database_url", f"postgresql+psycopg://app@db.example/shop?password={encoded}"
    yield "database_url", f"postgresql://app@db.example/shop?sslmode=require&pass%77ord={encoded}"
    yield "database_url", f"host=db.example port=5432 dbname=shop password={libpq_quoted(password)}"
    yield "database_url", f"nosuchdb://app:{encoded}@db.example/shop"
    yield "redis_url", f"rediss://:{encoded}@cache.example:6380/0"
    yield "redis_url", f"redis://cache.example:6379/0?password={encoded}"
    yield "redis_url", f"redis://cache.example/0?pass%77ord={encoded}"
    yield "redis_url", f"unix:///run/redis.sock?db=0&password={encoded}"
    yield "redis_url", f"http://user:{encoded}@cache.example:6379/0"


def shown_everywhere(field: str, value: str) -> str:
    """Every rendering of settings holding ``value`` (or of the error refusing it)."""
    try:
        settings = Settings(**{field: value})  # type: ignore[arg-type]
    except InvalidInput as refused:
        texts = [str(refused), repr(refused)]
    else:
        url = getattr(settings, field)
        texts = [
            repr(settings),
            str(settings),
            f"{settings}",
            str(settings.describe()),
            repr(url),
            str(url),
            f"{url}",
            f"{url!r:>10}",
            logged("settings %s %r; url %s %r", settings, settings, url, url),
        ]
    texts.append(redact_url(value))
    return "\n".join(texts)


def logged(message: str, *args: object) -> str:
    """``message`` through the text and the JSON formatter of ``orders.logs``."""
    stream = io.StringIO()
    handlers = [logging.StreamHandler(stream), logging.StreamHandler(stream)]
    handlers[0].setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    handlers[1].setFormatter(JsonFormatter())
    logger = logging.getLogger("orders.test_secrets")
    for handler in handlers:
        logger.addHandler(handler)
    try:
        logger.warning(message, *args)
    finally:
        for handler in handlers:
            logger.removeHandler(handler)
    return stream.getvalue()


def baseline_text() -> str:
    """What is shown with an empty password: a password found in it is not a leak."""
    return "\n".join(shown_everywhere(field, value) for field, value in placements(""))


BASELINE = baseline_text()


@given(password=PASSWORDS)
@example(password="hunter2")
@example(password="p@ss:w/rd%41&x=y")
@example(password="pa ss'wo\\rd")
@example(password="pässwörd☃")
def test_no_rendering_of_settings_or_their_errors_contains_a_password(password: str) -> None:
    assume(password not in BASELINE and quote(password, safe="") not in BASELINE)
    for field, value in placements(password):
        text = shown_everywhere(field, value)
        assert password not in text, (field, value)
        assert quote(password, safe="") not in text, (field, value)
        assert quote(password) not in text, (field, value)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://default:s3cret@[::1]:6380/2", "rediss://default:***@[::1]:6380/2"),
        ("postgresql://app:s3cret@db/shop", "postgresql://app:***@db/shop"),
        ("postgresql://app@db/shop?pass%77ord=s3cret", "postgresql://app@db/shop?password=***"),
        ("redis://cache/0?password=s3cret&db=1", "redis://cache/0?password=***&db=***"),
        ("unix:///tmp/redis.sock", "unix:///tmp/redis.sock"),
        ("sqlite:////var/lib/orders.db", "sqlite:////var/lib/orders.db"),
        ("host=db port=5432 password=s3cret dbname=shop", "host=db port=5432 dbname=shop"),
        ("user=app password='s3 cret' host=db", "user=app host=db"),
    ],
)
def test_redact_url_keeps_what_helps_debugging_and_nothing_else(url: str, shown: str) -> None:
    assert redact_url(url) == shown
