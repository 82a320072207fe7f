"""A real etcd for tests and benchmarks (Debian's etcd-server, 3.4): one member on two free
loopback ports, started and stopped by its user."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.httpserver import free_port
from vkvagent.adapters.fleet import EtcdClient, FleetError
from vkvagent.processes import stop_process


def require_etcd() -> str:
    """The etcd binary; skip without it, except under CI=true, where it fails."""
    found = shutil.which("etcd")
    if found is None:
        reason = "etcd not found (Debian's etcd-server package)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: not skipped)")
        pytest.skip(reason)
    return found


class Etcd:
    """A one-member etcd on two free loopback ports, its data in ``directory``."""

    def __init__(self, directory: Path, *extra: str, scheme: str = "http", **client: str) -> None:
        self.binary = require_etcd()
        self.directory = directory
        self.port, self.peer = free_port(), free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.extra, self.client = extra, client  # etcd's own flags; EtcdClient's TLS files
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Etcd:
        peer = f"http://127.0.0.1:{self.peer}"
        with open(self.directory / "etcd.log", "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary, "--name", "test", "--data-dir", str(self.directory / "data"),
                    "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                    "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"test={peer}", "--log-level", "warn", *self.extra,
                ],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        client = EtcdClient([self.url], timeout=0.5, **self.client)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.range_prefix("/")
                return self
            except FleetError as exc:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log_text = (self.directory / "etcd.log").read_text(errors="replace")
                    raise RuntimeError(
                        f"etcd did not start (exit status {self.process.poll()}; the client "
                        f"said: {exc}): {log_text[-2000:]}"
                    ) from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
        self.process = None
