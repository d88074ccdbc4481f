"""Hostile input at every public entry point, property-based.

The property, for every public function and every ``orders`` command: an input is either
refused with a typed error (InvalidInput or OrderNotFound; for the command, a non-zero exit
with one line on stderr and no traceback) before anything is written (the Redis keyspace,
the ``orders`` rows and the ``order_events`` rows are exactly as before), or it is stored
and returned exactly (same user id, order id, metadata, payment reference; the Redis key
is the prefix followed by the user id, nothing normalised). A refused value of eight
characters or more never shows in the error message or in any log record, and both stores
answer afterwards.

Fixtures are per test, not per example: every example takes its own before/after picture
of the stores instead of assuming they start empty.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
import redis
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, func, inspect, select

import orders
from orders import InvalidInput, Order, OrderNotFound, OrderService, OrderStatus
from orders.cli import main
from orders.config import Settings
from orders.events.consumer import EventPosition
from orders.index.keys import admits_key
from orders.sql.models import events_table, orders_table
from tests.support.reports import record_texts

PREFIX = "UnpaidOrder-"
MAX_TTL_MS = 7 * 24 * 3600 * 1000
#: The errors a refused input may raise. Anything else (ValueError, TypeError,
#: RecursionError, StoreUnavailable, ...) fails the property.
REFUSALS = (InvalidInput, OrderNotFound)
#: A refused value at least this long must not be echoed into messages or logs.
ECHO_MIN_LENGTH = 8

#: Random examples per property: 40 with --full (ORDERS_TEST_FULL=1), 20 otherwise (CI
#: time); the named hostile values below run as explicit examples either way.
FULL = os.environ.get("ORDERS_TEST_FULL") == "1"
HYPOTHESIS = settings(
    max_examples=40 if FULL else 20,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
CLI_HYPOTHESIS = settings(HYPOTHESIS, max_examples=25 if FULL else 12)

# --- named hostile values: each always runs as an explicit example ----------------------

NUL = "user\x00admin"
CRLF_FLUSHALL = "x\r\nFLUSHALL\r\n"
CRLF_DEL = "u1\r\nDEL UnpaidOrder-u1\r\n"
RESP_INLINE = "*1\r\n$8\r\nFLUSHALL\r\n"
LUA_CALL = "redis.call('FLUSHALL')"
LUA_CLOSE = "]]--"
LUA_BREAKOUT = "']]) redis.call('FLUSHALL') --[["
SQL_DROP = "'; DROP TABLE oes_orders; --"
SQL_OR = "' OR '1'='1"
SQL_EVENTS = "x'); DELETE FROM oes_order_events; --"
EMOJI = "👩‍💻🛒"
DECOMPOSED = "e\u0301"  # e + COMBINING ACUTE ACCENT
COMPOSED = "\u00e9"  # LATIN SMALL LETTER E WITH ACUTE
FULLWIDTH = "\uff55\uff53\uff45\uff52\uff11"  # NFKC-folds to "user1"
LONE_HIGH_SURROGATE = "\ud800"
LONE_LOW_SURROGATE = "ab\udc00cd"
HUGE = "x" * 1_000_000
HUGE_EMOJI = "💥" * 1_000_000
FORMAT_STRING = "%s%s%s%n{0}{}"
GLOB = "user*"
LEASE_KEY = "[sweeper-lease]"
EPOCH_KEY = "[index-epoch]"
BIDI = "\u202eevil-user"
ZERO_WIDTH = "\u200b"
LINE_SEPARATOR = "a\u2028b"
TERMINAL_ESCAPE = "\x1b[2J\x1b[31mred"
PATH_TRAVERSAL = "../../etc/passwd"
SHELL = "$(rm -rf /)`id`"
PADDED = " padded "
TAB = "a\tb"
BACKSLASH = "a\\b"
LONGEST_USER = "u" * 128
TOO_LONG_USER = "u" * 129

NAMED_TEXT = [
    NUL,
    CRLF_FLUSHALL,
    CRLF_DEL,
    RESP_INLINE,
    LUA_CALL,
    LUA_CLOSE,
    LUA_BREAKOUT,
    SQL_DROP,
    SQL_OR,
    SQL_EVENTS,
    EMOJI,
    DECOMPOSED,
    COMPOSED,
    FULLWIDTH,
    LONE_HIGH_SURROGATE,
    LONE_LOW_SURROGATE,
    HUGE,
    HUGE_EMOJI,
    FORMAT_STRING,
    GLOB,
    LEASE_KEY,
    EPOCH_KEY,
    BIDI,
    ZERO_WIDTH,
    LINE_SEPARATOR,
    TERMINAL_ESCAPE,
    PATH_TRAVERSAL,
    SHELL,
    PADDED,
    TAB,
    BACKSLASH,
    LONGEST_USER,
    TOO_LONG_USER,
    "",
    "   ",
    "\x00",
    "nan",
]

NAIVE_DATETIME = datetime(2027, 1, 15, 8, 0)  # naive on purpose
NAMED_WRONG_TYPES: list[object] = [
    None,
    True,
    False,
    NAIVE_DATETIME,
    datetime(2027, 1, 15, 8, 0, tzinfo=UTC),
    date(2027, 1, 15),
    timedelta(minutes=30),
    b"u1",
    bytearray(b"u1"),
    ["u1"],
    ("u1",),
    {"u1"},
    {"id": "u1"},
    object(),
    Fraction(1, 3),
    1j,
    10**5000,  # str() of it raises ValueError (CPython's 4,300-digit bound)
]

NAMED_NUMBERS: list[object] = [
    math.nan,
    math.inf,
    -math.inf,
    -1,
    -1.5,
    -0.0,
    0,
    0.0,
    1e-9,
    5e-324,
    0.0005,
    1_800_000,  # 30 minutes, in milliseconds by mistake
    1_800_000.0,
    1_800_000_000_000,  # an epoch-milliseconds timestamp passed as a TTL
    2**53,
    2**63,
    2**64,
    10**30,
    10**5000,  # more digits than int->str conversion allows (4300)
    -(10**5000),
    1.7976931348623157e308,
    Decimal("NaN"),
    Decimal("sNaN"),
    Decimal("-Infinity"),
    Decimal("1e999"),  # finite, yet beyond any float
    True,
    False,
]


def _nested(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


def _circular() -> dict[str, object]:
    loop: dict[str, object] = {}
    loop["self"] = loop
    return loop


NAMED_METADATA: list[object] = [
    {"note": NUL},  # valid JSON ("\u0000"): must come back exactly
    {"note": CRLF_FLUSHALL, LUA_CALL: SQL_DROP, EMOJI: [DECOMPOSED, COMPOSED]},
    {DECOMPOSED: 1, COMPOSED: 2},  # two different keys
    {"note": LONE_HIGH_SURROGATE},
    {LONE_LOW_SURROGATE: 1},
    {"note": HUGE},
    {"x": math.nan},
    {"x": math.inf},
    {"x": -math.inf},
    {"x": 10**5000},
    {"x": 2**80},
    {"x": -0.0, "y": 5e-324, "z": 1.7976931348623157e308},
    {"x": Decimal("1.5")},
    {"when": NAIVE_DATETIME},
    {"t": (1, 2)},
    {"s": {1, 2}},
    {"b": b"bytes"},
    {1: "int key"},
    {None: "null key"},
    {True: "bool key"},
    {"deep": _nested(500)},
    {"deep": _nested(5000)},  # small as JSON, deeper than the recursion limit
    _circular(),
    "not a mapping",
    ["a", "list"],
    {},
    None,
]

# --- strategies -------------------------------------------------------------------------

DANGEROUS_FRAGMENTS = [
    "\x00",
    "\r\n",
    "\n",
    "\r",
    "\t",
    "\x1b",
    "\x7f",
    "\x85",
    "\u2028",
    "\u2029",
    "\ud800",
    "\udfff",
    "\ufffe",
    "\U0010ffff",
    "{",
    "}",
    "*",
    "?",
    "[",
    "]",
    "\\",
    "'",
    '"',
    ";",
    "--",
    "%",
    "$",
    "FLUSHALL",
    "redis.call('DEL', KEYS[1])",
    "]]",
    "e\u0301",
    "\u00e9",
    "👩‍💻",
    "\u200b",
    "\ufeff",
    " ",
]

every_character = st.characters(exclude_categories=[])  # surrogates and controls included
any_text = st.one_of(
    st.text(max_size=40),
    st.text(every_character, max_size=200),
    st.builds(
        lambda head, fragment, tail: head + fragment + tail,
        st.text(max_size=20),
        st.sampled_from(DANGEROUS_FRAGMENTS),
        st.text(max_size=20),
    ),
    st.builds(operator.mul, st.text(min_size=1, max_size=3), st.integers(100, 1_000_000)),
    st.sampled_from(NAMED_TEXT),
)
#: Text short enough to sit inside metadata without always breaking the size limit.
short_text = st.one_of(
    st.text(every_character, max_size=30),
    st.sampled_from([t for t in NAMED_TEXT if len(t) < 100]),
    st.sampled_from(DANGEROUS_FRAGMENTS),
)
wrong_types = st.one_of(
    st.none(),
    st.booleans(),
    st.binary(max_size=10),
    st.datetimes(),
    st.datetimes(timezones=st.just(UTC)),
    st.dates(),
    st.timedeltas(),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.text(max_size=3)),
    st.frozensets(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.fractions(),
    st.complex_numbers(),
    st.sampled_from(NAMED_WRONG_TYPES),
)
hostile_numbers = st.one_of(
    st.integers(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.decimals(),
    st.booleans(),
    st.sampled_from(NAMED_NUMBERS),
)
anything = st.one_of(any_text, wrong_types, hostile_numbers)
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        short_text,
    ),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(short_text, children, max_size=4)
    ),
    max_leaves=12,
)
hostile_metadata = st.one_of(
    st.dictionaries(short_text, json_values, max_size=6),
    st.dictionaries(st.one_of(st.integers(), st.booleans(), st.none()), json_values, max_size=2),
    st.dictionaries(short_text, st.one_of(wrong_types, st.floats()), min_size=1, max_size=2),
    wrong_types,
    any_text,
    st.sampled_from(NAMED_METADATA),
)


class Shown:
    """A hostile value with a short repr: hypothesis prints failing examples, and a
    million-character string (or an int too long for str()) must not flood the report."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        try:
            text = repr(self.value)
        except (ValueError, RecursionError):  # an int beyond the digit limit, deep nesting
            return f"<{type(self.value).__name__} whose repr fails>"
        if len(text) > 120:
            return f"{text[:80]}...<{type(self.value).__name__}, repr of {len(text)} chars>"
        return text


def shown(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Shown]:
    return strategy.map(Shown)


#: Example arguments passed as they are. The others are hostile values: wrapped in Shown,
#: they reach the test as ``<name>_`` and the test unwraps them.
PLAIN_ARGUMENTS = frozenset({"field", "case"})


def examples(*cases: dict[str, Any]) -> Callable[[Any], Any]:
    """Apply one ``@example(**case)`` per case, in order, hostile values wrapped in Shown."""

    def decorate(test: Any) -> Any:
        for case in reversed(cases):
            wrapped = {
                key if key in PLAIN_ARGUMENTS else f"{key}_": value
                if key in PLAIN_ARGUMENTS
                else Shown(value)
                for key, value in case.items()
            }
            test = example(**wrapped)(test)
        return test

    return decorate


def each(name: str, values: Iterable[object]) -> list[dict[str, Any]]:
    return [{name: value} for value in values]


# --- the stores, before and after -------------------------------------------------------


class Stores:
    """Pictures of both stores, to prove that a refused call wrote nothing."""

    def __init__(self, engine: Engine, client: redis.Redis) -> None:
        self.engine = engine
        self.client = client

    def keys(self) -> set[bytes]:
        return set(self.client.scan_iter(count=1000))

    def picture(self) -> tuple[Any, ...]:
        assert self.client.ping()
        keys = sorted(self.keys())
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        types = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for key, kind in zip(keys, types, strict=True):
            if kind == b"zset":
                pipe.zrange(key, 0, -1, withscores=True)
            elif kind == b"hash":  # a user's admissions hash
                pipe.hgetall(key)
            else:
                pipe.get(key)
        values = pipe.execute()
        with self.engine.connect() as conn:
            query = select(orders_table).order_by(orders_table.c.id)
            rows = [tuple(r) for r in conn.execute(query)]
            events = conn.scalar(select(func.count()).select_from(events_table))
        # Injection must never create a key of its own.
        stray = [k for k in keys if not k.startswith(PREFIX.encode())]
        assert not stray, f"keys outside the prefix: {[k[:40] for k in stray]}"
        return (self.client.dbsize(), dict(zip(keys, values, strict=True)), rows, events)

    def counts(self) -> tuple[int, int, int]:
        with self.engine.connect() as conn:
            rows = conn.scalar(select(func.count()).select_from(orders_table))
            events = conn.scalar(select(func.count()).select_from(events_table))
        return self.client.dbsize(), int(rows or 0), int(events or 0)

    def assert_healthy(self) -> None:
        assert self.client.ping()
        tables = inspect(self.engine).get_table_names()
        assert {orders_table.name, events_table.name} <= set(tables)
        with self.engine.connect() as conn:
            conn.scalar(select(func.count()).select_from(orders_table))


@pytest.fixture
def stores(engine: Engine, redis_client: redis.Redis) -> Iterator[Stores]:
    s = Stores(engine, redis_client)
    yield s
    s.assert_healthy()


@pytest.fixture
def api(service: OrderService) -> Iterator[Any]:
    """The module-level functions of ``orders``, bound to the test's service."""
    orders.configure(service)
    try:
        yield orders
    finally:
        orders.configure(None)


_fresh = itertools.count()


def fresh_user(tag: str) -> str:
    return f"{tag}-{next(_fresh)}"


def long_strings(values: Iterable[object]) -> Iterator[str]:
    """Every string of ECHO_MIN_LENGTH characters or more inside ``values``: iterative, so
    deep nesting and cycles are walked too (up to a bound)."""
    pending = list(values)
    seen: set[int] = set()
    while pending and len(seen) < 10_000:
        value = pending.pop()
        if isinstance(value, str):
            if len(value) >= ECHO_MIN_LENGTH:
                yield value
        elif isinstance(value, dict | list | tuple | set | frozenset):
            if id(value) in seen:
                continue
            seen.add(id(value))
            items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
            pending.extend(list(items)[:100])


def assert_not_echoed(values: Iterable[object], texts: Iterable[str]) -> None:
    texts = list(texts)
    for value in long_strings(values):
        for text in texts:
            assert value not in text, f"raw input {value[:30]!r}... echoed in {text[:200]!r}"


class Call:
    """One call of the API under the property, with its before picture and log position."""

    def __init__(self, stores: Stores, logs: pytest.LogCaptureFixture, *inputs: object) -> None:
        self.stores = stores
        self.logs = logs
        self.inputs = list(inputs)
        self.before = stores.picture()
        self.first_record = len(logs.records)

    def run(self, function: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        try:
            return function(), None
        except REFUSALS as exc:
            self.assert_refused_cleanly(exc)
            return None, exc

    def assert_refused_cleanly(self, exc: BaseException) -> None:
        assert self.stores.picture() == self.before, "a refused call changed a store"
        self.assert_quiet(str(exc))

    def assert_quiet(self, *texts: str) -> None:
        new_records = self.logs.records[self.first_record :]
        assert_not_echoed(self.inputs, [*texts, *record_texts(new_records)])


def assert_indexed_exactly(
    client: redis.Redis, user_id: str, order_id: str, expires_at_ms: int
) -> None:
    """The member sits in the key named by the prefix and the exact user id."""
    score = client.zscore(PREFIX + user_id, order_id)
    assert score is not None, "no member under prefix + user id"
    assert score == expires_at_ms
    assert float(score).is_integer()


# --- create_unpaid_order ----------------------------------------------------------------


@HYPOTHESIS
@given(user_id_=shown(anything))
@examples(*each("user_id", [*NAMED_TEXT, *NAMED_WRONG_TYPES, *NAMED_NUMBERS]))
def test_create_with_any_user_id_refuses_cleanly_or_stores_it_exactly(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    user_id_: Shown,
) -> None:  # fmt: skip
    user_id = user_id_.value
    call = Call(stores, logs, user_id)
    order, _ = call.run(lambda: api.create_unpaid_order(user_id, limit=1000))
    if order is None:
        return
    assert isinstance(user_id, str | int)
    assert not isinstance(user_id, bool)
    expected = user_id if isinstance(user_id, str) else str(user_id)
    assert type(order.user_id) is str
    assert order.user_id == expected
    assert api.get_order(order.id) == order
    assert order.id in [o.id for o in api.list_unpaid(expected)]
    assert_indexed_exactly(redis_client, expected, order.id, order.expires_at_ms)
    new_keys = stores.keys() - set(call.before[1])
    # The user's set, and the admissions hash the create wrote beside it.
    user_key = PREFIX + expected
    assert new_keys <= {user_key.encode("utf-8"), admits_key(user_key, PREFIX).encode("utf-8")}
    call.assert_quiet()


@HYPOTHESIS
@given(order_id_=shown(anything))
@examples(*each("order_id", [*NAMED_TEXT, *NAMED_WRONG_TYPES, *NAMED_NUMBERS]))
def test_create_with_any_order_id_refuses_cleanly_or_stores_it_exactly(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    order_id_: Shown,
) -> None:  # fmt: skip
    order_id = order_id_.value
    user = fresh_user("oid")
    call = Call(stores, logs, order_id)
    # A value drawn twice is another user's id the second time: OrderConflict, which is
    # an InvalidInput and must leave nothing behind either.
    order, _ = call.run(lambda: api.create_unpaid_order(user, order_id=order_id))
    if order is None:
        return
    assert order_id is None or isinstance(order_id, str)
    assert order.id == (order_id or order.id)
    assert api.get_order(order.id) == order
    assert_indexed_exactly(redis_client, user, order.id, order.expires_at_ms)
    call.assert_quiet()


TTL_AND_LIMIT_CASES = [
    *({"field": "ttl_s", "value": v} for v in [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, "1800"]),
    *({"field": "limit", "value": v} for v in [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, "3", 1, 1000]),
]


@HYPOTHESIS
@given(
    field=st.sampled_from(["ttl_s", "limit"]),
    value_=shown(st.one_of(hostile_numbers, wrong_types)),
)
@examples(*TTL_AND_LIMIT_CASES)
def test_create_with_any_ttl_or_limit_refuses_cleanly_or_uses_it_exactly(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    field: str, value_: Shown,
) -> None:  # fmt: skip
    value = value_.value
    user = fresh_user("num")
    call = Call(stores, logs, value)
    order, _ = call.run(lambda: api.create_unpaid_order(user, **{field: value}))
    if order is None:
        return
    assert not isinstance(value, bool), f"a bool was taken as {field}"
    ttl_ms = order.expires_at_ms - order.created_at_ms
    if value is None:  # the configured TTL and limit
        assert ttl_ms == 1_800_000
    elif field == "ttl_s":
        assert isinstance(value, int | float | Decimal)
        # Never a TTL in milliseconds (or a timestamp) taken as seconds: at most a week.
        assert 1 <= ttl_ms <= MAX_TTL_MS
        assert abs(ttl_ms - float(value) * 1000) <= 0.5 + 1e-6
    else:
        assert type(value) is int
        assert 1 <= value <= 1000
        assert ttl_ms == 1_800_000
    assert api.get_order(order.id) == order
    assert_indexed_exactly(redis_client, user, order.id, order.expires_at_ms)
    call.assert_quiet()


AMOUNT_CASES = [
    *({"amount": v, "currency": "EUR"} for v in [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, *NAMED_TEXT]),
    *({"amount": "1.00", "currency": v} for v in [*NAMED_TEXT, *NAMED_WRONG_TYPES, "eur", "EURO"]),
    {"amount": "1_000", "currency": "EUR"},
    {"amount": "١٢٣", "currency": "EUR"},  # Arabic-Indic digits: Decimal reads them
    {"amount": " 19.90 ", "currency": "EUR"},
    {"amount": "1e-8", "currency": "EUR"},
    {"amount": "0.000000001", "currency": "EUR"},
    {"amount": "1" * 21, "currency": "EUR"},
    {"amount": "9" * 20, "currency": "JPY"},
    {"amount": "-0", "currency": "EUR"},
    {"amount": None, "currency": "EUR"},
]


@HYPOTHESIS
@given(
    amount_=shown(st.one_of(st.none(), any_text, hostile_numbers, wrong_types)),
    currency_=shown(st.one_of(st.none(), st.just("EUR"), st.text(max_size=4), wrong_types)),
)
@examples(*AMOUNT_CASES)
def test_create_with_any_amount_and_currency_refuses_cleanly_or_stores_them_exactly(
    api: Any, stores: Stores, logs: pytest.LogCaptureFixture, amount_: Shown, currency_: Shown
) -> None:
    amount = amount_.value
    currency = currency_.value
    user = fresh_user("amt")
    call = Call(stores, logs, amount, currency)
    order, _ = call.run(lambda: api.create_unpaid_order(user, amount=amount, currency=currency))
    if order is None:
        return
    assert not isinstance(amount, bool | float)
    stored = api.get_order(order.id)
    assert stored == order
    if amount is None:
        assert stored.amount is None
    else:
        assert isinstance(amount, str | int | Decimal)
        assert stored.amount == Decimal(amount.strip() if isinstance(amount, str) else amount)
        assert stored.amount.is_finite()
        assert stored.amount >= 0
    assert stored.currency == currency
    call.assert_quiet()


@HYPOTHESIS
@given(metadata_=shown(hostile_metadata))
@examples(*each("metadata", NAMED_METADATA))
def test_create_with_any_metadata_refuses_cleanly_or_stores_it_exactly(
    api: Any, stores: Stores, logs: pytest.LogCaptureFixture, metadata_: Shown
) -> None:
    metadata = metadata_.value
    user = fresh_user("meta")
    call = Call(stores, logs, metadata)
    order, _ = call.run(lambda: api.create_unpaid_order(user, metadata=metadata))
    if order is None:
        return
    assert metadata is None or isinstance(metadata, dict)
    stored = api.get_order(order.id)
    assert stored == order
    expected = metadata or {}
    # Exactly: same keys and values, and the same JSON types (1, 1.0 and True differ).
    assert stored.metadata == expected
    assert json.dumps(stored.metadata, sort_keys=True) == json.dumps(expected, sort_keys=True)
    call.assert_quiet()


# --- pay, cancel ------------------------------------------------------------------------

PAIR_CASES = [{"order_id": v, "text": v} for v in [*NAMED_TEXT, *NAMED_WRONG_TYPES, 10**5000]]


def assert_made_up_id_refused(
    stores: Stores, logs: pytest.LogCaptureFixture, order_id: object, use: Callable[[], Any]
) -> None:
    """``use()`` with a made-up (and perhaps hostile) ``order_id`` is refused cleanly."""
    call = Call(stores, logs, order_id)
    result, _ = call.run(use)
    assert result is None, "a made-up order id was taken"


def end_with_any_text(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    order_id: object, text: object, end: Callable[..., Any], keyword: str, status: OrderStatus,
) -> Any:  # fmt: skip
    """The property for a transition out of unpaid (``end`` is mark_paid or cancel_order)
    with ``keyword=text``: a made-up ``order_id`` is refused; ``text`` is refused cleanly,
    the order left open, or the order ends in ``status``. Returns the ended order, or None."""
    user = fresh_user(status.value)
    target = api.create_unpaid_order(user)
    assert_made_up_id_refused(stores, logs, order_id, lambda: end(order_id))

    call = Call(stores, logs, text)
    ended, _ = call.run(lambda: end(target.id, **{keyword: text}))
    if ended is None:
        assert api.get_order(target.id).status is OrderStatus.UNPAID
        assert redis_client.zscore(PREFIX + user, target.id) is not None
        return None
    assert text is None or isinstance(text, str)
    stored = api.get_order(target.id)
    assert stored.status is status
    assert redis_client.zscore(PREFIX + user, target.id) is None
    call.assert_quiet()
    return stored


#: Each end of an unpaid order that takes a text: the text's keyword, the status it leaves,
#: and how the ended order keeps the text.
TEXT_ENDS: dict[str, tuple[str, OrderStatus, Callable[[Order, object], bool]]] = {
    "mark_paid": ("payment_ref", OrderStatus.PAID, lambda o, text: o.payment_ref == text),
    "cancel_order": (
        "reason",
        OrderStatus.CANCELLED,
        lambda o, text: o.close_reason == (text or "cancelled"),
    ),
}


@pytest.mark.parametrize("end", sorted(TEXT_ENDS))
@HYPOTHESIS
@given(order_id_=shown(anything), text_=shown(st.one_of(st.none(), anything)))
@examples(*PAIR_CASES)
def test_pay_or_cancel_with_any_order_id_or_text_refuses_cleanly_or_stores_it_exactly(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    end: str, order_id_: Shown, text_: Shown,
) -> None:  # fmt: skip
    keyword, status, keeps = TEXT_ENDS[end]
    ended = end_with_any_text(
        api, stores, redis_client, logs, order_id_.value, text_.value,
        getattr(api, end), keyword, status,
    )  # fmt: skip
    assert ended is None or keeps(ended, text_.value)


@HYPOTHESIS
@given(order_id_=shown(anything), extra_s_=shown(st.one_of(hostile_numbers, wrong_types)))
@examples(
    *({"order_id": v, "extra_s": v} for v in [*NAMED_TEXT, *NAMED_WRONG_TYPES]),
    *({"order_id": "", "extra_s": v} for v in NAMED_NUMBERS),
)
def test_extend_with_any_order_id_or_seconds_refuses_cleanly_or_moves_the_expiry_exactly(
    api: Any, stores: Stores, redis_client: redis.Redis, logs: pytest.LogCaptureFixture,
    order_id_: Shown, extra_s_: Shown,
) -> None:  # fmt: skip
    order_id, extra_s = order_id_.value, extra_s_.value
    user = fresh_user("extend")
    target = api.create_unpaid_order(user)
    assert_made_up_id_refused(stores, logs, order_id, lambda: api.extend_order(order_id, 60))

    call = Call(stores, logs, extra_s)
    extended, _ = call.run(lambda: api.extend_order(target.id, extra_s))
    if extended is None:
        assert api.get_order(target.id).expires_at_ms == target.expires_at_ms
        return
    assert isinstance(extra_s, int | float | Decimal)
    assert not isinstance(extra_s, bool)
    moved_ms = extended.expires_at_ms - target.expires_at_ms
    assert 1 <= moved_ms <= MAX_TTL_MS
    assert abs(moved_ms - float(extra_s) * 1000) <= 0.5 + 1e-6
    assert api.get_order(target.id) == extended
    assert_indexed_exactly(redis_client, user, target.id, extended.expires_at_ms)
    call.assert_quiet()


EVENT_POSITIONS: list[object] = [
    EventPosition(),
    EventPosition(-1, -1),
    EventPosition(2**63, 2**63),  # beyond BIGINT
    EventPosition(10**30, 10**30),
    EventPosition("x", "y"),  # type: ignore[arg-type]
    EventPosition(math.nan, math.inf),  # type: ignore[arg-type]
    (0, 0),
    {"txid": 0, "event_id": 0},
    "0:0",
    0,
]
event_positions = st.one_of(
    st.builds(EventPosition, st.integers(), st.integers()),
    st.builds(EventPosition, anything, anything),
    anything,
    st.sampled_from(EVENT_POSITIONS),
)


@HYPOTHESIS
@given(
    after_=shown(st.one_of(st.none(), event_positions)),
    limit_=shown(st.one_of(hostile_numbers, wrong_types)),
)
@examples(
    *({"after": v, "limit": 100} for v in [*EVENT_POSITIONS, *NAMED_WRONG_TYPES]),
    *({"after": None, "limit": v} for v in [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, "100"]),
)
def test_iter_events_with_any_position_or_limit_refuses_cleanly_or_reads_only(
    api: Any, stores: Stores, logs: pytest.LogCaptureFixture, after_: Shown, limit_: Shown
) -> None:
    after, limit = after_.value, limit_.value
    if not stores.counts()[1]:
        api.create_unpaid_order("evented")
    call = Call(stores, logs, after, limit)
    events, _ = call.run(lambda: api.iter_events(after=after, limit=limit))
    if events is not None:
        assert type(limit) is int
        assert 1 <= limit <= 10_000
        assert len(events) <= limit
    assert stores.picture() == call.before
    call.assert_quiet()


# --- reads, sweep, reconcile: never a write ---------------------------------------------


@HYPOTHESIS
@given(value_=shown(anything))
@examples(*each("value", [*NAMED_TEXT, *NAMED_WRONG_TYPES, *NAMED_NUMBERS]))
def test_reads_and_a_one_user_reconcile_with_any_id_write_nothing(
    api: Any, stores: Stores, logs: pytest.LogCaptureFixture, value_: Shown
) -> None:
    value = value_.value
    if not stores.counts()[1]:
        api.create_unpaid_order("reader")
    call = Call(stores, logs, value)

    found, _ = call.run(lambda: api.get_order(value))
    assert found is None, "a made-up order id was found"

    listed, _ = call.run(lambda: api.list_unpaid(value))
    if listed is not None:
        assert isinstance(value, str | int)
        assert not isinstance(value, bool)
        expected = value if isinstance(value, str) else str(value)
        assert all(o.user_id == expected for o in listed)

    if value is not None:  # None means every user: a full run (its own test below)
        report, _ = call.run(lambda: api.reconcile(user_id=value))
        if report is not None:
            assert report.fixes == 0

    assert stores.picture() == call.before
    call.assert_quiet()


SWEEP_FIELDS = ["now_ms", "batch_size", "max_batches"]
SWEEP_CASES = [
    {"field": field, "value": value}
    for field in SWEEP_FIELDS
    for value in [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, "100", "x"]
]


@HYPOTHESIS
@given(
    field=st.sampled_from(SWEEP_FIELDS),
    value_=shown(st.one_of(hostile_numbers, wrong_types, any_text)),
)
@examples(*SWEEP_CASES)
def test_sweep_with_any_argument_refuses_cleanly_or_closes_nothing_early(
    api: Any, service: OrderService, stores: Stores, logs: pytest.LogCaptureFixture,
    field: str, value_: Shown,
) -> None:  # fmt: skip
    value = value_.value
    if not stores.counts()[1]:
        api.create_unpaid_order("sweep-me-later")  # open: no valid sweep may close it
    call = Call(stores, logs, value)
    if field == "now_ms":
        result, _ = call.run(lambda: service.sweep_expired(now_ms=value))  # type: ignore[arg-type]
    else:
        result, _ = call.run(lambda: api.sweep_expired(**{field: value}))
    if result is not None:
        assert result.closed == 0
        assert stores.picture() == call.before
    call.assert_quiet()


@HYPOTHESIS
@given(chunk_size_=shown(st.one_of(hostile_numbers, wrong_types, any_text)))
@examples(*each("chunk_size", [*NAMED_NUMBERS, *NAMED_WRONG_TYPES, "500", 500]))
def test_full_reconcile_with_any_chunk_size_refuses_cleanly_or_changes_nothing(
    api: Any, service: OrderService, stores: Stores, logs: pytest.LogCaptureFixture,
    chunk_size_: Shown,
) -> None:  # fmt: skip
    chunk_size = chunk_size_.value
    if not stores.counts()[1]:
        api.create_unpaid_order("reconciled")
        service.reconcile()  # writes the epoch marker once; later runs rewrite it unchanged
    call = Call(stores, logs, chunk_size)
    report, _ = call.run(lambda: service.reconcile(chunk_size=chunk_size))  # type: ignore[arg-type]
    if report is not None:
        assert report.fixes == 0
        assert stores.picture() == call.before
    call.assert_quiet()


# --- Unicode: never normalised ----------------------------------------------------------


@pytest.mark.parametrize(
    ("one", "other"),
    [(DECOMPOSED, COMPOSED), (FULLWIDTH, "user1"), ("straße", "strasse"), ("A", "a")],
    ids=["nfd-vs-nfc", "fullwidth-vs-ascii", "eszett-vs-ss", "upper-vs-lower"],
)
def test_ids_that_look_alike_stay_different_users_and_orders(
    api: Any, stores: Stores, redis_client: redis.Redis, one: str, other: str
) -> None:
    first = api.create_unpaid_order(one, order_id=f"o-{one}", limit=1)
    second = api.create_unpaid_order(other, order_id=f"o-{other}", limit=1)

    assert first.id != second.id
    assert (api.get_order(f"o-{one}").user_id, api.get_order(f"o-{other}").user_id) == (one, other)
    assert [o.id for o in api.list_unpaid(one)] == [f"o-{one}"]
    assert [o.id for o in api.list_unpaid(other)] == [f"o-{other}"]
    assert redis_client.zrange(PREFIX + one, 0, -1) == [f"o-{one}".encode()]
    assert redis_client.zrange(PREFIX + other, 0, -1) == [f"o-{other}".encode()]
    # Two sets, and two admissions hashes beside them.
    user_keys = [PREFIX + one, PREFIX + other]
    expected = {*user_keys, *(admits_key(key, PREFIX) for key in user_keys)}
    assert stores.keys() == {key.encode() for key in expected}


# --- the command ------------------------------------------------------------------------


class Cli:
    """``orders ...`` in process against the test's stores, plus a real-time service for
    setting up orders the command then pays or cancels."""

    def __init__(self, database_url: str, redis_url: str, engine: Engine, client: redis.Redis):
        self.env = {"ORDERS_DATABASE_URL": database_url, "ORDERS_REDIS_URL": redis_url}
        self.service = OrderService(
            engine, client, Settings(database_url=database_url, redis_url=redis_url)
        )

    def __call__(self, *args: str) -> Result:
        return CliRunner().invoke(main, list(args), env=self.env)


@pytest.fixture
def cli(database_url: str, redis_url: str, engine: Engine, redis_client: redis.Redis) -> Cli:
    return Cli(database_url, redis_url, engine, redis_client)


#: Exit codes of a refusal: InvalidInput (and click's own usage errors), OrderNotFound,
#: UnpaidOrderLimitReached, OrderClosed, OrderAlreadyPaid, OrderConflict. 1 (a crash) and
#: 8 (a store failed) are bugs.
REFUSAL_EXIT_CODES = {2, 3, 4, 5, 6, 7}


def assert_refused_on_one_line(result: Result, value: str) -> None:
    assert result.exit_code in REFUSAL_EXIT_CODES, (result.exit_code, result.output[-500:])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    assert result.stderr.endswith("\n")
    assert result.stderr.count("\n") == 1, f"not one line: {result.stderr[:500]!r}"
    assert_not_echoed([value], [result.stderr])


def order_exists(service: OrderService, order_id: str) -> bool:
    try:
        service.get_order(order_id)
    except REFUSALS:
        return False
    return True


def run_cli_case(
    cli: Cli, stores: Stores, logs: pytest.LogCaptureFixture, case: str, value: str
) -> None:
    """Invoke one command with ``value`` in one argument position; check the property."""
    service = cli.service
    target_user = fresh_user("cli")
    target = None
    if case in ("pay --ref", "cancel --reason", "extend SECONDS"):
        target = service.create_unpaid_order(target_user)
    if case == "sweep --batch-size":
        service.sweep_expired()  # whatever is due now is closed before the picture
    argv = {
        "create USER": ["create", "--json", "--limit=1000", "--", value],
        "create --order-id": ["create", "--json", f"--order-id={value}", "--", target_user],
        "create --amount": ["create", "--json", f"--amount={value}", "--currency=EUR", "--", "c"],
        "create --currency": ["create", "--json", "--amount=1", f"--currency={value}", "--", "c"],
        "create --ttl": ["create", "--json", f"--ttl={value}", "--", target_user],
        "--actor create": [f"--actor={value}", "create", "--json", "--", target_user],
        "create --limit": ["create", "--json", f"--limit={value}", "--", target_user],
        "pay ORDER": ["pay", "--json", "--", value],
        "pay --ref": ["pay", "--json", f"--ref={value}", "--", target.id if target else ""],
        "cancel ORDER": ["cancel", "--json", "--", value],
        "cancel --reason": [
            "cancel",
            "--json",
            f"--reason={value}",
            "--",
            target.id if target else "",
        ],
        "show ORDER": ["show", "--json", "--", value],
        "extend ORDER": ["extend", "--json", "--", value, "60"],
        "extend SECONDS": ["extend", "--json", "--", target.id if target else "", value],
        "stats --window": ["stats", "--json", f"--window={value}"],
        "stats --ahead": ["stats", "--json", f"--ahead={value}"],
        "user USER": ["user", "--json", "--", value],
        "sweep --batch-size": ["sweep", "--json", f"--batch-size={value}"],
        "reconcile --user": ["reconcile", "--json", f"--user={value}"],
    }[case]

    # "create --order-id" examples may have made an order with this very id.
    known_id = case.endswith("ORDER") and order_exists(service, value)
    call = Call(stores, logs, value)
    result = cli(*argv)
    if result.exit_code != 0:
        assert_refused_on_one_line(result, value)
        assert stores.picture() == call.before, f"refused `{case}` changed a store"
        call.assert_quiet()
        return
    assert result.exception is None, repr(result.exception)
    out = json.loads(result.stdout)
    if case.startswith("create"):
        stored = service.get_order(out["id"])
        if case == "create USER":
            assert stored.user_id == value
            assert_indexed_exactly(stores.client, value, stored.id, stored.expires_at_ms)
        elif case == "create --order-id":
            assert stored.id == value
            assert_indexed_exactly(stores.client, target_user, value, stored.expires_at_ms)
        elif case == "create --amount":
            assert stored.amount == Decimal(value.strip())
        elif case == "create --currency":
            assert stored.currency == value
        elif case == "create --ttl":
            ttl_ms = stored.expires_at_ms - stored.created_at_ms
            assert 1 <= ttl_ms <= MAX_TTL_MS
            assert abs(ttl_ms - float(value) * 1000) <= 0.5 + 1e-6
        elif case == "create --limit":
            assert 1 <= int(value) <= 1000
    elif case == "--actor create":
        stored = service.get_order(out["id"])
        of_order = select(events_table.c.actor_kind, events_table.c.actor).where(
            events_table.c.order_id == stored.id
        )
        with stores.engine.connect() as conn:
            assert list(conn.execute(of_order).all()) == [("operator", value)]
    elif case == "pay --ref":
        assert target is not None
        assert service.get_order(target.id).payment_ref == value
    elif case == "cancel --reason":
        assert target is not None
        assert service.get_order(target.id).close_reason == (value or "cancelled")
    elif case == "extend SECONDS":
        assert target is not None
        moved_ms = service.get_order(target.id).expires_at_ms - target.expires_at_ms
        assert 1 <= moved_ms <= MAX_TTL_MS
        assert abs(moved_ms - float(value) * 1000) <= 0.5 + 1e-6
    elif case in ("pay ORDER", "cancel ORDER", "show ORDER", "extend ORDER"):
        assert known_id, f"`{case}` succeeded for a made-up order id"
        assert out["id"] == value
    else:  # user, sweep, reconcile --user, stats: read or repair only, nothing to repair
        if case == "user USER":
            assert all(o["user_id"] == value for o in out)
        if case == "sweep --batch-size":
            assert out["closed"] == 0
        assert stores.picture() == call.before
    call.assert_quiet()


CLI_TEXT_CASES = [
    "--actor create",
    "create USER",
    "create --order-id",
    "create --amount",
    "create --currency",
    "pay ORDER",
    "pay --ref",
    "cancel ORDER",
    "cancel --reason",
    "show ORDER",
    "extend ORDER",
    "user USER",
    "reconcile --user",
]
CLI_NUMBER_CASES = [
    "create --ttl",
    "create --limit",
    "extend SECONDS",
    "sweep --batch-size",
    "stats --window",
    "stats --ahead",
]
CLI_NAMED_TEXT = [
    NUL,
    CRLF_FLUSHALL,
    LUA_CALL,
    SQL_DROP,
    EMOJI,
    DECOMPOSED,
    LONE_HIGH_SURROGATE,
    HUGE,
    "",
]
CLI_NAMED_NUMBERS = [
    "nan",
    "inf",
    "-inf",
    "-1",
    "0",
    "0.0005",
    "1800000",
    "1e309",
    str(2**63 - 1),  # BIGINT's maximum, times 1000 for milliseconds
    "9" * 5000,
    "1.5",
    "true",
    "2027-01-15T08:00:00",
    SQL_DROP,
    CRLF_FLUSHALL,
    NUL,
    "",
]
cli_text = st.one_of(
    st.text(max_size=40),
    st.text(every_character, max_size=100),
    st.builds(
        lambda head, fragment, tail: head + fragment + tail,
        st.text(max_size=20),
        st.sampled_from(DANGEROUS_FRAGMENTS),
        st.text(max_size=20),
    ),
    st.sampled_from(CLI_NAMED_TEXT),
)
cli_number_text = st.one_of(
    st.integers().map(str),
    st.floats().map(repr),
    st.decimals().map(str),
    st.sampled_from(CLI_NAMED_NUMBERS),
    cli_text,
)


@CLI_HYPOTHESIS
@given(case=st.sampled_from(CLI_TEXT_CASES), value_=shown(cli_text))
@examples(*({"case": c, "value": v} for c in CLI_TEXT_CASES for v in CLI_NAMED_TEXT))
def test_cli_with_any_text_argument_refuses_on_one_line_or_stores_it_exactly(
    cli: Cli, stores: Stores, logs: pytest.LogCaptureFixture, case: str, value_: Shown
) -> None:
    value = value_.value
    run_cli_case(cli, stores, logs, case, value)


@CLI_HYPOTHESIS
@given(case=st.sampled_from(CLI_NUMBER_CASES), value_=shown(cli_number_text))
@examples(*({"case": c, "value": v} for c in CLI_NUMBER_CASES for v in CLI_NAMED_NUMBERS))
def test_cli_with_any_number_option_refuses_on_one_line_or_uses_it_exactly(
    cli: Cli, stores: Stores, logs: pytest.LogCaptureFixture, case: str, value_: Shown
) -> None:
    value = value_.value
    run_cli_case(cli, stores, logs, case, value)
