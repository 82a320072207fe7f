"""HTTP client for one vLLM server: reads /metrics and /version within hard limits.

A vLLM that is loading, wedged or overloaded must never stall the agent: the connection, every
read and the whole response are bounded in time, and the body in size (a page over the limit is
refused, never silently truncated).
"""

from __future__ import annotations

import time
from typing import Any, Callable
from urllib.parse import urlsplit, urlunsplit

import requests
import urllib3

from vkvagent import __version__
from vkvagent.config import VllmConfig
from vkvagent.metrics import ExpositionError, Normaliser, VllmMetrics

# Ask for the classic text format: vLLM serves it, and the normaliser reads it.
_ACCEPT = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
_CHUNK = 64 * 1024


class ScrapeError(Exception):
    """vLLM could not be read; the message is one line naming the problem."""


def base_url(url: str) -> str:
    """``http://host:port`` from a base URL or a full ``.../metrics`` URL."""
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ScrapeError(f"not an http(s) URL: {url!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/metrics"):
        path = path[: -len("/metrics")]
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class VllmClient:
    """Reads one vLLM server. Not thread-safe; the daemon samples from one thread."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 5.0,
        max_page_bytes: int = 8 * 1024 * 1024,
        model: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base = base_url(url)
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_page_bytes = max_page_bytes
        self._clock = clock
        self._normaliser = Normaliser(model)
        self._session = requests.Session()
        self._session.headers["User-Agent"] = f"vkvagent/{__version__}"

    @classmethod
    def from_config(cls, config: VllmConfig) -> VllmClient:
        return cls(
            config.url,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            max_page_bytes=config.max_page_bytes,
            model=config.model,
        )

    def close(self) -> None:
        self._session.close()

    def scrape(self, version: str | None = None) -> VllmMetrics:
        """Fetch and normalise /metrics. ``version`` (from config or ``version()``) is reported
        with the result. Raises ScrapeError."""
        text = self.get_text("/metrics", accept=_ACCEPT)
        try:
            return self._normaliser.normalise(text, version)
        except ExpositionError as exc:
            raise ScrapeError(f"{self.base}/metrics: {exc}") from None

    def version(self) -> str | None:
        """vLLM's version from GET /version, or None when it does not answer with one."""
        try:
            body: Any = self._get_json("/version")
        except ScrapeError:
            return None
        found = body.get("version") if isinstance(body, dict) else None
        return found if isinstance(found, str) else None

    def _get_json(self, path: str) -> Any:
        import json  # noqa: PLC0415 - only for the rare /version call

        try:
            return json.loads(self.get_text(path, accept="application/json"))
        except ValueError as exc:
            raise ScrapeError(f"{self.base}{path}: not JSON: {exc}") from None

    def get_text(self, path: str, accept: str) -> str:
        url = self.base + path
        deadline = self._clock() + self.connect_timeout + self.read_timeout
        try:
            with self._session.get(
                url,
                headers={"Accept": accept},
                timeout=(self.connect_timeout, self.read_timeout),
                stream=True,
                allow_redirects=False,
            ) as response:
                if response.status_code != 200:
                    reason = response.reason or ""
                    raise ScrapeError(f"{url}: HTTP {response.status_code} {reason}".rstrip())
                kind = response.headers.get("Content-Type", "")
                if "html" in kind:
                    raise ScrapeError(f"{url}: got an HTML page ({kind}), not metrics")
                body = self._read_body(response, url, deadline)
        except requests.exceptions.ConnectTimeout:
            raise ScrapeError(f"{url}: no connection within {self.connect_timeout:g} s") from None
        except requests.exceptions.ConnectionError as exc:
            raise ScrapeError(f"{url}: {_connection_problem(exc, self.read_timeout)}") from None
        except requests.exceptions.RequestException as exc:
            raise ScrapeError(f"{url}: {type(exc).__name__}: {exc}") from None
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ScrapeError(f"{url}: not UTF-8 text (byte {exc.start})") from None

    def _read_body(self, response: requests.Response, url: str, deadline: float) -> bytes:
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > self.max_page_bytes:
            raise ScrapeError(
                f"{url}: page of {int(declared)} bytes exceeds the {self.max_page_bytes}-byte limit"
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            # read1 returns as soon as some bytes arrive, so a server that trickles one byte at a
            # time still meets the overall deadline below.
            try:
                chunk = response.raw.read1(_CHUNK, decode_content=True)
            except urllib3.exceptions.ReadTimeoutError:
                raise ScrapeError(
                    f"{url}: no data for {self.read_timeout:g} s after {size} bytes (read timeout)"
                ) from None
            except urllib3.exceptions.HTTPError as exc:
                raise ScrapeError(
                    f"{url}: response broken off after {size} bytes: {type(exc).__name__}"
                ) from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > self.max_page_bytes:
                raise ScrapeError(f"{url}: page exceeds the {self.max_page_bytes}-byte limit")
            if self._clock() > deadline:
                raise ScrapeError(
                    f"{url}: response not complete within {self.read_timeout:g} s "
                    f"({size} bytes so far)"
                )
            chunks.append(chunk)


def _connection_problem(exc: requests.exceptions.ConnectionError, read_timeout: float) -> str:
    text = str(exc)
    if "Read timed out" in text:
        return f"no data for {read_timeout:g} s (read timeout)"
    if "Connection refused" in text:
        return "connection refused (vLLM not running, or still loading the model)"
    if "Name or service not known" in text or "nodename nor servname" in text:
        return "host name not found"
    if "Connection reset" in text or "RemoteDisconnected" in text or "IncompleteRead" in text:
        return "connection closed before the response was complete"
    return text.splitlines()[0][:200] if text else type(exc).__name__
