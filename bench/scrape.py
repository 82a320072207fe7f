"""Benchmark: CPU time to scrape and normalise a realistic ~200 KB vLLM V1 page.

Compared, in the same run, with a plain full parse by prometheus_client's parser, and with
the RSS of a process that has imported the daemon's modules. Run with ``make bench``.
"""

from __future__ import annotations

import http.server
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge.vllm_metrics import Normaliser

ROOT = Path(__file__).resolve().parent.parent
SOURCE_PAGE = ROOT / "tests" / "fixtures" / "metrics" / "v1-2026.prom"
REPEATS = 300


def big_page() -> str:
    """The 2026 four-engine page plus a fifth engine: about 200 KB, full histograms."""
    out = []
    for line in SOURCE_PAGE.read_text(encoding="utf-8").splitlines(keepends=True):
        out.append(line)
        if 'engine="3"' in line:
            out.append(line.replace('engine="3"', 'engine="4"'))
    return "".join(out)


def cpu_ms(action: Callable[[], object], repeats: int = REPEATS) -> list[float]:
    for _ in range(5):  # warm up: imports, caches, allocator
        action()
    samples = []
    for _ in range(repeats):
        start = time.process_time_ns()
        action()
        samples.append((time.process_time_ns() - start) / 1e6)
    return samples


def serve(body: bytes) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def rss_kib(code: str) -> int:
    probe = code + "\nprint([l for l in open('/proc/self/status') if l.startswith('VmRSS')][0])"
    line = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout
    return int(line.split()[1])


def wall_ms(action: Callable[[], object], repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def row(name: str, samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=10)
    return f"| {name} | {statistics.median(samples):.2f} | {q[0]:.2f} | {q[-1]:.2f} |"


def main() -> None:
    text = big_page()
    lines = text.count("\n")
    warm = Normaliser()
    full = cpu_ms(lambda: list(text_string_to_metric_families(text)), repeats=60)
    normalise_warm = cpu_ms(lambda: warm.normalise(text))
    normalise_cold = cpu_ms(lambda: Normaliser().normalise(text), repeats=100)
    server, url = serve(text.encode())
    client = VllmClient(url)
    scrape = cpu_ms(client.scrape)
    scrape_wall = wall_ms(client.scrape, REPEATS)
    server.shutdown()
    bare = rss_kib("import sys")
    daemon = rss_kib(
        "import vkvagent.tools.cli, vkvagent.knowledge.config, vkvagent.adapters.gpu, "
        "vkvagent.adapters.history, vkvagent.knowledge.vllm_metrics, vkvagent.adapters.sampler, "
        "vkvagent.engine, vkvagent.adapters.vllm"
    )
    ratio = statistics.median(full) / statistics.median(scrape)
    print(
        f"page: {len(text) / 1024:.0f} KiB, {lines} lines, 5 engines; "
        f"Python {sys.version.split()[0]}; {REPEATS} repeats (60 for the full parse)"
    )
    print()
    print("| CPU time per call (ms) | median | p10 | p90 |")
    print("|---|---|---|---|")
    print(row("baseline: prometheus_client full parse", full))
    print(row("normalise, first page (cold label cache)", normalise_cold))
    print(row("normalise, repeated scrapes (warm cache)", normalise_warm))
    print(row("scrape over loopback HTTP + normalise (warm)", scrape))
    print(row("  same, wall-clock", scrape_wall))
    print()
    print(f"full parse / scrape+normalise (medians): {ratio:.1f}x")
    print(
        f"RSS: bare python {bare / 1024:.1f} MiB; with the daemon's modules "
        f"{daemon / 1024:.1f} MiB (+{(daemon - bare) / 1024:.1f} MiB)"
    )


if __name__ == "__main__":
    main()
