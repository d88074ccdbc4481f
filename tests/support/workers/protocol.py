"""The worker's side of the protocol :class:`tests.support.processes.ChildProcess` speaks:
``STOP`` (or the end of stdin) read in a thread, and the service closed at the end."""

from __future__ import annotations

import sys
import threading
from typing import Any


def stop_on_stdin() -> threading.Event:
    """An event set by ``STOP`` on stdin, or by the end of stdin (read in a thread)."""
    stop = threading.Event()

    def watch_stdin() -> None:
        for command in sys.stdin:
            if command.strip() == "STOP":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    return stop


def close_service(service: Any) -> None:
    """Close what a worker's service opened: the SQL pool and the Redis client."""
    service.engine.dispose()
    service.index.client.close()
