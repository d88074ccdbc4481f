"""Calls started together in threads, and what escaped them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable


def errors_of_threads(
    target: Callable[..., object], arguments: Iterable[tuple[object, ...]], timeout_s: float = 60
) -> list[BaseException]:
    """Runs ``target(*args)`` in a thread for each ``args``, all started before any is
    joined, and returns whatever each raised (in no particular order)."""
    errors: list[BaseException] = []

    def run(*args: object) -> None:
        try:
            target(*args)
        except BaseException as exc:  # the caller judges what escaped
            errors.append(exc)

    threads = [threading.Thread(target=run, args=args) for args in arguments]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return errors
