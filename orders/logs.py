"""One JSON object per log line, for the ``orders`` command (``--log-format json``).

A record whose message is itself a JSON object (the scheduler's events) is merged into the
line; ``order_id`` and ``user_id`` passed as ``extra`` become fields. URLs are only ever
logged already redacted (``orders.config.urls.redact_url``), so nothing here filters secrets.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any

FIELDS = ("order_id", "user_id")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        message = record.getMessage()
        parsed: Any = None
        if message.startswith("{"):
            try:
                parsed = json.loads(message)
            except ValueError:
                parsed = None
        if isinstance(parsed, dict):
            line.update(parsed)
        else:
            line["message"] = message
        for name in FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info).splitlines()[-1]
        return json.dumps(line, default=str)
