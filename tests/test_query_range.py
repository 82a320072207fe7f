"""Prometheus query_range input: the chunks a long range is fetched in, the times and durations
of the command line, and a Prometheus that misbehaves failing in one line."""

from __future__ import annotations

import re
import socket
import threading
from datetime import datetime, timezone

import pytest

from tests.httpserver import RawServer
from vkvagent.adapters import query_range

START = datetime(2025, 3, 3, 0, 0, tzinfo=timezone.utc)  # a Monday, 00:00 UTC


def test_chunks_cover_the_grid_once_under_the_point_limit() -> None:
    assert query_range.chunks(0, 100, 10, 4) == [(0, 30), (40, 70), (80, 100)]
    assert query_range.chunks(0, 0, 15, 10_000) == [(0, 0)]
    week = query_range.chunks(0, 7 * 86400, 15, query_range.MAX_POINTS)
    assert len(week) == 5 and all((b - a) / 15 + 1 <= 10_000 for a, b in week)
    grid = [t for a, b in week for t in range(int(a), int(b) + 1, 15)]
    assert grid == list(range(0, 7 * 86400 + 1, 15))


def test_times_and_durations() -> None:
    now = 1_741_000_000.0
    assert query_range.parse_time("now", now) == now
    assert query_range.parse_time("now-6h", now) == now - 6 * 3600
    assert query_range.parse_time("1741000000.5", now) == 1741000000.5
    assert query_range.parse_time("2025-03-03T04:00:00Z", now) == START.timestamp() + 4 * 3600
    assert query_range.parse_time("2025-03-03T05:00:00+01:00", now) == START.timestamp() + 4 * 3600
    assert query_range.parse_time("2025-03-03 04:00", now) == START.timestamp() + 4 * 3600
    assert [query_range.parse_duration(d) for d in ("15", "15s", "1m", "2h", "1d", "500ms")] == [
        15, 15, 60, 7200, 86400, 0.5
    ]  # fmt: skip
    for bad in ("yesterday", "now-x", "-5m", "5y"):
        with pytest.raises(ValueError):
            query_range.parse_time(bad, now)


def serve_answer(answer: bytes) -> RawServer:
    def handle(conn: socket.socket, _stop: threading.Event) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(4096)
        length = int(re.search(rb"Content-Length: (\d+)", data, re.I).group(1))  # type: ignore[union-attr]
        body = data.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += conn.recv(4096)
        conn.sendall(answer)

    return RawServer(handle)


def http(status: str, body: bytes, kind: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (http("503 Service Unavailable", b"<html>down</html>", "text/html"),
         "answered HTTP 503: Service Unavailable"),
        (http("422 Unprocessable Entity",
              b'{"status":"error","errorType":"execution","error":"too many samples"}'),
         "answered HTTP 422: execution: too many samples"),
        (http("200 OK", b"not json"), "answer is not JSON: "),
        (http("200 OK", b'{"status":"success","data":{"resultType":"vector","result":[]}}'),
         'resultType is "vector", not "matrix"'),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"status\"", "cannot read from "),
    ],
)  # fmt: skip
def test_a_prometheus_that_misbehaves_fails_in_one_line(answer: bytes, message: str) -> None:
    with serve_answer(answer) as server, pytest.raises(query_range.ReplayError) as caught:
        query_range.fetch(server.url, ["up"], 0, 60, 15, timeout=5)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert str(caught.value).count(f"{server.url}/api/v1/query_range") == 1
