"""The threads a figure leaves running: none may outlive it.

A thread that an earlier figure left behind (the async service's call pool, the event
loop's executor, a scheduler's workers) competes for the GIL and the cores with the
figures after it, and its figures would no longer be measured alone: so after each figure
the bench closes what it started and waits for those threads to end, and the report names
any that did not (``threads_left``, benchmarks/README.md).
"""

from __future__ import annotations

import threading
import time

#: How long the bench waits for a figure's threads to end once it has closed their owners.
JOIN_TIMEOUT_S = 5.0


def running() -> set[int]:
    """The identities of the threads alive now."""
    return {thread.ident for thread in threading.enumerate() if thread.ident is not None}


def left_behind(before: set[int], timeout_s: float = JOIN_TIMEOUT_S) -> list[str]:
    """Names of the threads started since ``before`` that are still alive after waiting up
    to ``timeout_s`` in all for each to end (sorted: a stable report)."""
    deadline = time.monotonic() + timeout_s
    current = threading.current_thread()
    alive: list[str] = []
    for thread in threading.enumerate():
        if thread.ident in before or thread is current:
            continue
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            alive.append(thread.name)
    return sorted(alive)
