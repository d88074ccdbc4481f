"""``orders dashboard``: serve the live web dashboard until SIGTERM or SIGINT."""

from __future__ import annotations

import logging
import threading

import click

from orders.cli.app import cli_state, secure_cookie_option
from orders.dashboard import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    TOKEN_ENV,
    bind,
    start_dashboard,
    token_from_env,
)
from orders.dashboard.server import DEFAULT_REFRESH_S
from orders.scheduler.process import on_stop_signals
from orders.validation import check_seconds


@click.command()
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    envvar="ORDERS_DASHBOARD_HOST",
    show_envvar=True,
    help=f"Address to listen on; anything but loopback needs {TOKEN_ENV}.",
)
@click.option(
    "--port",
    type=int,
    default=DEFAULT_PORT,
    show_default=True,
    envvar="ORDERS_DASHBOARD_PORT",
    show_envvar=True,
    help="Port to listen on (0: any free port).",
)
@click.option(
    "--refresh",
    "refresh_s",
    type=float,
    default=DEFAULT_REFRESH_S,
    show_default=True,
    help="Seconds between live updates (the stores are read at most this often).",
)
@secure_cookie_option
@click.pass_context
def dashboard(
    ctx: click.Context, host: str, port: int, refresh_s: float, secure_cookie: bool
) -> None:
    """Serve the read-only live dashboard (token: ORDERS_DASHBOARD_TOKEN, never an option)."""
    token = token_from_env()
    # Refused settings and a taken port end here, before the stores are connected to.
    check_seconds("refresh_s", refresh_s)
    sock = bind(host, port, field="port", token=token)
    try:
        service = cli_state(ctx).service(long_running=True)
        served = start_dashboard(
            service, sock, token=token, refresh_s=refresh_s, secure_cookie=secure_cookie
        )
    except BaseException:
        sock.close()
        raise
    stop = threading.Event()
    logging.getLogger("orders.dashboard").info("dashboard on %s/", served.url)
    with on_stop_signals(stop.set):
        try:
            stop.wait()
        finally:
            served.close()
