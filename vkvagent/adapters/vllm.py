"""HTTP client for one vLLM server: reads /metrics and /version within hard limits.

A vLLM that is loading, wedged or overloaded must never stall the agent. The connection, every
read and the whole exchange are bounded in time, and the body in size: a page over the limit
is refused, never silently truncated, and a compressed page is capped after decompression.

Built on the standard library's http.client rather than requests. requests bounds each read
but not the whole response, so a server trickling its headers a byte at a time could hold a
scrape for hours. Here a watchdog shuts the socket at the deadline (connect_timeout +
read_timeout), whatever phase the exchange is in; only a name lookup, if the URL has a host
name, is not bounded by it. It also honours no proxy variables, which must never reroute a
loopback scrape, and it costs 6 MiB less RSS.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import zlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from vkvagent import __version__
from vkvagent.apikey import ApiKey
from vkvagent.engine.samples import VllmMetrics
from vkvagent.errors import VkvagentError
from vkvagent.knowledge.config import VllmConfig, url_problem
from vkvagent.knowledge.vllm_metrics import ExpositionError, Normaliser

# Ask for the classic text format: vLLM serves it, and the normaliser reads it.
_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_CHUNK = 64 * 1024


class ScrapeError(VkvagentError):
    """vLLM could not be read; the message is one line naming the problem. ``silent``: the
    connection was accepted but no complete answer came in time (a hung server), as opposed
    to refused, reset or answered with an error. ``refused``: nothing listens. ``status``: the
    HTTP status of an answer that was not 200."""

    def __init__(
        self,
        message: str,
        *,
        silent: bool = False,
        refused: bool = False,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.silent, self.refused, self.status = silent, refused, status


class PageError(ScrapeError):
    """vLLM answered, but its page is not one the normaliser recognises."""


def base_url(url: str) -> str:
    """``http://host:port`` from a base URL or a full ``.../metrics`` URL."""
    problem = url_problem(url)
    if problem is not None:
        raise ScrapeError(problem)
    parts = urlsplit(url if "://" in url else f"http://{url}")
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[: -len("/metrics")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class VllmClient:
    """Reads one vLLM server: one short-lived connection per request."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 5.0,
        max_page_bytes: int = 8 * 1024 * 1024,
        model: str = "",
        ca_file: str = "",
        api_key: ApiKey | None = None,
    ) -> None:
        self.base = base_url(url)
        parts = urlsplit(self.base)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_page_bytes = max_page_bytes
        self.ca_file = ca_file  # the CA bundle that signed an https vLLM's certificate
        self.api_key = api_key  # sent as a bearer token with every request
        self._normaliser = Normaliser(model)

    @classmethod
    def from_config(cls, config: VllmConfig) -> VllmClient:
        return cls(
            config.url,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            max_page_bytes=config.max_page_bytes,
            model=config.model,
            ca_file=config.ca_file,
        )

    def scrape(self, version: str | None = None) -> VllmMetrics:
        """Fetch and normalise /metrics. ``version`` (from config or ``version()``) is reported
        with the result. Raises ScrapeError."""
        text = self.get_text("/metrics", accept=_ACCEPT)
        try:
            return self._normaliser.normalise(text, version)
        except ExpositionError as exc:
            raise PageError(f"{self.base}/metrics: {exc}") from None

    def version(self) -> str | None:
        """vLLM's version from GET /version, or None when it does not answer with one."""
        try:
            body: Any = json.loads(self.get_text("/version", accept="application/json"))
        except (ScrapeError, ValueError, RecursionError):  # RecursionError: absurdly nested
            return None
        found = body.get("version") if isinstance(body, dict) else None
        return found if isinstance(found, str) else None

    def get_text(self, path: str, accept: str) -> str:
        """GET ``path`` below the base URL; the body as text. Raises ScrapeError."""
        exchange = _Exchange(self, self.base + path)
        return exchange.run(self._prefix + path, accept)

    def post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST ``body`` as JSON to ``path``; the decoded JSON answer. Raises ScrapeError
        (an answer that is not JSON too)."""
        exchange = _Exchange(self, self.base + path)
        text = exchange.run(self._prefix + path, "application/json", json.dumps(body).encode())
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            raise ScrapeError(f"{self.base + path}: the answer is not JSON") from None

    def _connection(self) -> http.client.HTTPConnection:
        if self._https:
            import ssl  # noqa: PLC0415 - loaded only for the rare TLS-fronted server

            return http.client.HTTPSConnection(
                self._host,
                self._port,
                timeout=self.connect_timeout,
                context=ssl.create_default_context(cafile=self.ca_file or None),
            )
        return http.client.HTTPConnection(self._host, self._port, timeout=self.connect_timeout)


class _Exchange:
    """One request and its response, under a watchdog that ends it at the deadline."""

    def __init__(self, client: VllmClient, url: str) -> None:
        self.client = client
        self.url = url
        self.phase = "connect"
        self.received = 0
        self.expired = threading.Event()
        self.expired_in = ""
        self.connection = client._connection()
        self.response: http.client.HTTPResponse | None = None

    def run(self, target: str, accept: str, payload: bytes | None = None) -> str:
        client = self.client
        watchdog = threading.Timer(client.connect_timeout + client.read_timeout, self._expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            body = self._exchange(target, accept, payload)
        except ScrapeError:
            raise
        except (OSError, http.client.HTTPException, zlib.error) as exc:
            raise ScrapeError(
                f"{self.url}: {self._problem(exc)}",
                silent=self._silent(exc),
                refused=isinstance(exc, ConnectionRefusedError),
            ) from None
        finally:
            watchdog.cancel()
            if self.response is not None:  # it holds the socket open until closed itself
                self.response.close()
            self.connection.close()
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScrapeError(f"{self.url}: not UTF-8 text (byte {exc.start})") from None

    def _expire(self) -> None:
        self.expired_in = self.phase
        self.expired.set()
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: nothing to wake
                sock.shutdown(socket.SHUT_RDWR)  # wakes the read that is blocked on it

    def _exchange(self, target: str, accept: str, payload: bytes | None) -> bytes:
        connection, limit = self.connection, self.client.max_page_bytes
        connection.connect()
        if self.expired.is_set():  # the deadline passed while connecting: nothing to wake
            raise self._late()
        assert connection.sock is not None
        connection.sock.settimeout(self.client.read_timeout)
        self.phase = "headers"
        headers = {
            "Accept": accept,
            "User-Agent": f"vkvagent/{__version__}",
            "Connection": "close",
        }
        if payload is not None:
            headers["Content-Type"] = "application/json"
        if self.client.api_key is not None:
            headers["Authorization"] = f"Bearer {self.client.api_key.value}"
        connection.request("GET" if payload is None else "POST", target, payload, headers)
        response = self.response = connection.getresponse()
        if self.expired.is_set():  # the headers may have been cut short: do not trust them
            raise self._late()
        if response.status != 200:
            raise ScrapeError(
                f"{self.url}: HTTP {response.status} {response.reason}".rstrip(),
                status=response.status,
            )
        kind = response.getheader("Content-Type", "")
        if "html" in kind:
            raise ScrapeError(f"{self.url}: got an HTML page ({kind}), not metrics")
        declared = response.getheader("Content-Length", "")
        if declared.isdigit() and int(declared) > limit and not _gzip(response):
            raise ScrapeError(f"{self.url}: page of {int(declared)} bytes exceeds the "
                              f"{limit}-byte limit")  # fmt: skip
        self.phase = "body"
        decoder = zlib.decompressobj(16 + zlib.MAX_WBITS) if _gzip(response) else None
        chunks: list[bytes] = []
        size = 0
        while True:
            # read1 returns as soon as some bytes arrive; the watchdog bounds the total.
            chunk = response.read1(_CHUNK)
            if self.expired.is_set():
                raise self._late()
            if not chunk:
                if response.length:  # read1 ends quietly where read would raise IncompleteRead
                    raise ScrapeError(f"{self.url}: response broken off after {self.received} "
                                      f"bytes ({response.length} more were announced)")  # fmt: skip
                break
            self.received += len(chunk)
            if decoder is not None:  # decompress no more than the limit allows, then stop
                chunk = decoder.decompress(chunk, limit + 1 - size)
            size += len(chunk)
            if size > limit:
                raise ScrapeError(f"{self.url}: page exceeds the {limit}-byte limit")
            chunks.append(chunk)
        if decoder is not None and not decoder.eof:
            raise ScrapeError(f"{self.url}: compressed page ends early ({self.received} bytes)")
        return b"".join(chunks)

    def _late(self) -> ScrapeError:
        return ScrapeError(f"{self.url}: {self._late_reason()}", silent=self.phase != "connect")

    def _silent(self, exc: BaseException) -> bool:
        """Connected, then no answer in time: what a stopped or wedged server does (the
        kernel accepts the connection for it). A refused or reset connection is not silence."""
        if self.expired.is_set():
            return self.phase != "connect"
        return isinstance(exc, socket.timeout) and self.phase != "connect"

    def _late_reason(self) -> str:
        total = self.client.connect_timeout + self.client.read_timeout
        return (f"response not complete within {total:g} s "
                f"({self.expired_in}, {self.received} bytes so far)")  # fmt: skip

    def _problem(self, exc: BaseException) -> str:
        if self.expired.is_set():
            return self._late_reason()
        read_timeout = self.client.read_timeout
        if isinstance(exc, socket.timeout):
            if self.phase == "connect":
                return f"no connection within {self.client.connect_timeout:g} s"
            if self.phase == "body":
                return f"no data for {read_timeout:g} s after {self.received} bytes (read timeout)"
            return f"no data for {read_timeout:g} s (read timeout)"
        if isinstance(exc, ConnectionRefusedError):
            return "connection refused (vLLM not running, or still loading the model)"
        if isinstance(exc, socket.gaierror):
            return f"host name not found ({exc.strerror})"
        if isinstance(exc, OSError) and type(exc).__module__ == "ssl":  # loaded for https only
            untrusted = getattr(exc, "verify_message", None)
            if untrusted:
                return (f"TLS: vLLM's certificate is not trusted ({untrusted}); set [vllm] "
                        "ca_file to the CA that signed it")  # fmt: skip
            return f"TLS: {getattr(exc, 'reason', None) or exc}"
        if isinstance(exc, http.client.RemoteDisconnected) or (
            self.phase == "headers" and isinstance(exc, ConnectionError)
        ):
            return "connection closed before the response was complete"
        if self.phase == "body" and isinstance(exc, (http.client.IncompleteRead, OSError)):
            return f"response broken off after {self.received} bytes ({type(exc).__name__})"
        if isinstance(exc, zlib.error):
            return f"bad compressed page: {exc}"
        if isinstance(exc, http.client.HTTPException):
            return f"not an HTTP response ({type(exc).__name__})"
        text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return text.splitlines()[0][:200]


def _gzip(response: http.client.HTTPResponse) -> bool:
    return response.getheader("Content-Encoding", "").strip().lower() == "gzip"
