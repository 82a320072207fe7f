"""Real servers on 127.0.0.1 (ephemeral ports) for tests that talk HTTP over a socket.

``HttpServer`` serves routes from a ``ThreadingHTTPServer``; ``RawServer`` hands each accepted
socket to a function, for peers that misbehave below HTTP (never answer, trickle, hang up).
Both are context managers: leaving the block stops every thread they started.
"""

from __future__ import annotations

import contextlib
import http.server
import select
import socket
import threading
from types import TracebackType
from typing import Callable

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
HANDLER_TIMEOUT = 5.0  # no socket operation of a server thread blocks longer than this


def free_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound once by us, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def peer_hung_up(sock: socket.socket, within: float) -> bool:
    """Whether the client closed its end within ``within`` seconds (without sending more)."""
    readable, _, _ = select.select([sock], [], [], within)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:  # reset: the client closed with our data unread
        return True


class Handler(http.server.BaseHTTPRequestHandler):
    """Looks the path up in the server's routes; one request per connection."""

    protocol_version = "HTTP/1.1"
    timeout = HANDLER_TIMEOUT
    server: HttpServer

    def do_GET(self) -> None:
        self.server.requests.append((self.path, {k: v for k, v in self.headers.items()}))
        route = self.server.routes.get(self.path)
        if route is None:
            self.reply(404, b"404: Not Found\n", content_type="text/plain; charset=utf-8")
        else:
            route(self)

    def do_POST(self) -> None:
        self.do_GET()  # a route that takes a body reads it (Content-Length) itself

    def reply(
        self,
        status: int,
        body: bytes,
        *,
        content_type: str = PROMETHEUS_TEXT,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


Route = Callable[[Handler], None]


class HttpServer(http.server.ThreadingHTTPServer):
    """``routes`` maps a request path to a function answering it; ``requests`` records
    ``(path, headers)`` of every request received."""

    daemon_threads = False  # server_close() joins every handler thread
    block_on_close = True

    def __init__(self, routes: dict[str, Route] | None = None) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.routes: dict[str, Route] = dict(routes or {})
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.stop = threading.Event()  # set when the test ends; long routes watch it
        self.port: int = self.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> HttpServer:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop.set()
        self.shutdown()
        self.server_close()
        self._thread.join(HANDLER_TIMEOUT)


RawHandler = Callable[[socket.socket, threading.Event], None]


class RawServer:
    """Accepts TCP connections on 127.0.0.1 and runs ``handle(conn, stop)`` for each in its
    own thread; ``stop`` is set when the server closes. ``OSError`` (the client hung up) ends a
    handler quietly. ``connections`` counts the connections accepted."""

    def __init__(self, handle: RawHandler) -> None:
        self.handle = handle
        self.stop = threading.Event()
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> RawServer:
        self._acceptor.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop.set()
        self._acceptor.join(HANDLER_TIMEOUT)
        self._listener.close()
        for thread in self._threads:
            thread.join(HANDLER_TIMEOUT)

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _address = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            self.connections += 1
            conn.settimeout(HANDLER_TIMEOUT)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.handle(conn, self.stop)


def read_request(conn: socket.socket) -> bytes:
    """The request head (up to the blank line), read from a raw connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data
