"""vkvagent's journald events shipped to a SIEM by three real collectors, with the
configurations vkvagent ships (packaging/siem/), in a real systemd 252 (tests/sandbox.py):
rsyslog (imjournal, JSON over TCP), syslog-ng (the journal through Debian's default source,
JSON over TCP) and systemd-journal-upload to systemd-journal-remote. The stand-in SIEM is a
TCP listener made inside the container (or journal-remote's journal file). The events are the
real daemon's, vkvagent.service watching the simulator as vllm.service; every collector is
restarted while they flow, then stopped while more are emitted and started again. Each event
must arrive, with every VKV_* field, MESSAGE_ID and PRIORITY as in the local journal, exactly
once (journal-upload: at least once, see IN_FLIGHT).

One container runs all three collectors on the same events (one boot, one run of the daemon);
each test checks one collector's delivery."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox import MASKED, PROJECT, Sandbox, require, sim_unit
from tests.test_daemon_systemd import AGENT, CONFIG, agent_unit, log, write_config
from vkvagent.knowledge.events import CATALOGUE

DOC = PROJECT / "docs" / "events.md"

CI = os.environ.get("CI") == "true"
SHIPPED = PROJECT / "packaging" / "siem"
# `make deps` downloads syslog-ng-core here (it conflicts with rsyslog on the host).
DEBS = Path(os.environ.get("VKVAGENT_DEBS") or Path.home() / ".cache" / "vkvagent" / "debs")
JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
# The shipped configurations' SIEM port, and the one each collector gets here.
SHIPPED_PORT = "6514"
PORTS = {"rsyslog": 6514, "syslog-ng": 6515}
REMOTE_DIR = "/var/log/journal/remote"
COLLECTORS = ("rsyslog.service", "syslog-ng.service", "systemd-journal-upload.service")
RECEIVER = ("systemd-journal-remote.socket", "systemd-journal-remote.service")  # socket first
# The stand-in receiver: journal-remote over plain HTTP on its socket (the shipped upload
# config's URL), instead of the packaged unit's HTTPS, which needs certificates.
REMOTE_HTTP = f"""\
[Service]
ExecStart=
ExecStart={JOURNAL_REMOTE} --listen-http=-3 --output={REMOTE_DIR}/
"""
# observe: the daemon reports, never restarts (the events are what this test needs). A
# conf.d file makes agent.started's `config` a list of two.
AGENT_CONFIG = CONFIG.format(read_timeout=2.0).replace('mode = "enforce"', 'mode = "observe"')
CONF_D = "[agent]\nreminder = 3600\n"
# What must arrive as in the local journal: every VKV_* field and these.
KEPT = ("MESSAGE_ID", "PRIORITY", "MESSAGE", "SYSLOG_IDENTIFIER", "_PID")
# Journal to SIEM while the collector runs, seconds: 0.3 s median here, at most 1.6 s (an event
# just before a restart); the bound leaves room for a loaded CI machine.
LATENCY = 10.0
# journal-upload delivers at least once: now and then (4 runs in 20 here) an entry written
# within 0.3 s before its stop arrived a second time after its start. One extra copy is allowed
# of the entries written this many seconds before a restart or stop, no more, and none lost.
IN_FLIGHT = 1.5


def need_collectors() -> Path:
    """The syslog-ng-core package to unpack; skips (fails under CI=true) without the three."""
    missing = [tool for tool in ("rsyslogd",) if shutil.which(tool) is None]
    if not Path(JOURNAL_REMOTE).exists():
        missing.append("systemd-journal-remote")
    found = sorted(DEBS.glob("syslog-ng-core_*.deb"))
    if not found:
        missing.append(f"{DEBS}/syslog-ng-core_*.deb")
    if missing:
        message = f"needs {', '.join(missing)} (make deps)"
        if CI:
            pytest.fail(f"{message}; CI=true: not skipped")
        pytest.skip(message)
    return found[-1]


def shipped(name: str, port: int | None = None) -> str:
    """A configuration from packaging/siem/, its SIEM port replaced by ``port``."""
    text = (SHIPPED / name).read_text()
    if port is not None:
        assert text.count(SHIPPED_PORT) == 1, f"{name}: one SIEM port to substitute"
        text = text.replace(SHIPPED_PORT, str(port))
    return text


@dataclass
class Siem:
    """A stand-in SIEM: accepts TCP connections inside the container and keeps each line
    received with the time it arrived."""

    server: socket.socket
    lines: list[tuple[float, bytes]] = field(default_factory=list)
    connections: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.server.settimeout(0.2)
        self._spawn(self._accept)

    def _spawn(self, target: Any, *args: Any) -> None:
        threading.Thread(target=target, args=args, daemon=True).start()

    def _accept(self) -> None:
        while self.server.fileno() != -1:
            try:
                client, _peer = self.server.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            self._spawn(self._read, client)

    def _read(self, client: socket.socket) -> None:
        pending = b""
        with client:
            while True:
                try:
                    chunk = client.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                now = time.time()
                *whole, pending = (pending + chunk).split(b"\n")
                with self._lock:
                    self.lines.extend((now, line) for line in whole if line)
        if pending:
            with self._lock:
                self.lines.append((time.time(), pending))

    def received(self) -> list[tuple[float, bytes]]:
        with self._lock:
            return list(self.lines)

    def close(self) -> None:
        self.server.close()


@dataclass
class Delivery:
    """What one collector delivered: each entry (JSON object) and when it arrived."""

    entries: list[dict[str, Any]]
    arrived: list[float]
    unparseable: list[bytes]


@dataclass
class Run:
    """The local journal's vkvagent events and each collector's delivery of them."""

    local: list[dict[str, Any]]
    delivered: dict[str, Delivery]
    connections: dict[str, int]
    stopped_at: float  # when the collectors were stopped (events after it waited for them)
    interrupted: list[float]  # when they were restarted and stopped
    seconds: float


def projection(entry: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The fields that must arrive unchanged: every VKV_* field, and KEPT."""
    return tuple(sorted((k, v) for k, v in entry.items() if k.startswith("VKV_") or k in KEPT))


def local_events(box: Sandbox) -> list[dict[str, Any]]:
    done = box.run("journalctl", "-o", "json", "--no-pager", "SYSLOG_IDENTIFIER=vkvagent")
    return [json.loads(line) for line in done.stdout.split("\n") if line.strip()]


def remote_events(box: Sandbox) -> list[dict[str, Any]]:
    """What journal-remote wrote, read back as the SIEM would."""
    done = box.run(
        "journalctl", "-D", REMOTE_DIR, "-o", "json", "--no-pager", "SYSLOG_IDENTIFIER=vkvagent",
        check=False,
    )  # fmt: skip
    return [json.loads(line) for line in done.stdout.split("\n") if line.strip()]


def parse(lines: Sequence[tuple[float, bytes]]) -> Delivery:
    delivery = Delivery([], [], [])
    for at, line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            delivery.unparseable.append(line)
            continue
        delivery.entries.append(entry)
        delivery.arrived.append(at)
    return delivery


def wait_events(box: Sandbox, counts: dict[str, int], timeout: float = 30.0) -> None:
    """Until the journal holds at least ``counts`` of each event name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        have = Counter(str(e.get("VKV_EVENT")) for e in local_events(box))
        if all(have[name] >= count for name, count in counts.items()):
            return
        time.sleep(0.2)
    raise AssertionError(f"events never reached {counts}:\n{log(box)}")


def install(box: Sandbox, syslog_ng: Path) -> None:
    """The collectors' configurations (as shipped, each port its own) and syslog-ng itself,
    unpacked into the container's throw-away root (tar keeps /lib a link to usr/lib). The
    package is copied in first: the container sees only the host's root file system."""
    box.run(
        "sh", "-c", 'dpkg-deb --fsys-tarfile "$1" | tar -x -C / --keep-directory-symlink',
        "sh", box.put(syslog_ng),
    )  # fmt: skip
    libraries = box.run("ldd", "/usr/sbin/syslog-ng").stdout
    assert "not found" not in libraries, f"syslog-ng's libraries (make deps):\n{libraries}"
    files = {
        "etc/rsyslog.d/60-vkvagent.conf": shipped("rsyslog-vkvagent.conf", PORTS["rsyslog"]),
        "etc/syslog-ng/conf.d/vkvagent.conf": shipped(
            "syslog-ng-vkvagent.conf", PORTS["syslog-ng"]
        ),
        "etc/systemd/journal-upload.conf.d/vkvagent.conf": shipped("journal-upload.conf"),
        "etc/systemd/system/systemd-journal-remote.service.d/http.conf": REMOTE_HTTP,
        "etc/vkvagent/conf.d/10-siem.toml": CONF_D,
    }
    for name, text in files.items():
        path = box.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        path.chmod(0o644)
    box.run("systemctl", "daemon-reload")


def delivered_all(box: Sandbox, sinks: dict[str, Siem], want: int) -> bool:
    return all(len(sink.received()) >= want for sink in sinks.values()) and (
        len(remote_events(box)) >= want
    )


def wait_delivered(box: Sandbox, sinks: dict[str, Siem], want: int, timeout: float = 30) -> None:
    """Until every collector has delivered ``want`` events, or ``timeout`` seconds (the
    tests then say what is missing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not delivered_all(box, sinks, want):
        time.sleep(0.2)


@pytest.fixture(name="shipped_run", scope="module")
def shipped_run_fixture() -> Iterator[Run]:
    """The events, emitted and shipped once for the three tests."""
    require()
    syslog_ng = need_collectors()
    started = time.monotonic()
    masked = [name for name in MASKED if name not in COLLECTORS + RECEIVER]
    units = {"vllm.service": sim_unit(), AGENT: agent_unit()}
    with Sandbox(units=units, enable=["vllm.service"], masked=masked) as box:
        write_config(box, AGENT_CONFIG)
        install(box, syslog_ng)
        sinks: dict[str, Siem] = {}
        try:
            for name, port in PORTS.items():
                sinks[name] = Siem(box.listen(port))
                sinks[name].start()
            # Enabled as an operator would: rsyslog's syslog.service alias comes with it.
            box.run("systemctl", "enable", "--now", *RECEIVER[:1], *COLLECTORS)
            box.wait_http()
            # While the collectors run: the daemon starts and decides; vLLM stops.
            box.run("systemctl", "start", AGENT)
            wait_events(box, {"agent.started": 1, "decision.changed": 1})
            box.run("systemctl", "stop", "vllm.service")
            wait_events(box, {"source.failed": 1, "decision.changed": 2})
            # Delivered before each stop, so that each collector's run has its connection.
            wait_delivered(box, sinks, len(local_events(box)))
            interrupted = [time.time()]
            box.run("systemctl", "restart", *COLLECTORS)
            # After their restart: vLLM is back.
            box.run("systemctl", "start", "vllm.service")
            wait_events(box, {"source.recovered": 1, "decision.changed": 3})
            wait_delivered(box, sinks, len(local_events(box)))
            # While they are stopped: the daemon stops, and starts again.
            stopped_at = time.time()
            interrupted.append(stopped_at)
            box.run("systemctl", "stop", *COLLECTORS)
            box.run("systemctl", "restart", AGENT)
            wait_events(box, {"agent.stopping": 1, "agent.started": 2, "decision.changed": 4})
            box.run("systemctl", "stop", AGENT)
            wait_events(box, {"agent.stopping": 2})
            box.run("systemctl", "start", *COLLECTORS)
            local = local_events(box)
            wait_delivered(box, sinks, len(local))
            time.sleep(1.0)  # any duplicate a restart would send has come by now
            delivered = {name: parse(sink.received()) for name, sink in sinks.items()}
            remote = remote_events(box)
            delivered["journal-upload"] = Delivery(remote, [], [])  # no arrival times
            yield Run(
                local=local,
                delivered=delivered,
                connections={name: sink.connections for name, sink in sinks.items()},
                stopped_at=stopped_at,
                interrupted=interrupted,
                seconds=time.monotonic() - started,
            )
        finally:
            for sink in sinks.values():
                sink.close()


def check(run: Run, collector: str, resent: Counter[Any] | None = None) -> None:
    """Every event delivered, parseable and as in the local journal; once, or for the events
    in ``resent``, at most twice."""
    delivery = run.delivered[collector]
    assert not delivery.unparseable, delivery.unparseable[:3]
    local = Counter(projection(entry) for entry in run.local)
    got = Counter(projection(entry) for entry in delivery.entries)
    missing, extra = local - got, got - local - (resent or Counter())
    assert not missing and not extra, (
        f"{collector}: {sum(missing.values())} of {len(run.local)} events missing, "
        f"{sum(extra.values())} unexpected or duplicated:\n"
        f"missing {list(missing)[:2]}\nextra {list(extra)[:2]}"
    )
    # The events cover the catalogue's kinds of value: the checks above hold for each.
    names = Counter(entry["VKV_EVENT"] for entry in run.local)
    assert names["agent.started"] == 2 and names["agent.stopping"] == 2
    assert names["source.failed"] == 1 and names["source.recovered"] == 1
    started = next(e for e in delivery.entries if e["VKV_EVENT"] == "agent.started")
    assert started["VKV_CONFIG"].split(",") == [
        "/etc/vkvagent/config.toml",
        "/etc/vkvagent/conf.d/10-siem.toml",
    ]  # a list
    assert float(started["VKV_INTERVAL_S"]) == 1.0  # a number
    decided = next(e for e in delivery.entries if e["VKV_EVENT"] == "decision.changed")
    assert decided["VKV_EVIDENCE_RUN"].startswith("start:")  # nested: evidence.run
    assert decided["VKV_WINDOW_OPEN"] in ("true", "false")  # a boolean
    for entry in delivery.entries:
        name = entry["VKV_EVENT"]
        assert entry["MESSAGE_ID"] == CATALOGUE[name].message_id(name)
        assert entry["PRIORITY"] == str(CATALOGUE[name].priority)


def latencies(run: Run, collector: str) -> list[float]:
    """Seconds from the journal's timestamp to the SIEM, for the events emitted while the
    collector ran."""
    delivery = run.delivered[collector]
    written = {projection(e): int(e["__REALTIME_TIMESTAMP"]) / 1e6 for e in run.local}
    return [
        at - written[projection(entry)]
        for entry, at in zip(delivery.entries, delivery.arrived)
        if written[projection(entry)] < run.stopped_at
    ]


@pytest.mark.systemd
def test_rsyslog_imjournal_ships_every_event_once_as_json_over_tcp(shipped_run: Run) -> None:
    check(shipped_run, "rsyslog")
    # One connection before the restart, one after it, one after the stop: it did restart.
    assert shipped_run.connections["rsyslog"] >= 3
    seconds = latencies(shipped_run, "rsyslog")
    assert seconds and max(seconds) < LATENCY, seconds


@pytest.mark.systemd
def test_syslog_ng_ships_every_event_once_as_json_with_journal_names(shipped_run: Run) -> None:
    check(shipped_run, "syslog-ng")
    assert shipped_run.connections["syslog-ng"] >= 3
    seconds = latencies(shipped_run, "syslog-ng")
    assert seconds and max(seconds) < LATENCY, seconds


def in_flight(run: Run) -> Counter[Any]:
    """The events written up to IN_FLIGHT seconds before a restart or stop of the collectors,
    which journal-upload may send again after it."""
    written = [(projection(entry), int(entry["__REALTIME_TIMESTAMP"]) / 1e6) for entry in run.local]
    return Counter(
        event for event, at in written if any(0 <= t - at < IN_FLIGHT for t in run.interrupted)
    )


@pytest.mark.systemd
def test_journal_upload_to_journal_remote_keeps_every_event(shipped_run: Run) -> None:
    check(shipped_run, "journal-upload", resent=in_flight(shipped_run))
    # journal-remote keeps the entries' own timestamps and boot.
    remote = shipped_run.delivered["journal-upload"].entries
    local = {projection(e): e for e in shipped_run.local}
    for entry in remote:
        mine = local[projection(entry)]
        assert entry["__REALTIME_TIMESTAMP"] == mine["__REALTIME_TIMESTAMP"]
        assert entry["_BOOT_ID"] == mine["_BOOT_ID"]


def test_the_doc_shows_the_shipped_configurations() -> None:
    """docs/events.md's code blocks without a language in "Shipping to a SIEM" are the
    shipped files, line for line and in order (comments and blank lines left out), one block
    per file."""
    section = DOC.read_text().split("## Shipping to a SIEM", 1)[1]
    blocks: list[list[str]] = []
    language: str | None = None  # inside a block: its fence's language
    for line in section.splitlines():
        if line.startswith("```"):
            language = line[3:] if language is None else None
            if language == "":
                blocks.append([])
        elif language == "" and line.strip():
            blocks[-1].append(line.strip())
    files = {
        path.name: [s for s in map(str.strip, path.read_text().splitlines()) if s[:1] not in "#"]
        for path in SHIPPED.glob("*.conf")
    }
    shown = []
    for block in blocks:
        matches = [name for name, lines in files.items() if block == lines]
        assert len(matches) == 1, "no shipped file is these lines:\n" + "\n".join(block)
        shown += matches
    assert sorted(shown) == sorted(files)
