"""The orders operator pages (the dashboard, /healthz, /readyz, /metrics) inside a FastAPI
app, under /ops/orders: the same pages as ``orders dashboard``, on the host's own port.

Run it (ORDERS_* settings and ORDERS_DASHBOARD_TOKEN from the environment)::

    uvicorn operator_pages:build --factory --timeout-graceful-shutdown 5

then open http://127.0.0.1:8000/ops/orders/. In your own app, the two lines that matter are
``ops = asgi_app(...)`` and ``app.mount("/ops/orders", ops)``. An open page holds an event
stream, which uvicorn waits for at shutdown: ``--timeout-graceful-shutdown`` bounds the wait.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from orders.config import Settings
from orders.dashboard import OperatorApp, asgi_app


def host_app(ops: OperatorApp) -> FastAPI:
    """A FastAPI app with ``ops`` mounted under /ops/orders, closed with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            ops.close()  # a mounted app gets no lifespan of its own: the host ends it

    app = FastAPI(title="checkout operators", lifespan=lifespan)
    # The token's login form and bearer check guard the pages. Behind the host's own auth
    # (a dependency, a proxy), pass auth="host" instead of a token.
    app.mount("/ops/orders", ops)
    return app


def build() -> FastAPI:
    """The app on the configured stores (uvicorn's ``--factory``)."""
    token = os.environ["ORDERS_DASHBOARD_TOKEN"]
    return host_app(asgi_app(Settings.from_env(), token=token))
