"""Clocks for the tests: ones the test moves, and the wall clock as the service reads it."""

from __future__ import annotations

import threading
import time

#: 2027-01-15T08:00:00Z: far from any edge, and every test starts at the same instant.
START_MS = 1_800_000_000_000


class ManualClock:
    """A clock the test moves by hand; thread-safe."""

    def __init__(self, start_ms: int = START_MS) -> None:
        self._now_ms = start_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._now_ms

    def advance(self, *, s: float = 0, ms: int = 0) -> int:
        with self._lock:
            self._now_ms += round(s * 1000) + ms
            return self._now_ms

    def set(self, now_ms: int) -> None:
        with self._lock:
            self._now_ms = now_ms


class RunningClock:
    """A clock that runs with real time from ``start_ms`` and jumps forward when the test
    says; thread-safe. For tests that measure real delays (a close lag) in the service's
    own milliseconds while still choosing when orders fall due."""

    def __init__(self, start_ms: int = START_MS) -> None:
        self._origin_s = time.monotonic()
        self._offset_ms = start_ms
        self._lock = threading.Lock()

    def __call__(self) -> int:
        with self._lock:
            return self._offset_ms + int((time.monotonic() - self._origin_s) * 1000)

    def advance_to(self, at_ms: int) -> None:
        """Jump to ``at_ms`` (never back): an order with ``expires_at_ms == at_ms`` is due."""
        with self._lock:
            now_ms = self._offset_ms + int((time.monotonic() - self._origin_s) * 1000)
            self._offset_ms += max(0, at_ms - now_ms)


def now_ms() -> int:
    """Wall-clock integer milliseconds: the same clock the service's default uses."""
    return time.time_ns() // 1_000_000


def sleep_until_ms(target_ms: int) -> None:
    delay = target_ms - now_ms()
    if delay > 0:
        time.sleep(delay / 1000)


class Monotonic:
    """A monotonic clock in seconds for a sweeper's log periods, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s
