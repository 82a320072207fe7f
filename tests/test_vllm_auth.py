"""vkvagent against the real vLLM 0.32 (CPU build, tests/realvllm.py) serving TLS behind an
API key, as vllm.service under a real systemd 252 (tests/sandbox.py), with ``vkvagent run`` as
vkvagent.service and https verified against the test's own CA. The unit keeps the key in its
``Environment=VLLM_API_KEY`` and hands it to vLLM as ``--api-key ${VLLM_API_KEY}``, so vLLM's
command line and its own log hold the key itself. When the engine's worker is stopped with no
traffic, every gauge reads 0 and /health says 200: only a probe can tell, and vLLM's API
server answers 401 to a probe without the key, so only one that authenticates can go
unanswered and name the stall.

- ``[vllm] api_key_file``, observe mode: a file others may read is refused; a wrong key is a
  configuration problem that status names; vLLM's key finds the stall;
- reloaded without the file, enforce mode: the unit's own key finds it, and vkvagent restarts
  vLLM and sees it serve again over TLS.

After each, no journal line, file, drop-in or output of vkvagent's holds the key. One
container for the module, the tests in file order; about 3 minutes."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.certificates import make_certificates
from tests.realvllm import START_TIMEOUT, processes, require, vllm_unit, wait_until
from tests.sandbox import VLLM_PORT, Sandbox
from tests.test_actuator import output, vkvagent
from tests.test_daemon_systemd import AGENT, agent_unit, log
from tests.test_vllm_hangs import PROBES, restarted_for, since, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.systemd]

TLS = "/etc/vllm/tls"  # the CA, vLLM's certificate and key, inside the container
KEY = "sk-vkv-3f9a27c1d4e8"
KEY_FILE = "/etc/vkvagent/vllm.key"
INTERVAL, STALL_AFTER = 5.0, 30.0
CONFIG = f"""\
[agent]
sample_interval = {INTERVAL:g}
[vllm]
url = "https://127.0.0.1:{VLLM_PORT}"
ca_file = "{TLS}/ca.pem"
connect_timeout = 1
read_timeout = 3
{{key}}
[gpu]
enabled = false
[probe]
after = 10
timeout = 10
[restart]
ready_timeout = {START_TIMEOUT:g}
job_timeout = {START_TIMEOUT:g}
[diagnosis]
stall_after = {STALL_AFTER:g}
[policy]
mode = "{{mode}}"
windows = []
"""


def tls_unit(*flags: str, service: str = "") -> str:
    """vllm.service serving https with the test CA's certificate."""
    return vllm_unit(
        "--ssl-certfile", f"{TLS}/server.pem", "--ssl-keyfile", f"{TLS}/server-key.pem", *flags,
        service=service,
    )  # fmt: skip


def https_get(box: Sandbox, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` from vLLM over TLS, verified against the test CA (no key)."""
    context = ssl.create_default_context(cafile=str(box.root / TLS.lstrip("/") / "ca.pem"))
    connection = http.client.HTTPSConnection("127.0.0.1", VLLM_PORT, timeout=timeout)
    sock = box.connect(VLLM_PORT, timeout=timeout)
    connection.sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def serving(box: Sandbox) -> bool:
    try:
        return https_get(box, "/health", timeout=2)[0] == 200
    except OSError:
        return False


def start_vllm(box: Sandbox, unit: str) -> None:
    box.write_unit("vllm.service", unit)
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "restart", "vllm.service")
    wait_until(lambda: serving(box), START_TIMEOUT, "vLLM serving https")


def start_agent(box: Sandbox, *, key: str = "", mode: str = "enforce") -> float:
    """vkvagent.service (re)started on a fresh config and state; when (Unix seconds)."""
    began = time.time()
    box.run("systemctl", "stop", AGENT, check=False)
    box.run("rm", "-rf", "/var/lib/vkvagent")
    (box.root / "etc/vkvagent").mkdir(mode=0o755, parents=True, exist_ok=True)
    (box.root / "etc/vkvagent/config.toml").write_text(CONFIG.format(key=key, mode=mode))
    box.write_unit(AGENT, agent_unit(watchdog=START_TIMEOUT))
    box.run("systemctl", "daemon-reload")
    box.run("systemctl", "start", AGENT)
    wait_for(box, "agent.started", began, timeout=30)
    return began


def probes(box: Sandbox) -> list[dict[str, object]]:
    done = box.run(sys.executable, "-c", PROBES, "/var/lib/vkvagent", timeout=60)
    found: list[dict[str, object]] = json.loads(done.stdout)
    return found


def stop_the_engine(box: Sandbox) -> None:
    """SIGSTOP to the engine's worker with no traffic: /health 200, every gauge 0, nothing
    moves; only a request can tell."""
    (worker,) = processes(box, "VLLM::Worker")
    box.run("kill", "-STOP", str(worker))


def config_check(box: Sandbox) -> subprocess.CompletedProcess[str]:
    return box.run(
        sys.executable, "-m", "vkvagent", "config", "check", "/etc/vkvagent/config.toml",
        check=False, timeout=60,
    )  # fmt: skip


def nothing_of_vkvagents_holds(box: Sandbox, key: str) -> None:
    """Not one of vkvagent's journal lines, files, drop-ins or outputs holds ``key``."""
    journal = box.run(
        "journalctl", "-o", "export", "--no-pager", f"_SYSTEMD_UNIT={AGENT}", "+",
        "SYSLOG_IDENTIFIER=vkvagent",
    ).stdout  # fmt: skip
    assert "VKV_EVENT=" in journal  # the search has something to search
    assert key not in journal
    said = [vkvagent(box, *command) for command in (["status"], ["status", "--json"], ["plan"])]
    said.append(config_check(box))
    assert said[-1].returncode == 0, output(said[-1])
    for done in said:
        assert key not in done.stdout + done.stderr, output(done)
    written = [box.root / "var/lib/vkvagent", box.root / "etc/systemd/system/vllm.service.d"]
    for top in written:
        for file in (p for p in top.rglob("*") if p.is_file()):
            assert key.encode() not in file.read_bytes(), file


@pytest.fixture(name="box", scope="module")
def tls_box_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    require()
    with Sandbox() as box:
        files = make_certificates(tmp_path_factory.mktemp("tls"))
        inside = box.root / TLS.lstrip("/")
        inside.mkdir(parents=True)
        for name in ("ca", "server", "server-key"):
            shutil.copy(files[name], inside / f"{name}.pem")
        # The key in the unit's environment, given to vLLM on its command line by reference
        # (systemd expands it): vLLM's /proc/PID/cmdline and its own log hold the key itself.
        unit = tls_unit("--api-key", "${VLLM_API_KEY}", service=f"Environment=VLLM_API_KEY={KEY}")
        start_vllm(box, unit.replace("$${VLLM_API_KEY}", "${VLLM_API_KEY}"))  # expanded
        yield box


def test_a_key_file_finds_a_stall_that_reads_as_idle_and_a_wrong_one_is_named(
    box: Sandbox,
) -> None:
    """Observe mode, the key from [vllm] api_key_file: first a wrong one, then vLLM's."""
    key_file = box.root / KEY_FILE.lstrip("/")
    key_file.parent.mkdir(parents=True, exist_ok=True)
    key_file.write_text("sk-not-the-one\n")
    key_file.chmod(0o644)
    setting = f'api_key_file = "{KEY_FILE}"'
    (box.root / "etc/vkvagent/config.toml").write_text(CONFIG.format(key=setting, mode="observe"))
    loose = config_check(box)
    assert loose.returncode != 0 and "chmod 600" in loose.stderr, output(loose)
    key_file.chmod(0o600)
    began = start_agent(box, key=setting, mode="observe")
    failed = wait_for(box, "probe.failed", began, timeout=60)
    assert "refuses the API key from [vllm] api_key_file" in failed["MESSAGE"], failed
    shown = vkvagent(box, "status").stdout
    assert "a configuration problem" in shown, shown
    key_file.write_text(f"{KEY}\n")
    box.run("systemctl", "reload", AGENT)
    wait_until(lambda: any(p["outcome"] == "ok" for p in probes(box)), 60, "an answered probe")
    # A reference to the environment is no secret: plan copies it as it is.
    plan = vkvagent(box, "plan")  # the drain's --shutdown-timeout is a change to plan
    assert plan.returncode == 0 and "--api-key '${VLLM_API_KEY}'" in plan.stdout, output(plan)
    stop_the_engine(box)
    _status, page = https_get(box, "/metrics")
    assert b"vllm:num_requests_running" in page and https_get(box, "/health")[0] == 200
    deadline = time.monotonic() + STALL_AFTER + 40
    while time.monotonic() < deadline:
        named = [e for e in since(box, "decision.changed", began) if "stall" in e["MESSAGE"]]
        if named:
            break
        time.sleep(1)
    assert named, log(box)
    assert named[-1]["VKV_EVIDENCE_STALL_EVIDENCE"] == "a probe got no answer", named[-1]
    nothing_of_vkvagents_holds(box, KEY)


def test_the_key_in_the_units_environment_finds_the_stall_and_vllm_is_restarted(
    box: Sandbox,
) -> None:
    """The engine is still stopped. Reloaded into enforce mode without the key file, vkvagent
    sends the unit's own key: vLLM's API server answers 401 to any other, so only a probe
    that authenticates can go unanswered and name the stall."""
    began = time.time()
    (box.root / "etc/vkvagent/config.toml").write_text(CONFIG.format(key="", mode="enforce"))
    box.run("systemctl", "reload", AGENT)
    started = restarted_for(box, "stall", began, within=STALL_AFTER + 30)
    assert started["VKV_EVIDENCE_STALL_EVIDENCE"] == "a probe got no answer", log(box)
    wait_until(lambda: serving(box), 60, "vLLM serving again")
    nothing_of_vkvagents_holds(box, KEY)
