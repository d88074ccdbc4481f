"""What tests print and read back: figures of a run, the text of log records."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from orders.bench.measure import percentile


def figures(values: Sequence[float]) -> str:
    """``min / p50 / p99 / max`` of ``values`` (nearest rank), for a test's printed report."""
    if not values:
        return "none"
    return " / ".join(
        f"{x:g}" for x in (min(values), percentile(values, 50), percentile(values, 99), max(values))
    )


def record_texts(records: Iterable[logging.LogRecord]) -> list[str]:
    """Each record's message, and its traceback when it has one: all a log would show."""
    texts = []
    formatter = logging.Formatter()
    for record in records:
        texts.append(record.getMessage())
        if record.exc_info:
            texts.append(formatter.formatException(record.exc_info))
    return texts
