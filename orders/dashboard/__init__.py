"""The operator pages: the live web dashboard beside ``/healthz``, ``/readyz`` and
``/metrics``, as one ASGI app that ``orders dashboard`` and ``orders scheduler --ops-port``
serve with uvicorn and that a host application mounts.

``snapshot`` reads the figures from both stores, ``access`` decides who may see them,
``server`` answers the page, its assets and the live stream, ``asgi`` is the app that
carries them with the probes and the metrics, and ``serving`` runs it on a port.
:func:`start_dashboard` is the one way the commands start the dashboard; :func:`asgi_app`
the one way a host mounts it.

May import: the service and everything below it; not ``orders.scheduler`` (a sibling: the
CLI composes the two).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orders.dashboard.access import TOKEN_ENV, check_bind
from orders.dashboard.asgi import OperatorApp, asgi_app
from orders.dashboard.server import Dashboard
from orders.dashboard.serving import Served, bind, serve, start_dashboard

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8090


def token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The dashboard token, or None when it is unset or empty (loopback only, then)."""
    return environ.get(TOKEN_ENV) or None


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "Dashboard",
    "OperatorApp",
    "Served",
    "asgi_app",
    "bind",
    "check_bind",
    "serve",
    "start_dashboard",
    "token_from_env",
]
