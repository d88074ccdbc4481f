"""What the active sweeper does while an incident pause is open: nothing, and says so.

The sweep statements would close nothing anyway (the pause is one of their conditions), so
the sweeper skips them, reports the pause as a gauge (the alert rules then hold the backlog
alerts and watch the pause's age instead) and logs its start and end once each.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from orders import metrics
from orders.sql.pauses import Pause


class PauseWatch:
    """Reads the open pause each tick; ``log`` writes one sweeper log line."""

    def __init__(
        self,
        current: Callable[[], Pause | None],
        log: Callable[..., None],
    ) -> None:
        self.current = current
        self.log = log
        self.paused_by: int | None = None

    def paused(self) -> bool:
        """Whether a pause is open now (raises StoreUnavailable like any read)."""
        pause = self.current()
        metrics.PAUSE_STARTED_TIMESTAMP.set(0 if pause is None else pause.started_at_ms / 1000)
        pause_id = None if pause is None else pause.id
        if pause_id != self.paused_by:
            self._edge(pause)
            self.paused_by = pause_id
        return pause is not None

    def _edge(self, pause: Pause | None) -> None:
        fields: dict[str, Any]
        if pause is None:
            self.log(logging.INFO, "pause_over", pause_id=self.paused_by)
            return
        fields = {"pause_id": pause.id, "reason": pause.reason, "since_ms": pause.started_at_ms}
        self.log(logging.WARNING, "paused", **fields)
