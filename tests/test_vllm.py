"""VllmClient and ``vkvagent scrape --url`` against real servers on 127.0.0.1.

Every test talks to a real socket: well-behaved pages come from a ThreadingHTTPServer, peers that
misbehave below HTTP (never answer, trickle, hang up mid-body) from raw socket servers. Each
failure must be a ScrapeError whose message is one line naming the problem, reached within the
configured time and size limits.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.conftest import METRIC_PAGES, read_page
from tests.httpserver import (
    PROMETHEUS_TEXT,
    Handler,
    HttpServer,
    RawHandler,
    RawServer,
    Route,
    free_port,
    peer_hung_up,
    read_request,
)
from vkvagent.adapters.vllm import ScrapeError, VllmClient, base_url
from vkvagent.engine.samples import VllmMetrics
from vkvagent.tools import cli
from vkvagent.tools.exitcodes import ExitCode

CONNECT = 0.3  # connect_timeout of the clients under test, seconds
READ = 0.5  # read_timeout
LIMIT = 8 * 1024 * 1024  # max_page_bytes (the default)
BIG = 64 * 1024 * 1024  # an oversized page
BLOCK = 64 * 1024  # what an oversized page is streamed in
FILLER = b"".join(b"# filler line %05d to make the page big\n" % i for i in range(1700))[:BLOCK]

GOOD = read_page("v1-0.10.prom").encode("utf-8")
EXPECTED = json.loads((METRIC_PAGES / "v1-0.10.expected.json").read_text(encoding="utf-8"))
Serve = Callable[[dict[str, Route]], HttpServer]
ServeRaw = Callable[[RawHandler], RawServer]
MakeClient = Callable[..., VllmClient]
HEAD_200 = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
    b"Connection: close\r\n"
)


# -- fixtures and helpers ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every request on 127.0.0.1 whatever proxy the environment names."""
    for name in ("http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Starts an HTTP server with the given routes; every one is shut down after the test."""
    with contextlib.ExitStack() as servers:
        yield lambda routes: servers.enter_context(HttpServer(routes))


@pytest.fixture
def serve_raw() -> Iterator[ServeRaw]:
    """Starts a raw socket server running the handler per connection; shut down after the test."""
    with contextlib.ExitStack() as servers:
        yield lambda handle: servers.enter_context(RawServer(handle))


@pytest.fixture
def make_client() -> Iterator[MakeClient]:
    """VllmClient with short timeouts (it holds no connection between requests)."""

    def make(url: str, **options: Any) -> VllmClient:
        options.setdefault("connect_timeout", CONNECT)
        options.setdefault("read_timeout", READ)
        return VllmClient(url, **options)

    yield make


def static(
    body: bytes,
    status: int = 200,
    content_type: str = PROMETHEUS_TEXT,
    headers: dict[str, str] | None = None,
) -> Route:
    return lambda h: h.reply(status, body, content_type=content_type, headers=headers)


def scrape_error(client: VllmClient) -> tuple[str, float]:
    """The one-line message scrape() fails with, and how long it took to fail."""
    start = time.monotonic()
    with pytest.raises(ScrapeError) as info:
        client.scrape()
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith(f"{client.base}/metrics: "), message
    assert "\n" not in message and "\r" not in message, message
    assert "Traceback" not in message
    return message, elapsed


def assert_good_page(m: VllmMetrics) -> None:
    """The values v1-0.10.expected.json records for v1-0.10.prom."""
    got = m.to_json()
    for key, value in EXPECTED.items():
        if key in ("ttft_count", "itl_count"):
            hist = m.time_to_first_token if key == "ttft_count" else m.inter_token_latency
            assert hist is not None and hist.count == pytest.approx(value), key
        elif isinstance(value, float):
            assert got[key] == pytest.approx(value), key
        else:
            assert got[key] == value, key
    assert m.flavor == "v1-0.10" and m.engines == 2
    assert m.model_name == "Qwen/Qwen3-8B"


# -- a good server -----------------------------------------------------------------------------


def test_good_page_and_version(serve: Serve, make_client: MakeClient) -> None:
    server = serve(
        {
            "/metrics": static(GOOD),
            "/version": static(b'{"version": "0.10.1"}', content_type="application/json"),
        }
    )
    client = make_client(f"{server.url}/metrics")  # a full /metrics URL is accepted
    assert client.base == server.url
    version = client.version()
    assert version == "0.10.1"
    m = client.scrape(version)
    assert_good_page(m)
    assert m.version == "0.10.1"
    assert [path for path, _headers in server.requests] == ["/version", "/metrics"]
    # Scraping again on the same client reads the same values.
    assert client.scrape(version) == m


def test_requests_the_prometheus_text_format(serve: Serve, make_client: MakeClient) -> None:
    server = serve({"/metrics": static(GOOD), "/version": static(b'{"version": "0.13.0"}')})
    client = make_client(server.url)
    client.scrape(client.version())
    headers = dict(server.requests)
    assert headers["/metrics"]["Accept"].startswith("text/plain;version=0.0.4")
    assert headers["/version"]["Accept"] == "application/json"
    assert headers["/metrics"]["User-Agent"].startswith("vkvagent/")
    assert all(h["Host"] == f"127.0.0.1:{server.port}" for h in headers.values())


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://h:8000", "http://h:8000"),
        ("http://h:8000/", "http://h:8000"),
        ("http://h:8000/metrics", "http://h:8000"),
        ("http://h:8000/metrics/", "http://h:8000"),
        ("h:8000", "http://h:8000"),
        ("127.0.0.1:8000/metrics", "http://127.0.0.1:8000"),
        ("https://h/vllm/metrics", "https://h/vllm"),
    ],
)
def test_base_url(url: str, base: str) -> None:
    assert base_url(url) == base


@pytest.mark.parametrize("url", ["ftp://x", "http://", "file:///metrics"])
def test_base_url_refuses_other_schemes(url: str) -> None:
    with pytest.raises(ScrapeError, match="not an http") as info:
        base_url(url)
    assert "\n" not in str(info.value)
    with pytest.raises(ScrapeError):
        VllmClient(url)


def test_proxy_in_the_environment_is_not_used(
    serve: Serve, serve_raw: ServeRaw, make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell or unit with $http_proxy must not route the local scrape through a proxy (whose
    502 would read as a broken vLLM)."""

    def proxy(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    proxy_server = serve_raw(proxy)  # on 127.0.0.1 too: nothing leaves the host either way
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, proxy_server.url)
    server = serve({"/metrics": static(GOOD)})
    assert_good_page(make_client(server.url).scrape())
    assert proxy_server.connections == 0


def test_gzip_page_is_read(serve: Serve, make_client: MakeClient) -> None:
    packed = gzip.compress(GOOD)
    server = serve({"/metrics": static(packed, headers={"Content-Encoding": "gzip"})})
    assert_good_page(make_client(server.url).scrape())
    assert len(packed) < len(GOOD) / 4


# -- unreachable and slow servers --------------------------------------------------------------


def test_connection_refused(make_client: MakeClient) -> None:
    client = make_client(f"http://127.0.0.1:{free_port()}")
    message, elapsed = scrape_error(client)
    assert "connection refused" in message
    assert elapsed < CONNECT + 1


def test_server_that_never_answers(serve_raw: ServeRaw, make_client: MakeClient) -> None:
    def silent(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        stop.wait(5)

    server = serve_raw(silent)
    message, elapsed = scrape_error(make_client(server.url))
    assert message.endswith(f": no data for {READ:g} s (read timeout)")
    assert READ - 0.05 <= elapsed < READ + 2
    assert server.connections == 1  # no retry


def test_server_that_stalls_mid_body(serve_raw: ServeRaw, make_client: MakeClient) -> None:
    def stall(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(HEAD_200 + b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD[:1000])
        stop.wait(5)

    message, elapsed = scrape_error(make_client(serve_raw(stall).url))
    assert f"no data for {READ:g} s after 1000 bytes (read timeout)" in message
    assert READ - 0.05 <= elapsed < READ + 2


@pytest.mark.parametrize("framing", ["close-delimited", "chunked"])
def test_body_trickled_forever_meets_the_deadline(
    serve_raw: ServeRaw, make_client: MakeClient, framing: str
) -> None:
    chunked = framing == "chunked"

    def trickle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(HEAD_200 + (b"Transfer-Encoding: chunked\r\n" if chunked else b"") + b"\r\n")
        while not stop.wait(0.05):
            conn.sendall(b"1\r\n#\r\n" if chunked else b"#")

    message, elapsed = scrape_error(make_client(serve_raw(trickle).url))
    assert "response not complete within" in message
    assert CONNECT + READ - 0.05 <= elapsed < CONNECT + READ + 1


def test_headers_trickled_forever_meet_the_deadline(
    serve_raw: ServeRaw, make_client: MakeClient
) -> None:
    def trickle_headers(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        conn.sendall(HEAD_200 + b"X-Slow: ")
        give_up = time.monotonic() + 2.0  # bound the test when the client does not
        while time.monotonic() < give_up and not stop.wait(0.05):
            conn.sendall(b"a")

    client = make_client(serve_raw(trickle_headers).url, connect_timeout=0.2, read_timeout=0.3)
    message, elapsed = scrape_error(client)
    assert "response not complete within 0.5 s (headers" in message
    assert 0.5 - 0.05 <= elapsed < 0.5 + 0.5


# -- HTTP-level refusals -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [404, 500, 503])
def test_http_error_status(serve: Serve, make_client: MakeClient, status: int) -> None:
    routes = {} if status == 404 else {"/metrics": static(b"busy\n", status=status)}
    message, _elapsed = scrape_error(make_client(serve(routes).url))
    assert message.endswith(f": HTTP {status} {HTTPStatus(status).phrase}")


def test_html_content_type_is_refused(serve: Serve, make_client: MakeClient) -> None:
    html = b"<!DOCTYPE html><html><body>Model loading</body></html>\n"
    server = serve({"/metrics": static(html, content_type="text/html; charset=utf-8")})
    message, _elapsed = scrape_error(make_client(server.url))
    assert "HTML" in message and "text/html" in message


def test_html_body_served_as_text_is_refused(serve: Serve, make_client: MakeClient) -> None:
    html = b"\n<!DOCTYPE html>\n<html><body>\n<h1>Gateway</h1>\n</body></html>\n"
    server = serve({"/metrics": static(html)})
    message, _elapsed = scrape_error(make_client(server.url))
    assert "got an HTML or XML document, not a Prometheus exposition" in message


def test_body_that_is_not_utf8(serve: Serve, make_client: MakeClient) -> None:
    at = GOOD.index(b"Qwen/Qwen3-8B")
    body = GOOD[:at] + b"Qwen\xff\xfe" + GOOD[at + 4 :]
    server = serve({"/metrics": static(body)})
    message, _elapsed = scrape_error(make_client(server.url))
    assert message.endswith(f": not UTF-8 text (byte {at + 4})")


def test_truncated_page(serve: Serve, make_client: MakeClient) -> None:
    cut = GOOD.index(b"\n", len(GOOD) // 2) - 5  # inside a line; Content-Length is honest
    server = serve({"/metrics": static(GOOD[:cut])})
    message, _elapsed = scrape_error(make_client(server.url))
    assert "truncated page" in message


# -- connections that end early ----------------------------------------------------------------


@pytest.mark.parametrize("when", ["before the response", "mid-body", "mid-chunk"])
def test_connection_closed_early(serve_raw: ServeRaw, make_client: MakeClient, when: str) -> None:
    half = len(GOOD) // 2

    def hang_up(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        if when == "mid-body":
            conn.sendall(HEAD_200 + b"Content-Length: %d\r\n\r\n" % len(GOOD) + GOOD[:half])
        elif when == "mid-chunk":
            head = HEAD_200 + b"Transfer-Encoding: chunked\r\n\r\n"
            conn.sendall(head + b"%x\r\n" % len(GOOD) + GOOD[:half])
        conn.shutdown(socket.SHUT_WR)  # then closed when the handler returns

    message, elapsed = scrape_error(make_client(serve_raw(hang_up).url))
    if when == "before the response":
        assert "connection closed before the response was complete" in message
    else:
        assert "broken off after" in message
    assert elapsed < 1


# -- size limits -------------------------------------------------------------------------------


@dataclass
class Stream:
    sent: int = 0  # body bytes written
    hung_up_after: int | None = None  # body bytes written when the client was seen to hang up
    done: threading.Event = field(default_factory=threading.Event)  # the server has finished


def oversized_page(framing: str, stream: Stream) -> Route:
    """A BIG page streamed BLOCK by BLOCK (never held in memory). Once the client has been sent
    enough to decide (nothing when the length is declared, else LIMIT + BLOCK), the server
    waits for it to hang up before sending more."""
    pause_at = 0 if framing == "content-length" else LIMIT + BLOCK

    def route(h: Handler) -> None:
        try:
            send(h)
        finally:
            stream.done.set()

    def send(h: Handler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", PROMETHEUS_TEXT)
        if framing == "content-length":
            h.send_header("Content-Length", str(BIG))
        elif framing == "chunked":
            h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        while stream.sent < BIG and not h.server.stop.is_set():
            if stream.sent == pause_at and peer_hung_up(h.connection, 2.0):
                stream.hung_up_after = stream.sent
                return
            h.wfile.write(b"%x\r\n%s\r\n" % (BLOCK, FILLER) if framing == "chunked" else FILLER)
            stream.sent += BLOCK
        if framing == "chunked":
            h.wfile.write(b"0\r\n\r\n")

    return route


@pytest.mark.parametrize("framing", ["content-length", "chunked", "close-delimited"])
def test_oversized_page_is_refused(serve: Serve, make_client: MakeClient, framing: str) -> None:
    stream = Stream()
    server = serve({"/metrics": oversized_page(framing, stream)})
    client = make_client(server.url, read_timeout=3.0, max_page_bytes=LIMIT)
    message, elapsed = scrape_error(client)
    assert f"exceeds the {LIMIT}-byte limit" in message
    assert stream.done.wait(5)
    if framing == "content-length":
        assert f"page of {BIG} bytes" in message
        assert stream.hung_up_after == 0  # refused from the header, no body read
    else:
        # The client hung up once it had been sent just over the limit: it did not read on.
        assert stream.hung_up_after == LIMIT + BLOCK
    assert elapsed < 3


@pytest.fixture(scope="module")
def gzip_bomb() -> bytes:
    """BIG zero bytes, gzip-compressed to about 64 KB (never held uncompressed)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1024 * 1024)
    return b"".join(packer.compress(block) for _ in range(BIG // len(block))) + packer.flush()


def test_gzip_bomb_is_refused_by_the_size_cap(
    serve: Serve, make_client: MakeClient, gzip_bomb: bytes
) -> None:
    assert len(gzip_bomb) < LIMIT // 64  # small on the wire: only its decoded size is too big
    unpacker = zlib.decompressobj(16 + zlib.MAX_WBITS)
    assert unpacker.decompress(gzip_bomb[:4096], 64) == bytes(64)  # and it is gzip
    server = serve({"/metrics": static(gzip_bomb, headers={"Content-Encoding": "gzip"})})
    message, elapsed = scrape_error(make_client(server.url, max_page_bytes=LIMIT))
    assert message.endswith(f": page exceeds the {LIMIT}-byte limit")
    assert elapsed < 3


# -- /version ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "route",
    [
        None,  # 404
        static(b"vLLM 0.10.1\n", content_type="text/plain"),
        static(b'["0.10.1"]', content_type="application/json"),
        static(b'{"version": 10}', content_type="application/json"),
        static(b'{"version": "0.10.1"}', status=500, content_type="application/json"),
        static(b"<html>0.10.1</html>", content_type="text/html"),
        static(b'{"version": "0.10.\xff"}', content_type="application/json"),
    ],
    ids=["404", "not-json", "json-list", "not-a-string", "http-500", "html", "not-utf8"],
)
def test_version_unavailable_is_none(
    serve: Serve, make_client: MakeClient, route: Route | None
) -> None:
    server = serve({"/version": route} if route else {})
    assert make_client(server.url).version() is None
    assert [path for path, _headers in server.requests] == ["/version"]


def test_version_of_an_unreachable_server_is_none(make_client: MakeClient) -> None:
    assert make_client(f"http://127.0.0.1:{free_port()}").version() is None


# -- the command line, end to end --------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    """A config file the loader accepts even as root (owned by us, mode 0600)."""
    path = tmp_path / "vkvagent.toml"
    path.write_text("[vllm]\nconnect_timeout = 0.3\nread_timeout = 1.0\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = cli.main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_cli_scrape_url_json(serve: Serve, config_file: Path) -> None:
    server = serve(
        {
            "/metrics": static(GOOD),
            "/version": static(b'{"version": "0.10.1"}', content_type="application/json"),
        }
    )
    code, out, err = run_cli("scrape", "--url", server.url, "--json", "--config", str(config_file))
    assert (code, err) == (0, "")
    got = json.loads(out)
    assert got["flavor"] == "v1-0.10"
    assert got["model_name"] == "Qwen/Qwen3-8B"
    assert got["kv_cache_usage"] == pytest.approx(0.5625)
    assert got["engines"] == 2
    assert got["version"] == "0.10.1"


def test_cli_scrape_url_text(serve: Serve, config_file: Path) -> None:
    server = serve({"/metrics": static(GOOD)})  # no /version: the version stays unknown
    code, out, err = run_cli(
        "scrape", "--url", f"{server.url}/metrics", "--config", str(config_file)
    )
    assert (code, err) == (0, "")
    assert out.startswith("vLLM version unknown, metrics flavour v1-0.10, model Qwen/Qwen3-8B")


def test_cli_scrape_refused_port(config_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = run_cli("scrape", "--url", url, "--json", "--config", str(config_file))
    assert code == ExitCode.FAILURE
    assert out == ""
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    assert err.startswith(f"vkvagent: {url}/metrics: connection refused")
    assert "Traceback" not in err


def test_cli_scrape_file_without_a_final_newline_is_read_with_a_warning(
    tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """How `echo "$(curl ...)" >page` and many editors save a page: the same metrics as the page
    with its newline, and one warning line; over HTTP such a page is refused as cut off."""
    whole, bare = tmp_path / "whole.prom", tmp_path / "bare.prom"
    whole.write_bytes(GOOD)
    bare.write_bytes(GOOD.rstrip(b"\n"))
    code, with_newline, _ = run_cli(
        "scrape", "--file", str(whole), "--json", "--config", str(config_file)
    )
    assert (code, capsys.readouterr().err) == (0, "")
    code, without, _ = run_cli(
        "scrape", "--file", str(bare), "--json", "--config", str(config_file)
    )
    assert code == 0
    assert json.loads(without) == json.loads(with_newline)
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1
    assert warning[0].startswith(f"vkvagent: warning: {bare}: the last line has no final newline")


def test_cli_scrape_without_cache_config_info_says_null(config_file: Path) -> None:
    page = METRIC_PAGES / "v1-0.8-production-stack-318-qwen2.5-coder-32b.prom"
    code, out, _ = run_cli("scrape", "--file", str(page), "--json", "--config", str(config_file))
    assert code == 0
    got = json.loads(out)
    assert got["cache_config"] is None  # a missing signal, as the others: not {}
    assert got["kv_cache_usage"] == 0.0


def test_cli_scrape_refused_port_in_a_subprocess(config_file: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = subprocess.run(
        [sys.executable, "-m", "vkvagent", "scrape", "--url", url, "--config", str(config_file)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parent.parent,
        env={**os.environ, "VKVAGENT_DEBUG": ""},
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"vkvagent: {url}/metrics: connection refused")
