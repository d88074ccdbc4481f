"""Calls started together in threads, and what came of them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from orders.errors import OrdersError
from orders.service import OrderService
from tests.support.clocks import ManualClock


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


def outcomes_of_race(calls: Sequence[Callable[[], object]], timeout_s: float = 60) -> list[object]:
    """Runs each call in a thread of its own, all released together by a barrier once every
    thread has started; what each returned, or the :class:`OrdersError` it raised, in the
    order of ``calls``. Anything else raised (an assertion, a bug) is re-raised here."""
    barrier = threading.Barrier(len(calls), timeout=timeout_s)
    unset = object()
    outcomes: list[object] = [unset] * len(calls)

    def run(index: int) -> None:
        barrier.wait()
        try:
            outcomes[index] = calls[index]()
        except OrdersError as refused:
            outcomes[index] = refused

    errors = errors_of_threads(run, [(n,) for n in range(len(calls))], timeout_s)
    if errors:
        raise errors[0]
    unfinished = [n for n, outcome in enumerate(outcomes) if outcome is unset]
    assert not unfinished, f"calls {unfinished} of the race did not end in {timeout_s} s"
    return outcomes


def sweep_until(service: OrderService, stop: threading.Event) -> None:
    """A race's sweeper thread: sweeps every few ms until ``stop``."""
    while not stop.wait(0.005):
        service.sweep_expired()


def tick_until(clock: ManualClock, stop: threading.Event) -> None:
    """A race's clock thread: the injected clock moves 5 ms every 2 ms until ``stop``, so
    orders expire while the race runs."""
    while not stop.wait(0.002):
        clock.advance(ms=5)
