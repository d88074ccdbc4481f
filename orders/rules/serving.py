"""Waiting lists served off the sweep's thread, so that serving never holds up a close.

A sweep batch that released units hands their resources to :class:`ServingThreads` and goes
on to its next batch at once: serving an entry is a whole create (Redis, then SQL), and a
batch of 500 closes may free units for 500 entries. The threads serve them meanwhile.

* A resource is always served by the same thread (its id's hash picks it), so its queue is
  walked by one thread at a time, first come, first served; different resources are served
  side by side (``WORKERS`` threads).
* A resource already queued is not queued twice: one walk serves every unit freed until it
  starts. Units freed while it walks queue it again.
* The threads start with the first resource handed over (a service that never serves a
  waiting list starts none) and stop at :meth:`ServingThreads.close`.
* A process that dies with resources queued loses nothing: the units stay free in SQL and
  the entries waiting, and the next recovery pass (the sweep's, at most a second later, or
  reconcile) finds them (:mod:`orders.rules.waiting`).
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from collections.abc import Callable, Iterable

log = logging.getLogger("orders.service")

#: Threads serving waiting lists, each for its share of the resources.
WORKERS = 4
_STOP = ""  # not a resource id (an id is never empty)


class ServingThreads:
    """Serves resources' waiting lists on threads of their own (module docstring)."""

    def __init__(self, serve: Callable[[list[str]], object], workers: int = WORKERS) -> None:
        self._serve = serve
        self._queues: list[queue.SimpleQueue[str]] = [queue.SimpleQueue() for _ in range(workers)]
        self._threads: list[threading.Thread] = []
        self._queued: set[str] = set()
        self._busy = 0
        self._idle = threading.Condition()
        self._closed = False

    def submit(self, resource_ids: Iterable[str]) -> None:
        """Queue the resources' waiting lists to be served (those queued already stay as
        they are); returns at once."""
        with self._idle:
            if self._closed:
                return
            fresh = [rid for rid in resource_ids if rid not in self._queued]
            if not fresh:
                return
            if not self._threads:
                self._start()
            self._queued.update(fresh)
            self._busy += len(fresh)
        for rid in fresh:
            self._queues[zlib.crc32(rid.encode()) % len(self._queues)].put(rid)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every resource handed over is served; False if ``timeout_s`` passed
        first (tests, and a host that wants its sweep's entries served before it goes on)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)

    def close(self) -> None:
        """Stop the threads once what is queued is served."""
        with self._idle:
            self._closed = True
            threads, self._threads = self._threads, []
        for worker in self._queues:
            worker.put(_STOP)
        for thread in threads:
            thread.join(30)

    def _start(self) -> None:
        for number, worker in enumerate(self._queues):
            thread = threading.Thread(
                target=self._run, args=(worker,), name=f"orders-waiting-{number}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, worker: queue.SimpleQueue[str]) -> None:
        while (rid := worker.get()) != _STOP:
            with self._idle:
                self._queued.discard(rid)  # units freed from now on queue it again
            try:
                self._serve([rid])
            except Exception:  # a thread that dies would serve its share no more
                log.exception("serving a waiting list failed", extra={"resource_id": rid})
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()
