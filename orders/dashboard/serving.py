"""The operator pages on a port of their own: uvicorn serving :class:`OperatorApp` from a
thread, for ``orders dashboard`` and ``orders scheduler --ops-port``, on a socket bound
first (:func:`bind`), so a taken port or an address refused is a typed error before the
command reaches its stores. uvicorn installs no signal handler in its thread.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orders.dashboard.access import check_bind
from orders.dashboard.asgi import OperatorApp
from orders.dashboard.server import DEFAULT_REFRESH_S, Dashboard
from orders.errors import InvalidInput
from orders.probes import StoreHealth
from orders.service import OrderService
from orders.validation import check_count

if TYPE_CHECKING:
    import uvicorn

#: Connections (and requests in flight) at once; one more is answered 503 by uvicorn (its
#: ``limit_concurrency``).
MAX_CONNECTIONS = 64
#: How long a stop waits for requests in flight before it cancels them (uvicorn's
#: ``timeout_graceful_shutdown``); open streams end at once, at :meth:`Served.close`.
STOP_TIMEOUT_S = 5


@dataclass
class Served:
    """An app served by uvicorn from a thread: where it listens, and how to stop it."""

    app: OperatorApp
    server: uvicorn.Server
    thread: threading.Thread
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """End the open streams, stop uvicorn (it closes the socket) and wait for it."""
        self.app.close()
        self.server.should_exit = True
        self.thread.join()


def bind(host: str, port: int, *, field: str, token: str | None) -> socket.socket:
    """A socket listening on ``host:port`` (0: any free port) for pages guarded by
    ``token``: refused off loopback without one (:func:`check_bind`); a bad port, a bad
    address or a taken port is :class:`InvalidInput` on ``field``, the setting naming it."""
    check_bind(host, token)
    check_count(field, port, 0, 65535)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen()  # a client that comes before uvicorn is up waits in the backlog
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        raise InvalidInput(field, f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def serve(app: OperatorApp, sock: socket.socket) -> Served:
    """Serve ``app`` on ``sock`` (from :func:`bind`) with uvicorn from a daemon thread, once
    it has started; :meth:`Served.close` stops it. uvicorn logs only its warnings and
    errors (no access lines: a probe every second would flood the log)."""
    import uvicorn  # noqa: PLC0415 - only the commands that serve pay for it

    config = uvicorn.Config(
        app,
        loop="asyncio",  # never uvloop's policy, which would be set for the whole process
        ws="none",
        lifespan="off",  # Served.close closes the app
        log_config=None,  # the process's logging stays as the command set it
        log_level="warning",
        access_log=False,
        limit_concurrency=MAX_CONNECTIONS,
        timeout_graceful_shutdown=STOP_TIMEOUT_S,
    )
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="orders-pages", daemon=True
    )
    thread.start()
    while not server.started and thread.is_alive():
        thread.join(0.01)
    if not server.started:
        sock.close()
        raise RuntimeError(f"uvicorn did not start on {host}:{port} (see its log)")
    return Served(app, server, thread, host, port)


def start_dashboard(
    service: OrderService,
    sock: socket.socket,
    *,
    token: str | None = None,
    refresh_s: float = DEFAULT_REFRESH_S,
    secure_cookie: bool = False,
) -> Served:
    """Serve the dashboard of ``service`` guarded by ``token`` (None: open), the store
    probes and the metrics beside it, on ``sock`` (from :func:`bind`, given the same
    token). ``secure_cookie``: the login cookie is marked ``Secure`` (behind TLS)."""
    dashboard = Dashboard(service, token=token, refresh_s=refresh_s, secure_cookie=secure_cookie)
    return serve(OperatorApp(StoreHealth(service), dashboard), sock)
