"""The names of the index's keys: a user's set, the admissions hash and the rate set beside
it, a counted resource's two keys, and back from a key to its user or resource; the one
place each is built or read (see :mod:`orders.index.unpaid`, :mod:`orders.index.resources`)."""

from __future__ import annotations

import re

from orders.errors import InvalidInput
from orders.validation import USER_ID_MAX_LENGTH, check_resource_id, check_user_id


def text_of(value: bytes | str) -> str:
    """A key or member as text (UnicodeDecodeError when it is not UTF-8)."""
    return value.decode("utf-8") if isinstance(value, bytes) else value


#: Printable ASCII but space and ``{}*?[]``: ids made only of these pass check_user_id
#: (short enough), so a SCAN of millions of keys need not check them character by character.
_PLAIN_USER_ID = re.compile(rf"[!-)+->@-Z\\^-z|~]{{1,{USER_ID_MAX_LENGTH}}}")


def user_of(key: bytes | str, prefix_length: int) -> str | None:
    """The user id a key names, or None when no valid user id can be read from it."""
    try:
        user = text_of(key)[prefix_length:]
    except UnicodeDecodeError:
        return None
    if user.startswith("[") or _PLAIN_USER_ID.fullmatch(user):
        return user
    try:
        return check_user_id(user, USER_ID_MAX_LENGTH)
    except InvalidInput:
        return None


ADMITS_TAG = "[admits]"
#: The user's recent creates, for ``Settings.create_rate`` (see ``admit.lua``).
RATE_TAG = "[rate]"
#: The user's own limit, a copy of its ``oes_user_limits`` row (see ``admit.lua``).
LIMIT_TAG = "[limit]"


def hash_tag_of(key: str) -> str | None:
    """The part of ``key`` Redis Cluster hashes instead of the whole name, if any: the text
    between the first ``{`` and the first ``}`` after it, when not empty."""
    start = key.find("{")
    end = key.find("}", start + 1)
    if start < 0 or end < 0 or end == start + 1:
        return None
    return key[start + 1 : end]


def companion_key(user_key: str, key_prefix: str, tag: str) -> str:
    """The name of a key the service keeps beside a user's set (``tag`` says which: its
    :data:`ADMITS_TAG` hash, its :data:`RATE_TAG` set, its :data:`LIMIT_TAG` copy), the one
    place such a name is built.

    It must share the hash slot of ``user_key`` (both are KEYS of one script): its hash tag
    is the user key's own tag, else the whole user key. It starts with the prefix (a Redis
    ACL that grants ``~<prefix>*`` covers it) followed by ``[``, which names the service's
    own keys and which :meth:`UnpaidIndex.scan_users` leaves out of its pattern.
    """
    return companion_keys(user_key, key_prefix, (tag,))[0]


def companion_keys(user_key: str, key_prefix: str, tags: tuple[str, ...]) -> list[str]:
    """:func:`companion_key` of each of ``tags``, the user key's slot read once (an
    admission names three)."""
    slot_tag = hash_tag_of(user_key)
    if slot_tag is None:
        if "}" in user_key:
            raise InvalidInput("key_prefix", "must not contain { or }")
        slot_tag = user_key
    rest = "" if slot_tag == user_key else user_key
    return [f"{key_prefix}{tag}{{{slot_tag}}}{rest}" for tag in tags]


def admits_key(user_key: str, key_prefix: str) -> str:
    """The name of a user's admissions hash (see ``admit.lua``)."""
    return companion_key(user_key, key_prefix, ADMITS_TAG)


def limit_key(user_key: str, key_prefix: str) -> str:
    """The name of a user's own limit (see ``admit.lua``; SQL's ``oes_user_limits`` is the
    record, this a copy the admission script reads)."""
    return companion_key(user_key, key_prefix, LIMIT_TAG)


def user_of_limit_key(key: bytes | str, key_prefix: str) -> str | None:
    """The user a :func:`limit_key` names, or None when ``key`` is not one."""
    try:
        name = text_of(key)
    except UnicodeDecodeError:
        return None
    head = f"{key_prefix}{LIMIT_TAG}{{"
    if not name.startswith(head):
        return None
    hashed, sep, rest = name[len(head) :].partition("}")
    if not sep:
        return None
    user_key = rest or hashed
    if not user_key.startswith(key_prefix) or limit_key(user_key, key_prefix) != name:
        return None
    return user_of(user_key, len(key_prefix))


def glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN or KEYS pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


#: A counted resource's hash (``cap``, ``sold``, ``held``, ``o:<order id>`` -> units) and
#: its holds set (order id -> expiry ms), both hashed on the resource id (see
#: :mod:`orders.index.resources`).
RESOURCE_TAG = "[res]"
RESOURCE_HOLDS_TAG = "[resh]"
RESOURCE_UNITS_TAG = "[resu]"


def resource_keys(key_prefix: str, resource_id: str) -> tuple[str, str, str]:
    """The names of a resource's hash, holds set and units hash (its named units' holders),
    in one hash slot (the resource id is their hash tag: ``check_resource_id`` keeps ``{}``
    out of it); the one place they are built."""
    return (
        f"{key_prefix}{RESOURCE_TAG}{{{resource_id}}}",
        f"{key_prefix}{RESOURCE_HOLDS_TAG}{{{resource_id}}}",
        f"{key_prefix}{RESOURCE_UNITS_TAG}{{{resource_id}}}",
    )


def resource_build_keys(key_prefix: str, resource_id: str, token: str) -> tuple[str, str, str]:
    """The temporary keys a rebuild of the resource writes before renaming them over
    :func:`resource_keys` (same slot; ``token`` names the one rebuild, so a crashed one's
    leftovers, which expire, never mix with the next one's)."""
    return (
        f"{key_prefix}[resb:{token}]{{{resource_id}}}",
        f"{key_prefix}[reshb:{token}]{{{resource_id}}}",
        f"{key_prefix}[resub:{token}]{{{resource_id}}}",
    )


def resource_pattern(key_prefix: str) -> str:
    """The SCAN pattern of every resource's hash (one key a resource)."""
    return glob_escape(f"{key_prefix}{RESOURCE_TAG}{{") + "*}"


def resource_of(key: bytes | str, key_prefix: str) -> str | None:
    """The resource id a :func:`resource_keys` hash names, or None when ``key`` is not one
    (foreign data under the prefix)."""
    try:
        name = text_of(key)
    except UnicodeDecodeError:
        return None
    head = f"{key_prefix}{RESOURCE_TAG}{{"
    if not name.startswith(head) or not name.endswith("}"):
        return None
    try:
        return check_resource_id(name[len(head) : -1])
    except InvalidInput:
        return None
