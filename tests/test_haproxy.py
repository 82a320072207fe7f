"""A real HAProxy (Debian's) in front of two vLLM stand-ins, each watched by its own vkvagent,
checking each host's ``GET /ready`` (tests/sandbox.py: one systemd 252 container runs all of
them). When one vLLM stalls (its /health stays 200, as vLLM's does), its vkvagent says 503
at its next sample, HAProxy moves the traffic to the other within its check interval, and
the stalled one gets traffic again once vkvagent has restarted it."""

from __future__ import annotations

import http.client
import shutil
import sys
import threading
import time

import pytest

from tests.sandbox import PROJECT, Sandbox, exec_line, require, sim_unit

pytestmark = pytest.mark.systemd

INTERVAL = 1.0  # vkvagent's sample interval
CHECK = 1.0  # HAProxy's check interval (inter), one failure to leave, one success to return
STALL_ONSET = 450.0  # simulated seconds: 15 s real at the simulator's 30x
FRONT = 8000
AFTER = 3.0  # seconds of traffic measured once A is back
HOSTS = {"a": (8001, 9851), "b": (8002, 9852)}  # vLLM port, vkvagent's /ready port
CLIENT_TIMEOUT = 15.0  # seconds: HAProxy's timeout server (10 s) and connect (1 s), and more

HAPROXY = f"""\
global
    log stdout format raw local0
defaults
    mode http
    timeout connect 1s
    timeout client 10s
    timeout server 10s
frontend vllm
    bind 127.0.0.1:{FRONT}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /ready
    http-response set-header X-Served-By %s
    default-server inter {CHECK:g}s fall 1 rise 1
    server a 127.0.0.1:{HOSTS["a"][0]} check port {HOSTS["a"][1]}
    server b 127.0.0.1:{HOSTS["b"][0]} check port {HOSTS["b"][1]}
"""

CONFIG = """\
[agent]
sample_interval = {interval:g}
state_dir = "/var/lib/vkvagent-{name}"
[vllm]
unit = "vllm-{name}.service"
url = "http://127.0.0.1:{port}"
connect_timeout = 0.5
read_timeout = 2
[metrics]
listen = "127.0.0.1:{ready}"
[gpu]
enabled = false
[probe]
enabled = false
[restart]
ready_timeout = 30
job_timeout = 30
graceful_shutdown = false
[diagnosis]
stall_after = 10
[policy]
mode = "enforce"
"""


def agent(name: str) -> str:
    run = exec_line([sys.executable, "-m", "vkvagent", "run", "--config", f"/etc/vkvagent-{name}"])
    return (
        f"[Unit]\nAfter=vllm-{name}.service\n[Service]\nType=notify\nNotifyAccess=main\n"
        f"ExecStart={run}\nEnvironment=PYTHONDONTWRITEBYTECODE=1 PYTHONPATH={PROJECT}\n"
    )


def units() -> dict[str, str]:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    made = {
        "haproxy-test.service": (
            # -Ws: it tells systemd it is ready once it listens, so `systemctl start` returns
            # only then (with -W, traffic could reach the port before HAProxy bound it).
            f"[Service]\nType=notify\nExecStart={haproxy} -Ws -db -f /etc/haproxy-test.cfg\n"
        ),
    }
    for name, (port, _ready) in HOSTS.items():
        stall = (
            ("--scenario", "stall", "--scenario-onset", f"{STALL_ONSET:g}") if name == "a" else ()
        )
        made[f"vllm-{name}.service"] = sim_unit(*stall, "--rate", "4", port=port)
        made[f"vkvagent-{name}.service"] = agent(name)
    return made


class Balanced:
    """Requests through HAProxy, one every 50 ms, with the replica that answered each."""

    def __init__(self, box: Sandbox) -> None:
        self.box, self.served = box, []  # type: ignore[var-annotated]
        self.errors: list[tuple[float, str]] = []  # when, and what the client saw
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Balanced:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            # Longer than HAProxy's own timeouts: a slow answer is HAProxy's to turn into a
            # 504, not this client's to count as an error (the sandboxes of the other test
            # workers can keep this host's CPUs busy for seconds).
            connection = http.client.HTTPConnection("127.0.0.1", FRONT, timeout=CLIENT_TIMEOUT)
            try:
                connection.sock = self.box.connect(FRONT, timeout=CLIENT_TIMEOUT)
                connection.request("GET", "/v1/models")
                answer = connection.getresponse()
                answer.read()
                self.served.append((time.monotonic(), answer.getheader("X-Served-By") or "-"))
            except OSError as exc:
                self.served.append((time.monotonic(), "error"))
                self.errors.append((time.monotonic(), f"{type(exc).__name__}: {exc}"))
            finally:
                connection.close()

    def by(self, server: str, start: float, end: float = float("inf")) -> int:
        return sum(1 for at, who in list(self.served) if who == server and start <= at < end)


def ready(box: Sandbox, name: str) -> int:
    try:
        return box.http_get(HOSTS[name][1], "/ready", timeout=1.0)[0]
    except OSError:
        return 0


def until(check: object, timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return time.monotonic()
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def tokens(box: Sandbox, port: int) -> float | None:
    try:
        _status, page = box.http_get(port, "/metrics", timeout=1.0)
    except OSError:
        return None
    for line in page.decode().splitlines():
        if line.startswith("vllm:generation_tokens_total"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_haproxy_moves_traffic_off_a_stalled_vllm_by_vkvagents_ready_and_back() -> None:
    require()
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: `make deps` installs it")
    made = units()
    with Sandbox(units=made, enable=[n for n in made if n.startswith("vllm-")]) as box:
        (box.root / "etc/haproxy-test.cfg").write_text(HAPROXY)
        for name, (port, ready_port) in HOSTS.items():
            directory = box.root / f"etc/vkvagent-{name}"
            directory.mkdir(mode=0o755)
            (directory / "config.toml").write_text(
                CONFIG.format(interval=INTERVAL, name=name, port=port, ready=ready_port)
            )
        box.run("systemctl", "daemon-reload")
        started = box.run(
            "systemctl", "start", "vkvagent-a.service", "vkvagent-b.service", check=False
        )
        assert started.returncode == 0, box.messages("vkvagent-a.service")[-10:]
        box.run("systemctl", "start", "haproxy-test.service")
        began = time.monotonic()
        until(lambda: ready(box, "a") == ready(box, "b") == 200, 20, "both ready")
        with Balanced(box) as traffic:
            until(lambda: traffic.by("a", began) and traffic.by("b", began), 10, "both served")
            # The stall: vLLM A's token counter stops moving (its /health stays 200).
            last, moved = tokens(box, HOSTS["a"][0]), time.monotonic()
            while time.monotonic() - moved < 1.0:
                assert time.monotonic() - began < 60, "A never stalled"
                now = tokens(box, HOSTS["a"][0])
                if now != last:
                    last, moved = now, time.monotonic()
                time.sleep(0.05)
            stalled = moved  # the last time A's counter moved
            assert box.http_get(HOSTS["a"][0], "/health")[0] == 200
            unready = until(lambda: ready(box, "a") == 503, 10, "A's /ready 503")
            # The last request HAProxy sent A, once it saw the 503.
            until(lambda: traffic.by("b", unready + CHECK + 0.5), 10, "B serving after")
            sent_a = [at for at, who in list(traffic.served) if who == "a" and at >= stalled]
            switched = max(sent_a, default=stalled)
            until(lambda: traffic.by("a", unready + 2 * CHECK), 60, "A back in rotation")
            back = min(at for at, who in list(traffic.served) if who == "a" and at > switched)
            time.sleep(AFTER)  # both in rotation again
            ended = time.monotonic()
            errors = traffic.by("error", began)
        periods = {
            "before": (began, stalled),
            "stalled, until the switch": (stalled, switched + 0.1),
            "switched": (switched + 0.1, back),
            "after": (back, ended),
        }
        counts = {k: (traffic.by("a", *t), traffic.by("b", *t)) for k, t in periods.items()}
        during, b_during = counts["switched"]
        print(
            f"\nHAProxy (check every {CHECK:g} s) and vkvagent (a sample every {INTERVAL:g} s): "
            f"A's /ready said 503 {unready - stalled:.1f} s after its tokens stopped; HAProxy "
            f"sent A its last request {switched - stalled:.1f} s after; A served again "
            f"{back - stalled:.1f} s after (the stall restarted at stall_after 10 s); "
            f"{errors} errors; requests served by A / B:"
        )
        for period, (a, b) in counts.items():
            start, end = periods[period]
            print(f"  {period:26} {end - start:5.1f} s  A {a:4}  B {b:4}")
        # Within the check interval plus one sample interval (and a tick's own time).
        assert unready - stalled <= 2 * INTERVAL + 0.5
        assert switched - stalled <= CHECK + 2 * INTERVAL + 0.5
        assert during == 0 and b_during > 0
        assert min(counts["after"]) > 0, "A back in rotation beside B"
        assert errors == 0, [(round(at - stalled, 1), what) for at, what in traffic.errors]
        restarted = box.run(
            "journalctl", "-u", "vkvagent-a.service", "-o", "cat", "VKV_EVENT=restart.completed"
        ).stdout
        assert "restarted vllm-a.service (stall)" in restarted
