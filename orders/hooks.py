"""Host functions the service asks before it acts: the pre-close check and the late-payment
check, each under one rule.

A hook runs in a thread of the service's own, never in the caller's, and the caller waits
for it at most a time budget (``Settings.pre_close_timeout_s``). A hook that raises, or
has not answered within the budget, has *failed*: the caller then does what is safe
without its answer (the sweep closes the order; a late payment is refused). A hook that
hangs keeps its thread; once every thread hangs, later questions wait in the queue, run
out of budget and fail the same way, so a stuck hook can slow nothing beyond its budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from threading import Lock
from typing import Generic, TypeVar

log = logging.getLogger("orders.service")

Q = TypeVar("Q")
A = TypeVar("A")

#: Threads per runner: hooks that hang can hold at most this many.
HOOK_THREADS = 8


@dataclass(frozen=True, slots=True)
class Answer(Generic[Q, A]):
    """A hook's answer to one question; ``failed``: it raised or ran out of time (then
    ``value`` is None)."""

    question: Q
    value: A | None
    failed: bool


class HookRunner:
    """Asks host functions questions in threads of its own, within a time budget."""

    def __init__(self, thread_name: str) -> None:
        self.thread_name = thread_name
        self._executor: ThreadPoolExecutor | None = None
        self._lock = Lock()

    def ask(
        self, hook: Callable[[Q], A], questions: Sequence[Q], budget_s: float
    ) -> list[Answer[Q, A]]:
        """``hook(question)`` for each question, all within one budget of ``budget_s``."""
        futures: list[Future[A]] = [self._pool().submit(hook, q) for q in questions]
        done, _ = wait(futures, timeout=budget_s)
        answers: list[Answer[Q, A]] = []
        for question, future in zip(questions, futures, strict=True):
            if future not in done or future.exception() is not None:
                future.cancel()  # one still queued never runs
                answers.append(Answer(question, None, failed=True))
            else:
                answers.append(Answer(question, future.result(), failed=False))
        return answers

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    HOOK_THREADS, thread_name_prefix=self.thread_name
                )
            return self._executor

    def close(self) -> None:
        with self._lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
