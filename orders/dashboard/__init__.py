"""The live web dashboard: ``orders dashboard``, ``orders scheduler --dashboard-port`` (or
``--ops-port``), or mounted in a host application as ASGI.

``snapshot`` reads the figures from both stores, ``access`` decides who may see them,
``server`` answers the page, its assets and the live stream (and serves them on a port of
their own) and ``asgi`` carries the same routes to an ASGI host. :func:`start_dashboard` is
the one way the commands start it; :func:`asgi_app` the one way a host mounts it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from orders.dashboard.access import TOKEN_ENV, check_bind
from orders.dashboard.asgi import OperatorApp, asgi_app
from orders.dashboard.server import DEFAULT_REFRESH_S, Dashboard
from orders.httpd import Served
from orders.service import OrderService

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8090


def token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The dashboard token, or None when it is unset or empty (loopback only, then)."""
    return environ.get(TOKEN_ENV) or None


def start_dashboard(
    service: OrderService,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    token: str | None = None,
    refresh_s: float = DEFAULT_REFRESH_S,
    secure_cookie: bool = False,
) -> Served:
    """Serve the dashboard of ``service`` on ``host:port`` from a background thread.

    Refuses (:class:`~orders.errors.InvalidInput`) a non-loopback ``host`` without a token,
    a token under 16 characters and a port that cannot be bound, before serving anything.
    ``secure_cookie``: the login cookie is marked ``Secure`` (behind TLS).
    """
    dashboard = Dashboard(service, token=token, refresh_s=refresh_s, secure_cookie=secure_cookie)
    return dashboard.serve(host, port)


__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "Dashboard",
    "OperatorApp",
    "asgi_app",
    "check_bind",
    "start_dashboard",
    "token_from_env",
]
