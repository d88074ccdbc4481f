"""orders.httpd: which addresses count as loopback, which ports are refused, and a server
that binds at once (a taken port is InvalidInput here, not an error in a thread later)."""

from __future__ import annotations

import http.client
import threading
import time
import urllib.error
import urllib.request

import pytest

from orders.errors import InvalidInput
from orders.httpd import QuietHandler, Served, check_port, is_loopback, send_json, serve


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_addresses(host: str) -> None:
    assert is_loopback(host) is True


@pytest.mark.parametrize(
    "host",
    ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", "localhost.example.com", ""],
)
def test_addresses_that_are_not_loopback(host: str) -> None:
    # A name other than localhost may resolve to anything: never taken as loopback.
    assert is_loopback(host) is False


@pytest.mark.parametrize("port", [0, 1, 8090, 65535])
def test_ports_accepted(port: int) -> None:
    assert check_port("health_port", port) == port


@pytest.mark.parametrize("port", [-1, 65536, True, 80.0, "8090", None])
def test_ports_refused_name_the_setting(port: object) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_port("health_port", port)
    assert refused.value.field == "health_port"


class Hello(QuietHandler):
    def do_GET(self) -> None:
        send_json(self, 200, {"hello": "world"})


def test_serve_binds_at_once_answers_and_a_taken_port_is_invalid_input() -> None:
    served = serve(Hello, "127.0.0.1", 0, name="test-httpd", field="test_port")
    try:
        assert served.port != 0
        assert served.url == f"http://127.0.0.1:{served.port}"
        with urllib.request.urlopen(served.url, timeout=5) as answer:
            assert answer.read() == b'{"hello": "world"}'
            assert answer.headers["Cache-Control"] == "no-store"
        with pytest.raises(InvalidInput) as taken:
            serve(Hello, "127.0.0.1", served.port, name="test-httpd-2", field="test_port")
        assert taken.value.field == "test_port"
        assert "cannot listen on 127.0.0.1:" in str(taken.value)
    finally:
        served.close()
    assert not served.thread.is_alive()
    again = serve(Hello, "127.0.0.1", served.port, name="test-httpd-3", field="test_port")
    again.close()  # closed: the port could be bound again


def test_serve_refuses_a_bad_port_before_binding() -> None:
    with pytest.raises(InvalidInput):
        serve(Hello, "127.0.0.1", 70_000, name="test-httpd", field="test_port")


class Held(QuietHandler):
    """Holds its connection (and thread) until the test releases it, like an event stream."""

    entered = threading.Semaphore(0)
    release = threading.Event()

    def do_GET(self) -> None:
        self.entered.release()
        self.release.wait(10)
        send_json(self, 200, {"held": True})


def test_connections_past_the_bound_get_a_503_at_once_and_a_freed_slot_serves_again() -> None:
    served = serve(Held, "127.0.0.1", 0, name="test-httpd", field="test_port", max_connections=2)
    Held.release.clear()
    held = [http.client.HTTPConnection("127.0.0.1", served.port, timeout=5) for _ in range(2)]
    again = [http.client.HTTPConnection("127.0.0.1", served.port, timeout=5) for _ in range(2)]
    extra = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    try:
        for conn in held:
            conn.request("GET", "/")
        # Both slots taken (each GET waits in its thread): the third is turned away at once.
        assert all(Held.entered.acquire(timeout=5) for _ in held)
        extra.request("GET", "/")
        refused = extra.getresponse()
        assert (refused.status, refused.read()) == (503, b"busy\n")
        assert refused.getheader("Retry-After") == "1"
        Held.release.set()
        for conn in held:
            assert conn.getresponse().status == 200
            conn.close()
        # A slot comes back when its connection's thread ends, just after the close.
        wait_until_served(served.url)
        wait_until_free(served, 2)
        Held.release.clear()
        for conn in again:
            conn.request("GET", "/")  # the slots came back: both are served, not refused
        assert all(Held.entered.acquire(timeout=5) for _ in again)
        Held.release.set()
        assert [conn.getresponse().status for conn in again] == [200, 200]
    finally:
        Held.release.set()
        for conn in [*held, *again, extra]:
            conn.close()
        served.close()


def wait_until_free(served: Served, slots: int, timeout_s: float = 10.0) -> None:
    """Until ``slots`` connection slots are free at once: every earlier connection's thread
    has ended (on a loaded machine, some time after its response)."""
    free: threading.BoundedSemaphore = served.server.slots  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout_s
    while True:
        taken = [free.acquire(blocking=False) for _ in range(slots)]
        for got in taken:
            if got:
                free.release()
        if all(taken):
            return
        assert time.monotonic() < deadline, "the slots did not come back"
        time.sleep(0.01)


def wait_until_served(url: str, timeout_s: float = 10.0) -> None:
    """Until a request gets its answer rather than the 503 of a full server."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                assert answer.status == 200
                return
        except urllib.error.HTTPError as busy:
            busy.close()
            if busy.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.01)
