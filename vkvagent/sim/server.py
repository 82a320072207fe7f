"""The simulated vLLM server process: vLLM's HTTP endpoints over the engine model.

Endpoints as vLLM serves them: ``/metrics`` (the chosen version's format), ``/health`` (200; 503
once the engine is dead; still 200 during a stall, as real vLLM), ``/v1/models`` (with
``max_model_len``), ``/version``, ``POST /v1/completions`` (one short completion, outside the
engine model, as the agent's probe asks; it waits while the engine stalls or hangs, as real
vLLM's does, and 404s a model it does not serve). The port refuses connections until the
cold start is over, as vLLM's does while it loads the model. ``/sim/state`` (GET) and
``/sim/scenario`` (POST ``{"scenario": NAME, "after": SECONDS}``) let tests watch and steer it.

Its answers on vLLM's API routes are counted in ``http_requests_total`` as vLLM's
prometheus_fastapi_instrumentator counts them, beside the workload's requests (``Cluster.http``).
"""

from __future__ import annotations

import http.server
import json
import math
import os
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from vkvagent.sim import exposition
from vkvagent.sim.capacity import Capacity, Cluster, EngineModel, Scenario, capacity
from vkvagent.sim.serve_args import ServeArgs, cache_config_labels
from vkvagent.sim.stats import COMPLETIONS, ServerInfo
from vkvagent.sim.workload import Workload, azure_sizes, constant, servegen_week

TICK = 0.1  # real seconds between background advances of the simulated clock
# A page is re-rendered at most this often (real seconds): at high time scales a new step is
# due on nearly every request, and rendering a four-engine page takes about 8 ms of CPU.
RENDER_INTERVAL = 0.05
MODEL_MAX_LEN = 32768  # the simulated model's context length (its max_position_embeddings)
# What vLLM's instrumentator counts: its routes by path (these are the ones simulated), any
# other path as "none" (untemplated, grouped), and nothing of the paths vLLM excludes. The
# /sim/ control endpoints are the simulator's own, not vLLM's, so they are not counted.
API_ROUTES = frozenset({("GET", "/v1/models"), ("POST", COMPLETIONS)})
UNCOUNTED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})


@dataclass(frozen=True)
class SimOptions:
    """The simulator's own options (everything that is not a vLLM flag)."""

    flavor: str = "v1-latest"
    scenario: str = "healthy"
    scenario_onset: float | None = None  # uptime seconds; None: the scenario's default
    time_scale: float = 1.0
    seed: int = 0
    cold_start: float = 30.0  # simulated seconds before the port opens
    workload: str = "constant"  # or "servegen": the ServeGen week
    rate: float = 2.0  # requests/s (constant), or the week's peak (servegen)
    gpu_recording: str = ""  # write GPU readings here, for the agent's recorded-readings mode
    leak_per_request: int = 64 * 1024  # bytes of host memory per request (memory-growth)
    leak_cap: int = 512 * 1024 * 1024
    world_epoch: float | None = None  # Unix time the simulated world began; None: now
    render_interval: float = RENDER_INTERVAL  # real seconds a /metrics page is served again


class Simulation:
    """The engine model on a clock that runs ``time_scale`` times faster than real time."""

    def __init__(
        self,
        args: ServeArgs,
        options: SimOptions,
        clock: Callable[[], float] = time.monotonic,
        version: str = "",
    ) -> None:
        self.args, self.options, self._clock = args, options, clock
        self._started = clock()
        self.lock = threading.Lock()
        self.max_model_len = args.max_model_len or MODEL_MAX_LEN
        self.capacity: Capacity = capacity(
            args.model,
            gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or 8192,
            max_model_len=self.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype,
            enforce_eager=args.enforce_eager,
            enable_prefix_caching=args.enable_prefix_caching,
            tensor_parallel_size=args.tensor_parallel_size,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            swap_space=args.swap_space or 0.0,
        )
        bounds = exposition.histogram_bounds(options.flavor, self.max_model_len)
        rng = random.Random(options.seed)
        curve = (servegen_week(options.rate) if options.workload == "servegen"
                 else constant(options.rate))  # fmt: skip
        self.cluster = Cluster(
            engines=[EngineModel(self.capacity, bounds) for _ in range(args.data_parallel_size)],
            workload=Workload(curve, azure_sizes(), rng),
            scenario=Scenario(options.scenario, options.scenario_onset),
            world_offset=max(0.0, time.time() - (options.world_epoch or time.time()))
            * options.time_scale,
        )
        self.info = ServerInfo(
            model=args.served_model_name or args.model,
            flavor=options.flavor,
            version=version,
            max_model_len=self.max_model_len,
            cache_config=cache_config_labels(
                args,
                options.flavor,
                self.capacity.num_gpu_blocks,
                max_model_len=self.max_model_len,
                num_cpu_blocks=self.capacity.num_cpu_blocks,
            ),
            start_time=time.time(),
        )
        self._answers = 0  # HTTP answers counted: a page showing fewer is out of date
        # step and answers it shows, real time rendered, page
        self._page: tuple[float, int, float, bytes] = (-1.0, 0, -math.inf, b"")
        self._leak: list[bytes] = []
        self._leaked = 0
        self._leak_from = 0
        self._gpu_written = ""

    def uptime(self) -> float:
        return (self._clock() - self._started) * self.options.time_scale

    def advance(self) -> None:
        with self.lock:
            self.cluster.advance_to(self.uptime())
            self._grow_memory()

    def metrics_page(self) -> bytes:
        """The current /metrics page: rendered again once the simulated clock has moved or an
        HTTP answer was counted, and ``render_interval`` (real seconds, RENDER_INTERVAL by
        default) has passed, so a page is never more than that stale: at a time scale X, X
        times that in simulated time."""
        self.advance()
        with self.lock:
            step, answers, rendered, page = self._page
            now = self._clock()
            shown = (self.cluster.now, self._answers)
            if (step, answers) != shown and now - rendered >= self.options.render_interval:
                page = exposition.render(
                    self.info, self.cluster.published(), time.time(), self.cluster.http
                )
                self._page = (*shown, now, page)
            return page

    def answered(self, method: str, path: str, status: int) -> None:
        """Count an answer of the HTTP server in ``http_requests_total``, as vLLM would."""
        if path in UNCOUNTED or path.startswith("/sim/"):
            return
        handler = path if (method, path) in API_ROUTES else "none"
        with self.lock:
            self.cluster.http.count(handler, method, status)
            self._answers += 1

    def drain(self, timeout: float, log: Callable[[str], None]) -> None:
        """vLLM 0.18+'s SIGTERM with ``--shutdown-timeout``: admit nothing more (a completion
        gets HTTP 500, counted as 5xx), let what is in flight finish for up to ``timeout`` real
        seconds while /metrics still answers, then go."""
        with self.lock:
            self.cluster.admitting = False
            left = self.cluster.in_flight
        log(f"[shutdown] EngineCore: draining in-flight requests count={left} timeout={timeout}s")
        deadline = self._clock() + timeout
        while left and self._clock() < deadline:
            time.sleep(TICK)
            self.advance()
            with self.lock:
                left = self.cluster.in_flight
        log("[shutdown] EngineCore: request processing complete" if not left else
            f"[shutdown] EngineCore: aborting in-flight requests count={left}")  # fmt: skip

    @property
    def admitting(self) -> bool:
        with self.lock:
            return self.cluster.admitting

    def busy(self) -> bool:
        """Whether the engine serves nothing now (stalled, hung or dead)."""
        self.advance()
        with self.lock:
            return self.cluster.stalled

    def switch(self, name: str, after: float = 0.0) -> None:
        """Start scenario ``name`` ``after`` simulated seconds from now."""
        with self.lock:
            self.cluster.advance_to(self.uptime())
            self.cluster.scenario = Scenario(name, self.cluster.now + after)
            self._leak_from = self.cluster.served

    def state(self) -> dict[str, Any]:
        with self.lock:
            state = self.cluster.state()
            state.update(
                flavor=self.options.flavor,
                time_scale=self.options.time_scale,
                host_memory_leaked_bytes=self._leaked,
                pid=os.getpid(),
            )
            return state

    def write_gpu_recording(self) -> None:
        path = self.options.gpu_recording
        if not path:
            return
        with self.lock:
            gpus = self.args.tensor_parallel_size * self.args.data_parallel_size
            text = json.dumps(self.cluster.gpu_recording(gpus))
        if text == self._gpu_written:
            return  # unchanged: readers would only parse it again
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(temporary, path)  # readers see the old file or the new one, never half
        self._gpu_written = text

    def _grow_memory(self) -> None:
        """memory-growth: really hold ``leak_per_request`` bytes per request served, so the
        unit's MemoryCurrent rises as systemd measures it (up to ``leak_cap``)."""
        if not self.cluster.scenario.active("memory-growth", self.cluster.now):
            return
        wanted = min(
            self.options.leak_cap,
            (self.cluster.served - self._leak_from) * self.options.leak_per_request,
        )
        while self._leaked < wanted:
            size = min(1 << 20, wanted - self._leaked)
            self._leak.append(b"\x01" * size)  # non-zero, so the pages are really touched
            self._leaked += size


def serve(args: ServeArgs, options: SimOptions, version: str) -> int:
    """Run the simulated server until SIGTERM/SIGINT; returns the exit status."""
    log = _logger()
    log(f"vLLM API server version {version} (simulated, metrics flavour {options.flavor})")
    log(f"non-default args: {_non_default(args)}")
    simulation = Simulation(args, options, version=version)
    cap = simulation.capacity
    tokens = cap.num_gpu_blocks * cap.block_size
    log(f"GPU KV cache size: {tokens:,} tokens")
    log(f"Maximum concurrency for {simulation.max_model_len:,} tokens per request: "
        f"{tokens / simulation.max_model_len:.2f}x")  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # Loading the model: the port stays closed, so connections are refused.
    if stop.wait(options.cold_start / options.time_scale):
        return 0
    if cap.num_gpu_blocks <= 0:  # what vLLM says when the weights leave no room for KV
        log("ValueError: No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine.")  # fmt: skip
        return 1
    server = http.server.ThreadingHTTPServer((args.host, args.port), _handler(simulation))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    log(f"Starting vLLM API server on http://{args.host}:{server.server_address[1]}")
    log("Application startup complete.")
    died = False
    try:
        while not stop.wait(TICK):
            simulation.advance()
            simulation.write_gpu_recording()
            if simulation.cluster.dead:
                log("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an "
                    "issue. See stack trace (above) for the root cause.")  # fmt: skip
                stop.wait(5.0 / options.time_scale)  # vLLM's launcher checks every 5 s
                died = True
                break
        if not died and args.shutdown_timeout:
            simulation.drain(args.shutdown_timeout, log)
    finally:
        log("Shutting down")
        server.shutdown()
        server.server_close()
    return 0  # also when the engine died, as vLLM 0.32 (vllm#48966): on-failure leaves it down


COMPLETION_WAIT = 600.0  # real seconds a completion waits for a stalled engine, at most


def _handler(simulation: Simulation) -> type[http.server.BaseHTTPRequestHandler]:
    info = simulation.info

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body leave in two writes: without this, Nagle's algorithm and the
            # client's delayed ACK hold each keep-alive response back 40 ms.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(
                    200, simulation.metrics_page(), "text/plain; version=0.0.4; charset=utf-8"
                )
            elif path == "/health":
                simulation.advance()
                self._send(503 if simulation.cluster.dead else 200, b"", "text/plain")
            elif path == "/version":
                self._json({"version": info.version})
            elif path == "/v1/models":
                self._json({"object": "list", "data": [{
                    "id": info.model, "object": "model", "created": int(info.start_time),
                    "owned_by": "vllm", "root": simulation.args.model, "parent": None,
                    "max_model_len": info.max_model_len,
                }]})  # fmt: skip
            elif path == "/sim/state":
                simulation.advance()
                self._json(simulation.state())
            else:
                self._json({"detail": "Not Found"}, 404)

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/v1/completions":
                self._complete()
                return
            if path != "/sim/scenario":
                self._json({"detail": "Not Found"}, 404)
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= 65536:
                    raise ValueError(f"bad Content-Length {length}")
                body = json.loads(self.rfile.read(length) or b"{}")
                simulation.switch(str(body["scenario"]), float(body.get("after", 0.0)))
            except (ValueError, KeyError, TypeError) as exc:
                self._json({"detail": str(exc)}, 400)
                return
            self._json(simulation.state())

        def _complete(self) -> None:
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 <= length <= 65536:
                    raise ValueError(f"bad Content-Length {length}")
                body = json.loads(self.rfile.read(length) or b"{}")
                model = str(body["model"])
            except (ValueError, KeyError, TypeError) as exc:
                self._json({"error": {"message": str(exc), "type": "BadRequestError",
                                      "code": 400}}, 400)  # fmt: skip
                return
            if model != info.model:
                message = f"The model `{model}` does not exist."
                self._json({"error": {"message": message, "type": "NotFoundError",
                                      "code": 404}}, 404)  # fmt: skip
                return
            if not simulation.admitting:  # what vLLM 0.32 answers while it drains
                refused = "cannot schedule new futures after shutdown"
                self._json({"error": {"message": refused, "type": "InternalServerError",
                                      "code": 500}}, 500)  # fmt: skip
                return
            # A stalled or hung engine answers nobody until it recovers (the client gives up
            # first); a dead one answers 500, as vLLM's EngineDeadError.
            deadline = time.monotonic() + COMPLETION_WAIT
            busy = simulation.busy()
            while busy and not simulation.cluster.dead and time.monotonic() < deadline:
                time.sleep(0.05)
                busy = simulation.busy()
            if busy:
                message = (
                    "EngineCore encountered an issue" if simulation.cluster.dead else "timeout"
                )
                self._json({"error": {"message": message, "type": "InternalServerError",
                                      "code": 500}}, 500)  # fmt: skip
                return
            self._json({
                "id": f"cmpl-sim-{time.monotonic_ns()}", "object": "text_completion",
                "created": int(time.time()), "model": model,
                "choices": [{"index": 0, "text": " the", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
            })  # fmt: skip

        def _json(self, value: Any, status: int = 200) -> None:
            self._send(status, json.dumps(value).encode(), "application/json")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            # Counted before the client has it, so a scrape right after the answer shows it.
            simulation.answered(self.command, self.path.split("?", 1)[0], status)
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # vLLM logs requests with --disable-log-requests off; the tests need quiet

    return Handler


def _non_default(args: ServeArgs) -> dict[str, Any]:
    return {name: getattr(args, name) for name in sorted(args.explicit)}


def _logger() -> Callable[[str], None]:
    def log(message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        print(f"INFO {stamp} [api_server.py] {message}", file=sys.stderr, flush=True)

    return log
