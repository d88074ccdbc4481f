"""A real webhook receiver on loopback: http.server in a thread, answering as the test says.

Each request takes the next scripted answer (the last one repeats): a status code, or
:class:`Late` (answer 200 after a delay), or :data:`HANG` (answer nothing until the test
ends). Every request is recorded with its headers and raw body.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Late:
    """Answer ``status`` after ``delay_s``."""

    delay_s: float
    status: int = 200


HANG = "hang"
Answer = int | Late | str


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


class Receiver:
    def __init__(self, *answers: Answer) -> None:
        self.answers: list[Answer] = list(answers) or [200]
        self.received: list[Received] = []
        self.lock = threading.Lock()
        #: Set when the test ends: hanging requests end too.
        self.release = threading.Event()
        self.url = ""

    def answer_with(self, *answers: Answer) -> None:
        with self.lock:
            self.answers = list(answers)

    def next_answer(self, received: Received) -> Answer:
        with self.lock:
            self.received.append(received)
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def handler_class(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            answer = receiver.next_answer(Received(self.path, dict(self.headers), body))
            if answer == HANG:
                receiver.release.wait(60)
                return
            status = answer
            if isinstance(answer, Late):
                receiver.release.wait(answer.delay_s)
                status = answer.status
            self.send_response(int(status))
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def running_receiver(*answers: Answer) -> Iterator[Receiver]:
    """A receiver listening on 127.0.0.1 (a free port) until the block ends."""
    receiver = Receiver(*answers)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_class(receiver))
    server.daemon_threads = True
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/orders"
    thread = threading.Thread(target=server.serve_forever, name="webhook-receiver")
    thread.start()
    try:
        yield receiver
    finally:
        receiver.release.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
