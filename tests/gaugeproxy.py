"""A proxy in front of a real vLLM whose /metrics keeps ``num_requests_running`` frozen at a
value: the frozen gauges of vLLM issue 22545 (every request aborted, the gauge still counting
some), which vLLM 0.32 on a CPU no longer shows by itself. Everything else, the probe's
completions included, reaches the real vLLM unchanged.

``python -m tests.gaugeproxy LISTEN_PORT UPSTREAM_PORT RUNNING``
"""

from __future__ import annotations

import http.client
import http.server
import re
import sys

RUNNING = re.compile(rb"^(vllm:num_requests_running(?:\{[^}]*\})?) \S+$", re.MULTILINE)


def handler(upstream: int, running: float) -> type[http.server.BaseHTTPRequestHandler]:
    class Proxy(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._forward(None)

        def do_POST(self) -> None:
            self._forward(self.rfile.read(int(self.headers.get("Content-Length", "0"))))

        def _forward(self, body: bytes | None) -> None:
            connection = http.client.HTTPConnection("127.0.0.1", upstream, timeout=120)
            try:
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                connection.request(self.command, self.path, body, headers)
                response = connection.getresponse()
                data = response.read()
            finally:
                connection.close()
            if self.path.startswith("/metrics"):
                data = RUNNING.sub(rb"\1 " + str(running).encode(), data)
            self.send_response(response.status)
            self.send_header("Content-Type", response.getheader("Content-Type", "text/plain"))
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Proxy


def main(argv: list[str]) -> None:
    listen, upstream, running = int(argv[0]), int(argv[1]), float(argv[2])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", listen), handler(upstream, running))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
