"""Reading a server-sent event stream as a browser's EventSource does."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def read_event(next_line: Callable[[], str]) -> dict[str, Any]:
    """The next ``overview`` event, from lines (without their newline) ``next_line`` gives."""
    kind = data = None
    while True:
        line = next_line()
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data is not None:
            assert kind == "overview"
            parsed: dict[str, Any] = json.loads(data)
            return parsed
