"""The index epoch marker: how the scheduler tells that Redis lost or rewound its data.

A complete rebuild from SQL ends by writing ``<prefix>[index-epoch]`` on every primary as
``<rebuilt at ms>:<run_id>``, naming the server run it was written on. A marker that is
missing means its server lost its data; one naming another run means a restart or a
failover, perhaps from an older snapshot. Either makes the active scheduler rebuild.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from redis.exceptions import NoPermissionError

from orders.index.errors import redis_errors
from orders.index.nodes import REDIRECTIONS, RedisClient, marker_keys, marker_nodes

log = logging.getLogger("orders.index")  # the package's name: operators configure it


def text_of(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


class IndexEpoch(enum.Enum):
    """What the epoch markers say about the index (the worst of all primaries); the value
    names the reason of the rebuild it asks for."""

    INTACT = "intact"
    #: A marker is missing: its server lost its data (a restart without it, a flush).
    LOST = "index_lost"
    #: A marker names another server run: a restart or a failover, maybe from older data.
    REWOUND = "index_rewound"


def _epoch_value(marker: bytes) -> str:
    """A marker's value without its run id (a marker of an older version has none)."""
    value, _, _ = text_of(marker).rpartition(":")
    return value or text_of(marker)


class EpochMarker:
    """The marker of one index (its key prefix) on a redis-py client."""

    def __init__(self, client: RedisClient, *, key_prefix: str) -> None:
        self.client = client
        self.key_prefix = key_prefix
        self._info_refused = False

    def key(self) -> str:
        """The marker written after a complete rebuild from SQL (see :meth:`check`)."""
        return f"{self.key_prefix}[index-epoch]"

    def server_runs(self) -> dict[str, str]:
        """Each marker key with the ``run_id`` of the server holding it now ("" where INFO
        is refused): read before a rebuild, handed to :meth:`set` after it."""
        return {key: run for key, _, run in self._markers()}

    def check(self) -> IndexEpoch:
        """Whether the index may have lost or rewound data since the last complete rebuild.

        Every server start has a new ``run_id``, and a promoted replica has its own; the
        marker names the run it was written on. A marker that is missing means its server
        lost its data; one naming another run means that server restarted or failed over,
        perhaps from an older snapshot (a clean restart looks the same: it is rebuilt too).
        One pipelined round trip per primary (GET + ``INFO server``).
        """
        found = IndexEpoch.INTACT
        for _, value, run in self._markers():
            if value is None:
                return IndexEpoch.LOST
            if run and text_of(value).rpartition(":")[2] != run:
                found = IndexEpoch.REWOUND
        return found

    def get(self) -> str | None:
        """The value the last complete rebuild wrote (the run id left out); None when a
        marker is missing (on a cluster: on any primary)."""
        values = [value for _, value, _ in self._markers()]
        if any(value is None for value in values):
            return None
        return min(_epoch_value(value) for value in values if value is not None)

    def set(self, value: str, runs: dict[str, str] | None = None) -> None:
        """Write the marker on every primary as ``value:run_id``; ``runs`` (from
        :meth:`server_runs` before the rebuild) names the runs the rebuild wrote to: a
        server that restarted during it is then rebuilt again. None: the runs now."""
        runs = self.server_runs() if runs is None else runs
        with redis_errors("set_epoch"):
            for key in marker_keys(self.client, self.key()):
                self.client.set(key, f"{value}:{runs.get(key, '')}")

    def _markers(self) -> list[tuple[str, bytes | None, str]]:
        """(key, value, run_id of its server) of each marker: a redirected GET (a stale
        cluster map) counts as missing; a refused INFO gives "" (and one warning)."""
        found = []
        with redis_errors("check_epoch"):
            for node, key in marker_nodes(self.client, self.key()):
                pipe = node.pipeline(transaction=False)
                pipe.get(key)
                pipe.info("server")
                value, info = pipe.execute(raise_on_error=False)
                if isinstance(value, REDIRECTIONS):
                    value = None
                elif isinstance(value, Exception):
                    raise value
                found.append((key, value, self._run_id(info)))
        return found

    def _run_id(self, info: Any) -> str:
        if isinstance(info, NoPermissionError):
            if not self._info_refused:
                self._info_refused = True
                log.warning(
                    "redis refused INFO: a Redis restarted or failed over from an older "
                    "snapshot is not noticed until the scheduled rebuild (grant +info)"
                )
            return ""
        if isinstance(info, Exception):
            raise info
        return str(info["run_id"])
