"""The bookkeeping of a load run, shared by the synchronous and the asyncio workers and the
tests that run the same loads in process: thread-safe counts (:class:`Tally`), the work
split among threads or tasks, and which helper takes which order."""

from __future__ import annotations

import threading
import traceback
import zlib
from collections.abc import Callable
from typing import Any


def split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal integers (the first ones one larger)."""
    return [total // parts + (1 if n < total % parts else 0) for n in range(parts)]


def bucket(order_id: str) -> str:
    """Which helper in a ``contend`` run takes this order: ``pay``, ``cancel`` or ``expire``.

    A fixed split by a hash of the id, so every outcome happens and no two helpers chase the
    same order (two payers of one order still race: each worker has its own payer).
    """
    slot = zlib.crc32(order_id.encode()) % 10
    if slot < 4:
        return "pay"
    if slot < 6:
        return "cancel"
    return "expire"


class Tally:
    """Thread-safe counters, id lists and a few error samples, as one JSON object."""

    def __init__(self, **initial: Any) -> None:
        self._lock = threading.Lock()
        self.data: dict[str, Any] = {"errors": 0, "error_samples": [], **initial}

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.data[key] = self.data.get(key, 0) + n

    def append(self, key: str, value: Any) -> None:
        with self._lock:
            self.data.setdefault(key, []).append(value)

    def put(self, key: str, sub: str, value: Any) -> None:
        with self._lock:
            self.data.setdefault(key, {})[sub] = value

    def error(self, where: str, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.data["errors"] += 1
            if len(self.data["error_samples"]) < 10:
                self.data["error_samples"].append(f"{where}: {text}")


def run_threads(targets: list[Callable[[], None]], tally: Tally) -> None:
    """Run the targets in threads and wait; an escaping exception counts as an error."""

    def wrap(name: str, target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as exc:
                tally.error(f"{name} crashed", "".join(traceback.format_exception(exc))[-800:])

        return run

    threads = [
        threading.Thread(target=wrap(f"thread {n}", t), daemon=True) for n, t in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
