"""knowledge/events.py: journald's native protocol, the socket writer, JSON lines, detection."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vkvagent.knowledge import events
from vkvagent.knowledge.events import (
    CATALOGUE,
    Events,
    JournalWriter,
    field_name,
    flatten,
    journal_datagram,
    journal_fields,
    under_journald,
)

NOW = 1_700_000_000.0  # 2023-11-14T22:13:20+00:00


def parse_datagram(data: bytes) -> dict[str, str]:
    """journald's reading of a native datagram: ``KEY=value\\n``, or ``KEY\\n``, a 64-bit
    little-endian length, that many bytes and ``\\n``."""
    fields: dict[str, str] = {}
    at = 0
    while at < len(data):
        end = data.index(b"\n", at)
        line = data[at:end]
        if b"=" in line:
            key, value = line.split(b"=", 1)
            at = end + 1
        else:
            (size,) = struct.unpack("<Q", data[end + 1 : end + 9])
            key, value = line, data[end + 9 : end + 9 + size]
            assert data[end + 9 + size : end + 10 + size] == b"\n"
            at = end + 10 + size
        assert key.decode() not in fields
        fields[key.decode()] = value.decode()
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for /run/systemd/journal/socket."""
    path = str(tmp_path / "j.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    try:
        yield server, path
    finally:
        server.close()


# -- the native protocol -----------------------------------------------------------------------


def test_datagram_single_line_values_are_key_equals_value() -> None:
    data = journal_datagram({"MESSAGE": "restarted vllm.service", "PRIORITY": 5, "VKV_X": "a=b"})
    assert data == b"MESSAGE=restarted vllm.service\nPRIORITY=5\nVKV_X=a=b\n"


def test_datagram_multi_line_value_uses_the_binary_length_form() -> None:
    data = journal_datagram({"MESSAGE": "one\ntwo", "PRIORITY": 3})
    expected = (
        b"MESSAGE\n"
        b"\x07\x00\x00\x00\x00\x00\x00\x00"  # 7 bytes, 64-bit little endian
        b"one\ntwo\n"
        b"PRIORITY=3\n"
    )
    assert data == expected
    assert parse_datagram(data) == {"MESSAGE": "one\ntwo", "PRIORITY": "3"}


def test_datagram_length_counts_utf8_bytes_not_characters() -> None:
    data = journal_datagram({"VKV_ERROR": "température\n°C"})
    value = "température\n°C".encode()
    assert data == b"VKV_ERROR\n" + struct.pack("<Q", len(value)) + value + b"\n"
    assert len(value) == 16


def test_datagram_values_as_text() -> None:
    data = journal_datagram(
        {
            "VKV_DRAIN": True,
            "VKV_WINDOW_OPEN": False,
            "VKV_RATIO": 0.123456789,
            "VKV_SECONDS": 42.0,
            "VKV_CONFIG": ["/etc/vkvagent/config.toml", "/etc/vkvagent/conf.d/10.toml"],
            "VKV_NAN": float("nan"),
            "VKV_ACTION": 17,
        }
    )
    assert parse_datagram(data) == {
        "VKV_DRAIN": "true",
        "VKV_WINDOW_OPEN": "false",
        "VKV_RATIO": "0.123457",
        "VKV_SECONDS": "42",
        "VKV_CONFIG": "/etc/vkvagent/config.toml,/etc/vkvagent/conf.d/10.toml",
        "VKV_NAN": "nan",
        "VKV_ACTION": "17",
    }


def test_field_names_and_flattening() -> None:
    assert field_name("cause") == "VKV_CAUSE"
    assert field_name("evidence_stalled_s") == "VKV_EVIDENCE_STALLED_S"
    assert field_name("suggestion_gpu-memory-utilization") == (
        "VKV_SUGGESTION_GPU_MEMORY_UTILIZATION"
    )
    assert flatten({"cause": "stall", "evidence": {"stalled_s": 300.0, "run": "start:1"}}) == {
        "cause": "stall",
        "evidence_stalled_s": 300.0,
        "evidence_run": "start:1",
    }


def test_journal_fields_flatten_evidence_and_drop_nulls() -> None:
    fields = journal_fields(
        {
            "event": "decision.changed",
            "message": "hold: outside window",
            "level": "info",
            "timestamp": "2023-11-14T22:13:20+00:00",
            "cause": None,
            "ratio": 0.7,
            "evidence": {"stalled_s": 300.0, "regime": "idle"},
            "suggestion": {"max-num-seqs": 64},
        }
    )
    assert fields == {
        "MESSAGE": "hold: outside window",
        "PRIORITY": events.INFO,
        "MESSAGE_ID": CATALOGUE["decision.changed"].message_id("decision.changed"),
        "SYSLOG_IDENTIFIER": "vkvagent",
        "VKV_EVENT": "decision.changed",
        "VKV_RATIO": 0.7,
        "VKV_EVIDENCE_STALLED_S": 300.0,
        "VKV_EVIDENCE_REGIME": "idle",
        "VKV_SUGGESTION_MAX_NUM_SEQS": 64,
    }


def test_an_slo_event_names_its_windows_as_docs_events_md_does() -> None:
    """burn_rates and attainment by window, flattened; a window that counted nothing left out."""
    fields = journal_fields(
        {
            "event": "slo.burning",
            "message": "ttft error budget burning fast (...)",
            "objective": "ttft",
            "alert": "fast",
            "burn_rates": {"5m": 25.0, "30m": 16.2, "1h": 20.1, "6h": None},
            "budget_remaining": -0.5,
            "attainment": {"1h": 0.2, "1d": 0.96, "period": 0.97},
        }
    )
    assert fields["PRIORITY"] == events.WARNING
    assert {k: v for k, v in fields.items() if k.startswith("VKV_")} == {
        "VKV_EVENT": "slo.burning",
        "VKV_OBJECTIVE": "ttft",
        "VKV_ALERT": "fast",
        "VKV_BURN_RATES_5M": 25.0,
        "VKV_BURN_RATES_30M": 16.2,
        "VKV_BURN_RATES_1H": 20.1,
        "VKV_BUDGET_REMAINING": -0.5,
        "VKV_ATTAINMENT_1H": 0.2,
        "VKV_ATTAINMENT_1D": 0.96,
        "VKV_ATTAINMENT_PERIOD": 0.97,
    }


def test_message_ids_are_fixed_per_name() -> None:
    ids = {name: kind.message_id(name) for name, kind in CATALOGUE.items()}
    assert len(set(ids.values())) == len(ids)
    for name, value in ids.items():
        assert len(value) == 32 and uuid.UUID(value).version == 5
        assert CATALOGUE[name].message_id(name) == value
    # derived from the name alone: the summary's text does not enter it
    assert ids["restart.completed"] == "631452a9f560558f9f9d4f6b648ffbd7"


# -- the socket --------------------------------------------------------------------------------


def test_journal_writer_sends_one_datagram(journal: tuple[socket.socket, str]) -> None:
    server, path = journal
    writer = JournalWriter(path)
    writer.write({"MESSAGE": "two\nlines", "PRIORITY": 4, "VKV_SOURCE": "vllm"})
    received = parse_datagram(server.recv(65536))
    assert received == {"MESSAGE": "two\nlines", "PRIORITY": "4", "VKV_SOURCE": "vllm"}


def test_journal_writer_cuts_fields_of_a_datagram_too_large(
    journal: tuple[socket.socket, str],
) -> None:
    server, path = journal
    writer = JournalWriter(path)
    writer.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 32768)
    limit = writer.socket.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    big = "x" * (4 * limit)
    writer.write({"MESSAGE": "too large", "VKV_ERROR": big})
    received = parse_datagram(server.recv(4 * limit))
    assert received == {"MESSAGE": "too large", "VKV_ERROR": "x" * 4096}


def test_journal_writer_without_journald_says_so_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    JournalWriter(str(tmp_path / "absent.sock")).write({"MESSAGE": "restart failed"})
    err = capsys.readouterr().err
    assert err.startswith("vkvagent: journald: ") and err.endswith(": restart failed\n")


def test_events_under_journald_send_fields_not_text(journal: tuple[socket.socket, str]) -> None:
    server, path = journal
    stream = io.StringIO()
    sink = Events(journal=JournalWriter(path), stream=stream, now=lambda: NOW)
    sink.emit(
        "source.failed",
        "vllm: connection refused",
        source="vllm",
        error="connection refused",
        evidence={"stalled_s": 120.5, "gone": None},
    )
    received = parse_datagram(server.recv(65536))
    assert received == {
        "MESSAGE": "vllm: connection refused",
        "PRIORITY": "4",
        "MESSAGE_ID": CATALOGUE["source.failed"].message_id("source.failed"),
        "SYSLOG_IDENTIFIER": "vkvagent",
        "VKV_EVENT": "source.failed",
        "VKV_SOURCE": "vllm",
        "VKV_ERROR": "connection refused",
        "VKV_EVIDENCE_STALLED_S": "120.5",
    }
    assert stream.getvalue() == ""


# -- JSON lines --------------------------------------------------------------------------------


def test_events_without_journald_write_one_json_object_per_line() -> None:
    stream = io.StringIO()
    sink = Events(stream=stream, now=lambda: NOW)
    sink.emit(
        "restart.completed",
        "restarted vllm.service (stall) in 41.0 s",
        cause="stall",
        action=7,
        seconds=41.0,
        service_seconds=float("nan"),
        evidence={"stalled_s": 300.0, "ratio": float("inf"), "run": None},
        config=["/etc/vkvagent/config.toml"],
    )
    sink.emit("agent.stopping", "vkvagent is stopping")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first == {
        "timestamp": "2023-11-14T22:13:20+00:00",
        "level": "notice",
        "event": "restart.completed",
        "message_id": "631452a9f560558f9f9d4f6b648ffbd7",
        "message": "restarted vllm.service (stall) in 41.0 s",
        "cause": "stall",
        "action": 7,
        "seconds": 41.0,
        "service_seconds": None,
        "evidence": {"stalled_s": 300.0, "ratio": None, "run": None},
        "config": ["/etc/vkvagent/config.toml"],
    }
    assert list(first)[:5] == ["timestamp", "level", "event", "message_id", "message"]
    assert second == {
        "timestamp": "2023-11-14T22:13:20+00:00",
        "level": "info",
        "event": "agent.stopping",
        "message_id": CATALOGUE["agent.stopping"].message_id("agent.stopping"),
        "message": "vkvagent is stopping",
    }
    assert "NaN" not in stream.getvalue() and "Infinity" not in stream.getvalue()


@pytest.mark.parametrize(
    ("name", "level"),
    [("policy.escalated", "crit"), ("restart.failed", "err"), ("source.failed", "warning")],
)
def test_level_is_the_priority_name(name: str, level: str) -> None:
    stream = io.StringIO()
    Events(stream=stream, now=lambda: NOW).emit(name, "m")
    assert json.loads(stream.getvalue())["level"] == level


def test_unknown_event_name_is_refused() -> None:
    stream = io.StringIO()
    sink = Events(stream=stream, now=lambda: NOW)
    with pytest.raises(ValueError, match=r"unknown event 'restart\.exploded'"):
        sink.emit("restart.exploded", "boom")
    assert stream.getvalue() == ""


# -- detection ---------------------------------------------------------------------------------


@pytest.fixture
def fake_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The journal socket exists, so detection hangs on JOURNAL_STREAM alone."""
    path = tmp_path / "socket"
    path.touch()
    monkeypatch.setattr(events, "JOURNAL_SOCKET", str(path))


@pytest.mark.usefixtures("fake_socket")
def test_under_journald_only_when_journal_stream_is_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (tmp_path / "stderr").open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert under_journald(stream)
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert not under_journald(stream)
        monkeypatch.setenv("JOURNAL_STREAM", "")
        assert not under_journald(stream)
        monkeypatch.delenv("JOURNAL_STREAM")
        assert not under_journald(stream)


@pytest.mark.usefixtures("fake_socket")
def test_not_under_journald_when_stderr_was_redirected(monkeypatch: pytest.MonkeyPatch) -> None:
    # systemd gave the service a stream, but stderr is something else now (a pipe, a file)
    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    assert not under_journald(sys.stderr)
    assert not under_journald(io.StringIO())  # no file descriptor at all
    assert Events.for_environment().journal is None


def test_not_under_journald_without_the_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events, "JOURNAL_SOCKET", str(tmp_path / "absent"))
    with (tmp_path / "stderr").open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert not under_journald(stream)
