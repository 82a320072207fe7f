"""Runs `vkvagent sim serve` as a real process on a free loopback port, for tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from tests.httpserver import free_port
from vkvagent.processes import stop_process


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=2.0) as response:
        return dict(json.loads(response.read()))


class SimProcess:
    """``with SimProcess("meta-llama/Llama-3.1-8B", "--block-size", "32") as sim: sim.url``"""

    def __init__(self, *args: str, cold_start: float = 0.0, wait: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable, "-m", "vkvagent", "sim", "serve", *args,
            "--host", "127.0.0.1", "--port", str(self.port), "--cold-start", str(cold_start),
        ]  # fmt: skip
        self.wait = wait
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> SimProcess:
        self.process = subprocess.Popen(
            self.args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if self.wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"sim exited {self.process.returncode}: {self.stderr()}")
            try:
                if get(self.url + "/health", timeout=0.5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError("sim did not become ready")

    def state(self) -> dict[str, Any]:
        return dict(json.loads(get(self.url + "/sim/state")[1]))

    def stop(self) -> int:
        assert self.process is not None
        return stop_process(self.process)

    def stderr(self) -> str:
        assert self.process is not None and self.process.stderr is not None
        if self.process.poll() is None:
            return ""
        return self.process.stderr.read()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        assert self.process is not None
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()
