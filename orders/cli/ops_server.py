"""``orders scheduler --ops-port``: /metrics, /healthz, /readyz and the dashboard on one port.

The server is bound before the stores are reached (a taken port ends the command at once,
as the other ports do): the probes and /metrics answer from the start, the probes saying
``starting`` until the scheduler is attached; the dashboard's paths join once the service
is built (404 before). The dashboard keeps its access rule (its token, and loopback only
without one); the probes and /metrics answer without a token, as on their own ports.
"""

from __future__ import annotations

from orders.dashboard import Dashboard, check_bind
from orders.httpd import Request, Response, Route, first_of, metrics_route, serve
from orders.scheduler.health import SchedulerHealth
from orders.service import OrderService


class OpsServer:
    """The one operator server of a scheduler process."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        health: SchedulerHealth | None = None,
        secure_cookie: bool = False,
    ) -> None:
        """Bind ``host:port`` now; ``health``: the scheduler's report if another port
        serves it already (else one of its own); ``secure_cookie``: the dashboard's login
        cookie is marked ``Secure`` (browsers reach it over HTTPS)."""
        check_bind(host, token)
        self.token = token
        self.secure_cookie = secure_cookie
        self.health = health or SchedulerHealth()
        self.dashboard: Dashboard | None = None
        self._routes: list[Route] = [self.health.route, metrics_route]
        self.served = serve(
            self._answer, host, port, name="orders-ops", field="ops_port", on_close=self._closing
        )

    @property
    def url(self) -> str:
        return self.served.url

    def add_dashboard(self, service: OrderService) -> None:
        """Serve the dashboard of ``service`` from now on."""
        self.dashboard = Dashboard(service, token=self.token, secure_cookie=self.secure_cookie)
        self._routes.append(self.dashboard.route)

    def close(self) -> None:
        self.served.close()

    def _answer(self, request: Request) -> Response:
        return first_of(*self._routes)(request)

    def _closing(self) -> None:
        if self.dashboard is not None:
            self.dashboard.closing.set()
