"""The system's Chromium for the browser tests: where it is, and the flags it runs with."""

from __future__ import annotations

import os
import shutil

import pytest

#: Our flags on top of Playwright's own: no sandbox (CI runs as root), no GPU, and none of
#: Chromium's background requests, which would only wait on the closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str:
    """The Chromium to drive; skips (fails in CI) when there is none."""
    path = os.environ.get("ORDERS_CHROMIUM") or shutil.which("chromium")
    if path is None or not os.access(path, os.X_OK):
        reason = "no Chromium: install Debian's chromium or set ORDERS_CHROMIUM to its path"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the browser test must run in CI: {reason}")
        pytest.skip(reason)
    return path
