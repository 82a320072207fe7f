"""Benchmark: how many /metrics requests per second the simulator answers on one core.

The simulator runs as its own process pinned to CPU 0; the load comes from this process over
keep-alive loopback connections. At time scale 1 the page changes every 0.5 s (one simulated
step), so it is mostly served from the render cache; at time scale 600 a new step is due on
nearly every request, so nearly every request renders. Run with ``make bench``.
"""

from __future__ import annotations

import http.client
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.simproc import SimProcess  # noqa: E402 - after the path is set

SECONDS = 3.0
CLIENTS = 4


def load(port: int) -> tuple[int, list[float]]:
    """Requests answered in SECONDS by CLIENTS keep-alive connections, and their latencies."""
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        mine = []
        while time.monotonic() < deadline:
            start = time.perf_counter()
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            response.read()
            assert response.status == 200
            mine.append((time.perf_counter() - start) * 1e3)
        connection.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(latencies), latencies


def main() -> None:
    print(f"/metrics served by one simulator process pinned to CPU 0; {CLIENTS} keep-alive "
          f"clients for {SECONDS:g} s each run; Python {sys.version.split()[0]}")  # fmt: skip
    print()
    print("| flavour | engines | time scale | requests/s | latency p50 (ms) | p90 (ms) |")
    print("|---|---|---|---|---|---|")
    for flavor, engines, scale in (
        ("v1-latest", 1, 1), ("v1-latest", 1, 600), ("v1-latest", 4, 600), ("v0", 1, 600),
    ):  # fmt: skip
        extra = ["--data-parallel-size", str(engines)] if engines > 1 else []
        with SimProcess("meta-llama/Llama-3.1-8B-Instruct", "--metrics-flavor", flavor,
                        "--time-scale", str(scale), *extra) as sim:  # fmt: skip
            assert sim.process is not None
            os.sched_setaffinity(sim.process.pid, {0})
            for thread_dir in Path(f"/proc/{sim.process.pid}/task").iterdir():
                subprocess.run(["taskset", "-p", "-c", "0", thread_dir.name],
                               check=False, capture_output=True)  # fmt: skip
            count, latencies = load(sim.port)
        q = statistics.quantiles(latencies, n=10)
        print(f"| {flavor} | {engines} | {scale} | {count / SECONDS:.0f} | "
              f"{statistics.median(latencies):.2f} | {q[-1]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
