"""The active probe against real servers on loopback: answered, slow, hung, refused, broken,
misconfigured; one at a time; what the engine learns from it. And the daemon sending it to the
simulator's hung engine (gauges at 0, counters still) and finding the stall."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.httpserver import RawServer, free_port, read_request
from tests.simproc import SimProcess
from tests.test_daemon import events_of, process_start, write_config
from vkvagent.adapters.history import History
from vkvagent.adapters.probe import Prober, ProbeResult, outcome_of
from vkvagent.adapters.vllm import VllmClient
from vkvagent.engine.progress import ProbeFacts
from vkvagent.knowledge import status
from vkvagent.service.daemon import Daemon
from vkvagent.tools.demo import scaled_clock

COMPLETION = json.dumps({"choices": [{"index": 0, "text": " the"}]}).encode()


def reply(conn: socket.socket, status_line: str, body: bytes) -> None:
    conn.sendall(
        f"HTTP/1.1 {status_line}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )


def answer(status_line: str, body: bytes, delay: float = 0.0) -> object:
    def handle(conn: socket.socket, stop: threading.Event) -> None:
        read_request(conn)
        if not stop.wait(delay):
            reply(conn, status_line, body)

    return handle


def hang(conn: socket.socket, stop: threading.Event) -> None:
    read_request(conn)
    stop.wait(10)  # accepted, read, never answered: a stopped or wedged server


def hang_up(conn: socket.socket, stop: threading.Event) -> None:
    read_request(conn)  # then the connection closes: the server died mid-request


def probe_once(url: str, timeout: float = 1.0) -> tuple[ProbeResult, Prober]:
    prober = Prober(VllmClient(url, connect_timeout=0.5, read_timeout=timeout))
    assert prober.send("tiny-llama")
    prober.wait(timeout + 5)
    (result,) = prober.collect()
    return result, prober


@pytest.mark.parametrize(
    ("handler", "outcome", "detail"),
    [
        (answer("200 OK", COMPLETION), "ok", ""),
        (answer("200 OK", COMPLETION, delay=0.3), "ok", ""),  # slow, within its timeout
        (hang, "timeout", "no data for 1 s (read timeout)"),
        (answer("500 Internal Server Error", b'{"error": "EngineDeadError"}'), "error", "HTTP 500"),
        (hang_up, "error", "connection closed before the response was complete"),
        (answer("404 Not Found", b'{"error": "The model does not exist."}'), "unusable", "404"),
        (answer("401 Unauthorized", b'{"error": "Unauthorized"}'), "unusable", "HTTP 401"),
        (answer("200 OK", b'{"object": "error"}'), "error", "no completion in the answer"),
        (answer("302 Found", b""), "unusable", "HTTP 302"),
    ],
    ids=[
        "answered",
        "slow",
        "hung",
        "server-error",
        "hung-up",
        "wrong-model",
        "api-key",
        "empty",
        "redirect",
    ],
)
def test_each_kind_of_server_gives_its_outcome(handler: object, outcome: str, detail: str) -> None:
    with RawServer(handler) as server:  # type: ignore[arg-type]
        result, prober = probe_once(server.url)
    assert result.outcome == outcome
    assert detail in result.detail
    assert (outcome == "ok") == (result.detail == "")
    assert result.latency < 1.5 + 1.0  # bounded by the probe's own timeout
    if outcome == "ok":
        assert prober.facts() == ProbeFacts(answered=result.sent, last_sent=result.sent)
    elif outcome in ("timeout", "error"):
        assert prober.facts() == ProbeFacts(unanswered=result.sent, last_sent=result.sent)
    else:  # a 4xx tells nothing of the engine
        assert prober.facts() == ProbeFacts(last_sent=result.sent)


def test_a_dead_server_refuses_and_that_is_not_an_unanswered_probe() -> None:
    result, prober = probe_once(f"http://127.0.0.1:{free_port()}")
    assert result.outcome == "refused" and "connection refused" in result.detail
    assert prober.facts().unanswered is None


def test_the_request_is_one_greedy_token_to_the_served_model() -> None:
    seen: list[bytes] = []

    def record(conn: socket.socket, stop: threading.Event) -> None:
        head = read_request(conn)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))  # fmt: skip
        body = head.split(b"\r\n\r\n", 1)[1]
        while len(body) < length:
            body += conn.recv(4096)
        seen.append(head.split(b"\r\n", 1)[0] + b" " + body)
        reply(conn, "200 OK", COMPLETION)

    with RawServer(record) as server:
        result, _ = probe_once(server.url)
    assert result.outcome == "ok"
    line, body = seen[0].split(b" ", 3)[:3], seen[0].split(b" ", 3)[3]
    assert line == [b"POST", b"/v1/completions", b"HTTP/1.1"]
    assert json.loads(body) == {
        "model": "tiny-llama", "prompt": "ping", "max_tokens": 1, "temperature": 0,
    }  # fmt: skip


def test_one_probe_at_a_time_and_the_latest_unanswered_one_is_kept() -> None:
    with RawServer(hang) as server:
        prober = Prober(VllmClient(server.url, connect_timeout=0.5, read_timeout=0.5))
        assert prober.send("m")
        assert prober.in_flight is not None and not prober.send("m")  # one in flight: no second
        first = prober.in_flight
        assert first is not None
        prober.wait(5)
        assert prober.in_flight is None and prober.send("m")
        prober.wait(5)
    results = prober.collect()
    assert [r.outcome for r in results] == ["timeout", "timeout"]
    assert server.connections == 2
    # The latest: one from before the engine last moved must not hide a later hang (the
    # stall counts from the engine's last progress, not from the probe).
    assert first == results[0].sent
    assert prober.facts().unanswered == prober.facts().last_sent == results[1].sent


def test_an_answer_clears_the_unanswered_probes() -> None:
    replies = iter([hang, answer("200 OK", COMPLETION)])

    def handle(conn: socket.socket, stop: threading.Event) -> None:
        next(replies)(conn, stop)  # type: ignore[operator]

    with RawServer(handle) as server:
        prober = Prober(VllmClient(server.url, connect_timeout=0.5, read_timeout=0.5))
        for _ in range(2):
            prober.send("m")
            prober.wait(5)
    timed_out, answered = prober.collect()
    assert (timed_out.outcome, answered.outcome) == ("timeout", "ok")
    assert prober.facts() == ProbeFacts(answered=answered.sent, last_sent=answered.sent)


# -- the daemon, the probe and the simulator's hung engine ---------------------------------------

SCALE = 100.0


def test_the_daemon_probes_a_hung_engine_and_names_the_stall(tmp_path: Path) -> None:
    """The simulator's `hang` (vLLM 0.32 with its engine stopped): gauges 0, counters still,
    /metrics and /health answering. Only the probe can tell; its timeout makes it a stall."""
    with SimProcess(
        "meta-llama/Llama-3.1-8B-Instruct", "--time-scale", str(SCALE), "--rate", "4",
        "--scenario", "hang", "--scenario-onset", "300",
    ) as sim:  # fmt: skip
        path = write_config(
            tmp_path, sim.url,
            agent={"sample_interval": 10.0},
            probe={"after": 30.0, "timeout": 1.0},
            diagnosis={"stall_after": 120.0},
            policy={"mode": "enforce", "windows": []},
        )  # fmt: skip
        clock = scaled_clock(process_start(sim), SCALE)
        stream = io.StringIO()
        daemon = Daemon.offline(path, stream, clock)
        seen = []
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                decision = daemon.tick()
                seen.append(decision)
                if decision.cause == "stall":
                    break
                time.sleep(10 / SCALE)
            report = status.read(tmp_path / "state")
            daemon.parts.prober.wait(5)
        finally:
            daemon.close()
        hung = sim.state()
    assert hung["hung"] and hung["running"] + hung["waiting"] > 0  # requests do wait
    assert decision.cause == "stall", [d.reason for d in seen[-5:]]
    assert decision.action == "restart"  # an emergency: outside any window
    assert "a probe got no answer and no token or engine step for" in decision.reason
    assert decision.evidence["stall_evidence"] == "a probe got no answer"
    # Before the hang, the engine was idle for no probe: tokens moved.
    assert not any(d.probe_wanted for d in seen if (d.uptime or 0) < 250)
    failed = [e for e in events_of(stream) if e["event"] == "probe.failed"]
    assert len(failed) == 1 and failed[0]["outcome"] == "timeout"
    assert report is not None and report.probe is not None and report.probe.enabled is True
    assert report.probe.last is not None and report.probe.last.outcome == "timeout"
    with History(tmp_path / "state", readonly=True) as history:
        outcomes = [p.outcome for p in history.probes()]
    assert outcomes and set(outcomes) == {"timeout"}


def test_the_daemon_probes_an_idle_server_and_finds_it_healthy(tmp_path: Path) -> None:
    """No traffic at all: the counters never move, so probes go (one per `after`), are
    answered, and nothing is diagnosed."""
    with SimProcess(
        "meta-llama/Llama-3.1-8B-Instruct", "--time-scale", str(SCALE), "--rate", "0"
    ) as sim:
        path = write_config(
            tmp_path, sim.url,
            agent={"sample_interval": 10.0},
            probe={"after": 30.0, "timeout": 1.0},
            policy={"mode": "enforce", "windows": []},
        )  # fmt: skip
        clock = scaled_clock(process_start(sim), SCALE)
        stream = io.StringIO()
        daemon = Daemon.offline(path, stream, clock)
        try:
            decisions = []
            for _ in range(40):
                decisions.append(daemon.tick())
                time.sleep(10 / SCALE)
                daemon.parts.prober.wait(2)
            report = status.read(tmp_path / "state")
            exported = generate_latest(daemon.metrics.registry).decode()
        finally:
            daemon.close()
    assert all(d.cause is None for d in decisions)
    with History(tmp_path / "state", readonly=True) as history:
        probes = history.probes()
    assert probes and all(p.outcome == "ok" for p in probes)
    # One per `after` (30 s) of the daemon's clock at most, over 40 ticks of 10 s.
    assert 3 <= len(probes) <= 40 * 10 / 30 + 1
    assert report is not None and report.probe is not None and report.probe.last is not None
    assert report.probe.last.outcome == "ok"
    assert not [e for e in events_of(stream) if e["event"].startswith("probe.")]
    assert f'vkvagent_probes_total{{outcome="ok"}} {float(len(probes))}' in exported
    assert 'vkvagent_probes_total{outcome="timeout"} 0.0' in exported
    assert "vkvagent_probe_last_ok 1.0" in exported
    assert "vkvagent_probe_last_latency_seconds " in exported


def test_the_status_schema_names_every_outcome_a_probe_can_have() -> None:
    """status.PROBE_OUTCOMES is what the exporter and `status` list; outcome_of makes them."""
    from vkvagent.adapters.vllm import ScrapeError
    from vkvagent.knowledge.status import PROBE_OUTCOMES

    made = {
        outcome_of(error)
        for error in (
            None,
            ScrapeError("hung", silent=True),
            ScrapeError("down", refused=True),
            ScrapeError("401", status=401),
            ScrapeError("503", status=503),
            ScrapeError("reset"),
        )
    }
    assert made == set(PROBE_OUTCOMES)
