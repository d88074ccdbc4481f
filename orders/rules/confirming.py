"""Committed creates told to Redis off the caller's thread, so a later refusal asks no SQL.

An admission leaves its start in the user's admissions hash (``admit.lua``): a refusal
names every member whose start is :data:`~orders.index.unpaid.SUSPECT_AFTER_MS` old and
still there, and asks SQL whether that create committed or died
(:meth:`~orders.rules.abandoning.Abandoner.clear_dead`). A create that committed drops its
entry here instead, so the common refusal (a user at the limit with orders a minute old)
stays one round trip with no SQL:

* the create, after its commit, queues (user id, order id) and returns at once; no round
  trip is added to it;
* one thread per service sends what is queued every :data:`CONFIRM_EVERY_S`, as one
  pipelined ``HDEL`` per user, well within the suspects' age;
* anything lost (the process dies or closes the service before the send, Redis fails it,
  more than :data:`MAX_QUEUED` queued) costs only speed: its entry stays, and the first
  refusal that names it asks SQL, as before. A create in the host's transaction is not
  queued (it commits with the host).

The thread starts with the first create queued (again in a forked child) and stops at
:meth:`Confirmations.close`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque

from orders.index.unpaid import UnpaidIndex

log = logging.getLogger("orders.index")

#: How often the queued confirmations are sent: well under the suspects' age (5 s).
CONFIRM_EVERY_S = 1.0
#: The sending thread's name (a test counting a call's round trips leaves its sends out).
CONFIRM_THREAD = "orders-confirm"
#: The most confirmations one round trip takes.
SEND_MAX = 1_000
#: Confirmations kept for the next send (about 150 bytes each); past it the oldest go.
MAX_QUEUED = 100_000


class Confirmations:
    """Queues committed creates and sends them to Redis on a thread (module docstring)."""

    #: Seconds between sends; None: no thread, only :meth:`send` sends (a test that reads
    #: the admissions hashes at a moment of its choosing sets it so, on the class).
    every_s: float | None = CONFIRM_EVERY_S

    def __init__(self, index: UnpaidIndex) -> None:
        self.index = index
        self._queued: deque[tuple[str, str]] = deque(maxlen=MAX_QUEUED)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def committed(self, user_id: str, order_id: str) -> None:
        """The create of ``order_id`` committed: its admission entry goes with the next send."""
        self._queued.append((user_id, order_id))
        if self._pid != os.getpid():
            self.start()

    def send(self) -> int:
        """Send what is queued now, :data:`SEND_MAX` a round trip per node; how many were
        sent (a failed send drops them: their refusals ask SQL, as the module docstring
        says)."""
        sent = 0
        while taken := self._take():
            try:
                self.index.confirm(taken)
            except Exception as exc:  # whatever it is, it costs only speed
                log.info(
                    "confirming %d creates failed; their refusals ask SQL: %s", len(taken), exc
                )
                return sent
            sent += len(taken)
        return sent

    def _take(self) -> list[tuple[str, str]]:
        taken: list[tuple[str, str]] = []
        try:
            while len(taken) < SEND_MAX:
                taken.append(self._queued.popleft())
        except IndexError:  # all taken (another send may have taken some)
            pass
        return taken

    def close(self) -> None:
        """Stop the thread. What is still queued is not sent: a closing service does not
        wait on Redis for it (its refusals ask SQL, as the module docstring says)."""
        self._stop.set()
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(30)

    def start(self) -> None:
        """Start the thread now (it starts with the first create queued otherwise); not
        after :meth:`close`, nor when :attr:`every_s` is None."""
        with self._lock:
            if self._pid == os.getpid() or self.every_s is None or self._stop.is_set():
                return
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._run, name=CONFIRM_THREAD, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.send()
