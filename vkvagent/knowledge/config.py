"""The agent's configuration: its sections, where its files are, and ``load()``.

Files are read in order (main file, then ``conf.d/*.toml`` by name; later files win key by key).
Every problem is reported as ``file:line: key: problem (allowed: ...)`` and all problems are
collected before failing, so one ``vkvagent config check`` run shows everything to fix. The
machinery that declares keys, reads, checks and renders them is ``toml_schema``'s; here are
vkvagent's keys, the checks of their values, and the rules between keys (the engine's).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from vkvagent import hooks
from vkvagent.engine import policy
from vkvagent.engine.baseline import BaselineSettings
from vkvagent.engine.diagnosis import FIXABLE, DiagnosisSettings
from vkvagent.engine.liveness import LivenessSettings
from vkvagent.engine.policy import PolicySettings
from vkvagent.engine.slo import SloSettings
from vkvagent.engine.tick import Settings
from vkvagent.errors import NeedsOperator
from vkvagent.knowledge import flags
from vkvagent.knowledge.reconcile import APPLY_MODES
from vkvagent.knowledge.toml_schema import read, section, setting, show, table, toml_value

DEFAULT_DIR = Path("/etc/vkvagent")
MAIN_FILE = "config.toml"
DROPIN_DIR = "conf.d"


@dataclass(frozen=True)
class AgentConfig:
    state_dir: str = setting(
        "/var/lib/vkvagent", "Directory for the history database and the agent's state."
    )
    sample_interval: float = setting(
        10.0, "Seconds between two samples of vLLM, the GPUs and the unit.", min=1, max=3600
    )
    reminder: float = setting(
        3600.0,
        "Seconds between journal reminders of a decision that has not changed (a change is "
        "logged at once).",
        min=60,
        max=86400,
    )


def _check_listen(text: str) -> str | None:
    host, colon, port = text.rpartition(":")
    if text and not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        return f"{text!r} is not HOST:PORT (e.g. 127.0.0.1:9849; empty: no endpoint)"
    return None


@dataclass(frozen=True)
class MetricsConfig:
    listen: str = setting(
        "127.0.0.1:9849",
        "HOST:PORT of vkvagent's own Prometheus endpoint (vkvagent_* metrics) and of GET "
        "/ready for load balancers (0.0.0.0:9849 lets them reach it); empty: none.",
        check=_check_listen,
    )
    textfile: str = setting(
        "",
        "Also write the metrics to this file for node_exporter's textfile collector (e.g. "
        "/var/lib/node_exporter/textfile_collector/vkvagent.prom; the hardened unit needs a "
        "drop-in to write there, which `vkvagent config check` prints); empty: no file.",
    )


_UNIT_NAME = re.compile(r"[A-Za-z0-9:_.\\@-]{1,250}\.service")
# systemd's unit types: a name ending in none of them is a service's (systemctl's reading).
_UNIT_TYPES = ("service", "socket", "device", "mount", "automount", "swap", "target", "path",
               "timer", "slice", "scope")  # fmt: skip


def _service_name(name: str) -> str:
    """``vllm`` means ``vllm.service``, as ``systemctl restart vllm`` reads it."""
    _stem, dot, kind = name.rpartition(".")
    if not name or (dot and kind in _UNIT_TYPES):
        return name
    return f"{name}.service"


def _check_unit(name: str) -> str | None:
    """A service unit name as systemd allows it: it becomes part of a path under
    /etc/systemd/system, so nothing else may pass."""
    if not _UNIT_NAME.fullmatch(name) or name.startswith(".") or ".." in name:
        return f"{name!r} is not a service unit name (allowed: e.g. vllm.service, vllm@a.service)"
    return None


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from being vLLM's base URL (http or https, a host, a port from 1 to
    65535), or None; ``adapters.vllm.base_url`` refuses the same."""
    try:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number or out of range, a bracket unclosed
        valid = False
    if not valid:
        return f"{url!r} is not an http(s) URL (e.g. http://127.0.0.1:8000)"
    return None


def _check_flag(key: str, value: Any) -> str | None:
    try:
        flags.validate({key: value}, None, check_versions=False)
    except flags.FlagError as exc:
        return "; ".join(p.split(": ", 1)[-1] for p in exc.problems)
    return None


@dataclass(frozen=True)
class VllmConfig:
    unit: str = setting(
        "vllm.service",
        "The systemd unit that runs vLLM; a name without a type suffix is a service's (vllm: "
        "vllm.service). Another than vllm.service needs a drop-in for the hardened unit, "
        "which `vkvagent config check` prints.",
        check=_check_unit,
        complete=_service_name,
    )
    url: str = setting(
        "http://127.0.0.1:8000",
        "Base URL of vLLM's OpenAI server; /metrics and /version are read below it. https:// "
        "for a vLLM started with --ssl-certfile; its certificate is verified.",
        check=url_problem,
    )
    ca_file: str = setting(
        "", "CA bundle that signed an https vLLM's certificate; empty: the system's."
    )
    api_key_file: str = setting(
        "",
        "File holding vLLM's API key (first line), for the probe; only its owner may read it. "
        "Empty: the unit's own --api-key, Environment=VLLM_API_KEY or EnvironmentFile=.",
    )
    model: str = setting(
        "", "Read only series whose model_name is this; empty reads every model, summed."
    )
    version: str = setting(
        "", "vLLM version to assume when GET /version does not answer; empty: detect it."
    )
    connect_timeout: float = setting(
        2.0, "Seconds to wait for vLLM to accept the connection.", min=0.05, max=60
    )
    read_timeout: float = setting(
        5.0,
        "Seconds vLLM may stay silent mid-response; connect_timeout + read_timeout bounds the "
        "whole exchange, however slowly it trickles.",
        min=0.1,
        max=300,
    )
    max_page_bytes: int = setting(
        8 * 1024 * 1024,
        "Largest /metrics page accepted, in bytes; a larger one is refused, not truncated.",
        min=64 * 1024,
        max=512 * 1024 * 1024,
    )
    flags: Mapping[str, Any] = table(
        "vLLM flags vkvagent keeps on the unit's command line ([vllm.flags], e.g. "
        "gpu-memory-utilization = 0.88), through a drop-in; `vkvagent plan` shows the change.",
        _check_flag,
    )
    apply_flags: str = setting(
        "next-window",
        "When the daemon (mode enforce) applies [vllm.flags] the unit does not run yet: "
        "next-window (a restart for them in the next window the policy allows), "
        "with-next-restart (only with a restart that happens anyway) or manual (only "
        "`vkvagent apply`). Any restart but in manual carries them.",
        choices=APPLY_MODES,
    )
    rollback_margin: float = setting(
        0.20,
        "A flag change whose run is slower than the run before it by more than this fraction "
        "(fresh speed at the loads both served) is rolled back in the next window and its "
        "flag set rejected until [vllm.flags] changes; 1 never rolls back.",
        min=0.01, max=1,
    )  # fmt: skip


@dataclass(frozen=True)
class GpuConfig:
    enabled: bool = setting(True, "Read the GPUs through NVML (nvidia-ml-py).")
    devices: tuple[int, ...] = setting(
        (), "Indices of the GPUs vLLM uses; empty watches every GPU.", item=int, min=0, max=255
    )
    recording: str = setting(
        "",
        "Read GPU values from this file (made by `vkvagent gpu --record`, or kept current by "
        "`vkvagent sim serve --gpu-recording`) instead of NVML; empty: NVML.",
    )


@dataclass(frozen=True)
class HistoryConfig:
    retention_days: float = setting(
        8.0, "Days of samples kept in the history database.", min=0.04, max=400
    )


@dataclass(frozen=True)
class RestartConfig:
    drain_max_in_flight: int = setting(
        0, "Requests (running + waiting) allowed in flight when a restart begins.", min=0,
        max=100000,
    )  # fmt: skip
    drain_timeout: float = setting(
        120.0,
        "Seconds a drain may take: vLLM's own graceful shutdown (its --shutdown-timeout), or "
        "the wait for a quiet moment where vLLM cannot drain by itself.",
        min=0, max=3600,
    )  # fmt: skip
    graceful_shutdown: bool = setting(
        True,
        "Where vLLM has --shutdown-timeout (0.18 and newer), set it to drain_timeout in "
        "vkvagent's drop-in, with TimeoutStopSec= above it and KillMode=mixed, so that "
        "stopping vLLM finishes the requests in flight and admits no new ones.",
    )
    when_busy: str = setting(
        "proceed",
        "Where vLLM cannot drain by itself and requests are still in flight after "
        "drain_timeout: proceed (the requests in flight are cut off, and counted) or give-up "
        "(the restart is abandoned; the policy asks again later).",
        choices=("proceed", "give-up"),
    )
    pre_stop: tuple[str, ...] = setting(
        (),
        "Command run before vLLM is stopped (e.g. take this host out of the load balancer), "
        "as an argv list without a shell, program by absolute path. A failure abandons the "
        "restart before anything changed.",
        item=str,
    )
    post_ready: tuple[str, ...] = setting(
        (),
        "Command run once vLLM serves again (e.g. put the host back). A failure is reported; "
        "the restart still counts as done.",
        item=str,
    )
    hook_timeout: float = setting(
        60.0, "Seconds pre_stop or post_ready may run before it is killed.", min=1, max=3600
    )
    job_timeout: float = setting(
        120.0,
        "Seconds systemd's restart job may take (stopping included), besides vLLM's own drain.",
        min=1, max=3600,
    )  # fmt: skip
    ready_timeout: float = setting(
        600.0,
        "Seconds for vLLM to answer again and make progress after a restart; real cold "
        "starts (weights, torch.compile, CUDA graphs) take minutes.",
        min=5,
        max=7200,
    )
    start_timeout: float = setting(
        0.0,
        "Seconds a start of vLLM may take, whoever started it (vkvagent, systemd's Restart=, "
        "a person), before it counts as failed and vLLM is restarted: 0 learns it, 3 times "
        "the longest start this host measured (at least 120), and ready_timeout until one "
        "is measured. Set, it also bounds vkvagent's own restarts when below ready_timeout.",
        min=0,
        max=7200,
    )

    def check(self) -> None:
        """ValueError when a hook cannot run."""
        for name in ("pre_stop", "post_ready"):
            problem = hooks.check_argv(getattr(self, name))
            if problem:
                raise ValueError(f"restart: the {name} program {problem}")


# -- the decision engine (vkvagent.engine): one section per stage, mirroring its settings --------
# Defaults come from the engine's own settings classes, so the two cannot drift apart; the
# engine's cross-field rules (enter_ratio <= leave_ratio, ...) are checked by building them.

_B, _D, _P, _S = BaselineSettings, DiagnosisSettings, PolicySettings, SloSettings
_L = LivenessSettings
DAY = 86400.0
WEEK = 7 * DAY


@dataclass(frozen=True)
class ProbeConfig:
    enabled: bool = setting(
        True,
        "Send vLLM one tiny completion (1 token) when its counters have not moved for `after` "
        "seconds: the only way to tell an idle server from a hung one whose gauges read 0.",
    )
    after: float = setting(
        DiagnosisSettings().probe_after,
        "Seconds without a token or engine step before a probe is sent, and between probes.",
        min=5, max=DAY,
    )  # fmt: skip
    timeout: float = setting(
        30.0,
        "Seconds a probe may take, from connecting to the last byte of its answer.",
        min=1, max=600,
    )  # fmt: skip
    model: str = setting(
        "",
        "The served model name to probe; empty: the one /metrics names (set it when vLLM "
        "serves several).",
    )


@dataclass(frozen=True)
class BaselineConfig:
    window: float = setting(
        _B.window,
        "Seconds of samples summarised by one measurement (the trailing window compared "
        "with the baseline).",
        min=10, max=3600,
    )  # fmt: skip
    warmup: float = setting(
        _B.warmup,
        "Seconds of uptime after each vLLM (re)start left out of the baseline (CUDA graphs, "
        "caches and the first burst settle).",
        min=0, max=DAY,
    )  # fmt: skip
    learn_for: float = setting(
        _B.learn_for,
        "Seconds from the run's first busy window after the warm-up during which it counts "
        "as fresh and its baseline is learned.",
        min=60, max=WEEK,
    )  # fmt: skip
    learn_within: float = setting(
        _B.learn_within,
        "Uptime (seconds) by which a run's first busy window must come for its baseline to "
        "count as fresh; a run first busy later (idle for hours, or already running when "
        "vkvagent started) learns a late baseline, which never stands in for another run.",
        min=0, max=WEEK,
    )  # fmt: skip
    value_interval: float = setting(
        _B.value_interval,
        "At most one window value kept per this many seconds.",
        min=1, max=3600,
    )  # fmt: skip
    min_values: int = setting(
        _B.min_values,
        "Window values a load regime needs before its baseline is known (unknown never "
        "restarts); at most max_values.",
        min=1, max=1000,
    )  # fmt: skip
    max_values: int = setting(
        _B.max_values, "Window values kept per load regime.", min=1, max=10000
    )
    buckets_per_octave: int = setting(
        _B.buckets_per_octave,
        "Load regimes per doubling of generated tokens/s (2: 1024-1448, 1448-2048, ...).",
        min=1, max=8,
    )  # fmt: skip
    min_running: float = setting(
        _B.min_running,
        "Mean running requests below which the server counts as idle (no regime).",
        min=0, max=100000,
    )  # fmt: skip

    def settings(self) -> BaselineSettings:
        """The engine's settings; ValueError when keys contradict each other."""
        return BaselineSettings(**_values(self))


@dataclass(frozen=True)
class DiagnosisConfig:
    enter_ratio: float = setting(
        _D.enter_ratio,
        "Speed (current / this run's fresh baseline at the same load) below which the "
        "server is degraded; at most leave_ratio.",
        min=0.05, max=1,
    )  # fmt: skip
    leave_ratio: float = setting(
        _D.leave_ratio,
        "Speed above which a degraded server counts as recovered (hysteresis).",
        min=0.05, max=1,
    )  # fmt: skip
    trend_loss: float = setting(
        _D.trend_loss,
        "Also degraded: speed below 1 - this (until above 1 - this / 2) in a run whose own "
        "speed, by half hour of uptime, has fallen steadily by this much (a hinge fit).",
        min=0.01, max=0.95,
    )  # fmt: skip
    hold: float = setting(_D.hold, "Seconds a symptom must last before it counts.", min=0, max=DAY)
    kv_full: float = setting(
        _D.kv_full,
        "Mean KV-cache usage (0..1) at or above which the cache is near full.",
        min=0.05, max=1,
    )  # fmt: skip
    kv_stranded_below: float = setting(
        _D.kv_stranded_below,
        "KV-cache usage below which requests waiting mean stranded KV (kv_stranded); at most "
        "kv_full.",
        min=0.05, max=1,
    )  # fmt: skip
    kv_leak: float = setting(
        _D.kv_leak,
        "Share of the KV cache held beyond what the running requests take at their fresh "
        "share, at least this and enough that the heaviest load this run served cleanly (no "
        "preemption, no queue) would fill the cache, held for `hold`: blocks leak "
        "(kv_pressure), seen at any load before they bind.",
        min=0.01, max=1,
    )  # fmt: skip
    min_waiting: float = setting(
        _D.min_waiting,
        "Mean waiting requests that count as requests waiting.",
        min=0, max=100000,
    )  # fmt: skip
    min_preemptions_per_s: float = setting(
        _D.min_preemptions_per_s,
        "Preemptions per second that count as preempting.",
        min=0, max=100000,
    )  # fmt: skip
    load_tolerance: float = setting(
        _D.load_tolerance,
        "Demand above the fresh run's clean capacity x (1 + this) is more load, not "
        "degradation (load_shift).",
        min=0, max=10,
    )  # fmt: skip
    mix_tolerance: float = setting(
        _D.mix_tolerance,
        "Prompt or generated tokens per request more than (1 + this) times, or less than "
        "1 / (1 + this) times, the fresh run's: another request mix (load_shift).",
        min=0.05, max=10,
    )  # fmt: skip
    prefix_drop: float = setting(
        _D.prefix_drop,
        "The prefix-cache hit ratio this far below the fresh run's: another request mix "
        "(load_shift).",
        min=0.01, max=1,
    )  # fmt: skip
    stall_after: float = setting(
        _D.stall_after,
        "Seconds with requests pending and no token or engine step before it is a stall.",
        min=10, max=DAY,
    )  # fmt: skip
    unresponsive_after: float = setting(
        _D.unresponsive_after,
        "Seconds vLLM may accept connections on /metrics without answering, while its unit is "
        "active and after it has answered once since starting, before it is unresponsive.",
        min=10, max=DAY,
    )  # fmt: skip
    throttle_clock_drop: float = setting(
        _D.throttle_clock_drop,
        "A GPU with a throttle reason counts as throttled when its SM clock is below "
        "(1 - this) x the clock the fresh server ran at this load, or x its maximum while "
        "that is unknown (then the power cap alone, how a busy GPU runs, does not count).",
        min=0, max=0.95,
    )  # fmt: skip
    fault_memory: float = setting(
        _D.fault_memory,
        "Seconds a fault XID (hardware, driver or unknown; docs/gpu-faults.md) or an "
        "uncorrectable ECC error keeps vetoing restarts.",
        min=0, max=WEEK,
    )  # fmt: skip
    memory_min_span: float = setting(
        _D.memory_min_span,
        "Seconds of this run's unit memory needed to judge memory growth.",
        min=60, max=WEEK,
    )  # fmt: skip
    memory_min_growth: float = setting(
        _D.memory_min_growth,
        "Bytes the unit's memory must grow in this run, along with requests served, to be "
        "host_memory_growth.",
        min=0, max=1e12,
    )  # fmt: skip
    memory_min_correlation: float = setting(
        _D.memory_min_correlation,
        "How steadily memory must follow requests served (correlation, 0..1).",
        min=0, max=1,
    )  # fmt: skip

    def settings(self) -> DiagnosisSettings:
        """The engine's settings; ValueError when keys contradict each other."""
        return DiagnosisSettings(**_values(self))


def _check_zone(value: Any) -> str | None:
    try:
        ZoneInfo(value)
    except (ZoneInfoNotFoundError, ValueError):
        return f"{show(value)} is not an IANA time zone (allowed: names like UTC, Europe/Paris)"
    return None


def _check_window(value: Any) -> str | None:
    try:
        policy.parse_window(value)
    except ValueError as exc:
        return str(exc).split(": ", 1)[-1]
    return None


@dataclass(frozen=True)
class PolicyConfig:
    mode: str = setting(
        _P.mode,
        "off: do nothing; observe: decide and log, never restart; enforce: restart when the "
        "policy allows.",
        choices=policy.MODES,
    )  # fmt: skip
    timezone: str = setting(
        _P.timezone, "IANA time zone the windows are written in.", check=_check_zone
    )
    windows: tuple[str, ...] = setting(
        _P.windows,
        "When non-emergency restarts may happen: 'DAYS HH:MM-HH:MM', DAYS as daily, *, mon, "
        "mon-fri, fri-mon or a comma list; an end before the start crosses midnight, from "
        "the days named (sun 23:00-01:00 ends Monday 01:00). Empty: emergencies only.",
        item=str, check=_check_window,
    )  # fmt: skip
    max_request_rate: float = setting(
        _P.max_request_rate,
        "Traffic gate inside a window: restart only below this many requests/s; 0: no gate.",
        min=0, max=1e6,
    )  # fmt: skip
    max_request_rate_percentile: float = setting(
        _P.max_request_rate_percentile,
        "Traffic gate relative to this host: restart in a window only when the request rate "
        "is at or below this percentile of this host's own rates at the same local hour "
        "(e.g. 25); 0: no gate. Until an hour of the day has 60 minutes of history, the gate "
        "holds restarts then (emergencies excepted).",
        min=0, max=100,
    )  # fmt: skip
    min_interval: float = setting(
        _P.min_interval,
        "Seconds between two restarts, whatever the cause.",
        min=0, max=WEEK,
    )  # fmt: skip
    max_per_day: int = setting(
        _P.max_per_day, "Restarts allowed in any rolling 24 hours.", min=1, max=1000
    )
    cooldown: float = setting(
        _P.cooldown,
        "Seconds after a restart during which non-emergency causes wait.",
        min=0, max=WEEK,
    )  # fmt: skip
    emergency: tuple[str, ...] = setting(
        _P.emergency,
        "Causes that may restart outside the windows, without a drain.",
        item=str, choices=tuple(sorted(FIXABLE)),
    )  # fmt: skip
    max_uptime: float = setting(
        _P.max_uptime,
        "Opt-in scheduled restart: once vLLM has run this many seconds, restart it in the "
        "next window; 0: never.",
        min=0, max=30 * DAY,
    )  # fmt: skip
    outside_windows: str = setting(
        _P.outside_windows,
        "Whether a restart for anything but an emergency may go outside the windows. never: "
        "the windows hold; only the causes in emergency go any time, and a memory leak that "
        "would reach MemoryMax before the next window goes ahead of it (before the OOM kill). "
        "when_cheaper, the opt-in: with an [slo], when the restart saves more latency budget "
        "until the next window than it spends of availability, and the availability budget "
        "left covers it; without one, when waiting for the next window would lose more "
        "service (speed or load lost x time) than the restart's outage (a diagnosed "
        "uptime_decline, a preventive restart, slower flags due for a rollback, a leaking KV "
        "cache).",
        choices=policy.OUTSIDE_WINDOWS,
    )  # fmt: skip
    prevent: bool = setting(
        _P.prevent,
        "Restart before the slowdown this server's own past runs predict: once runs "
        "diagnosed uptime_decline were cured by their restart, restart the same server "
        "(vLLM version, model, flags) at the uptime that costs least (onset and rate of "
        "their decline against the outage).",
    )  # fmt: skip
    escalate_after: int = setting(
        _P.escalate_after,
        "Restarts in a row that did not restore the fresh speed before vkvagent stops "
        "restarting and waits for `vkvagent resume`.",
        min=1, max=100,
    )  # fmt: skip
    crash_loop_exits: int = setting(
        _L.crash_loop_exits,
        "Exits of vLLM nobody asked for (systemd's Restart= counted, or the unit left down) "
        "within crash_loop_window that make a crash loop: vkvagent's starts for it then back "
        "off (1 min, doubling) and stop after escalate_after of them.",
        min=2, max=1000,
    )  # fmt: skip
    crash_loop_window: float = setting(
        _L.crash_loop_window,
        "Seconds over which exits are counted for crash_loop_exits.",
        min=60, max=WEEK,
    )  # fmt: skip

    def settings(self, restart: RestartConfig | None = None) -> PolicySettings:
        """The engine's settings (the drain's from [restart]); ValueError when keys
        contradict each other."""
        values = _values(self)
        for name in ("crash_loop_exits", "crash_loop_window"):  # liveness's (engine_settings)
            del values[name]
        r = restart or RestartConfig()
        return PolicySettings(
            **values, drain_max_in_flight=r.drain_max_in_flight, drain_timeout=r.drain_timeout
        )


def _values(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


@dataclass(frozen=True)
class SloConfig:
    # Each objective is declared by setting its target; the shares and the period only say
    # how much of it must hold, and over how long.
    availability: float | None = setting(
        _S.availability,
        "Availability objective: the share of requests served over period_days (not "
        "answered 5xx, not cut off by a restart, not refused while vLLM was down, loading or "
        "stalled), e.g. 0.999; unset: no availability objective.",
        min=0.5, max=0.99999, example=0.999,
    )  # fmt: skip
    period_days: float = setting(
        _S.period_days,
        "Days over which each objective's error budget is counted (a rolling period).",
        min=1, max=366,
    )  # fmt: skip
    ttft_seconds: float | None = setting(
        _S.ttft_seconds,
        "Time-to-first-token objective: seconds within which ttft_share of requests must get "
        "their first token (vLLM's TTFT histogram), e.g. 2; unset: no TTFT objective.",
        min=0.001, max=3600, example=2.0,
    )  # fmt: skip
    ttft_share: float = setting(
        _S.ttft_share,
        "The share of requests whose first token must come within ttft_seconds.",
        min=0.5, max=0.9999,
    )  # fmt: skip
    itl_seconds: float | None = setting(
        _S.itl_seconds,
        "Inter-token latency objective: seconds within which itl_share of output tokens must "
        "follow the one before (vLLM's ITL histogram), e.g. 0.1; unset: no ITL objective.",
        min=0.0001, max=60, example=0.1,
    )  # fmt: skip
    itl_share: float = setting(
        _S.itl_share,
        "The share of output tokens that must come within itl_seconds of the one before.",
        min=0.5, max=0.9999,
    )  # fmt: skip

    def settings(self) -> SloSettings:
        """The engine's settings; ValueError when keys contradict each other."""
        return SloSettings(**_values(self))


# -- fleets (adapters.fleet): at most max_concurrent hosts of a group restarting at once --

_FLEET_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _check_endpoint(url: str) -> str | None:
    match = re.fullmatch(r"(https?)://([^/:\s]+|\[[0-9a-fA-F:.]+\]):(\d{1,5})/?", url)
    if not match or not 0 < int(match.group(3)) < 65536:
        return f"{url!r} is not an etcd client URL (allowed: http(s)://HOST:PORT)"
    return None


def _check_fleet_name(name: str) -> str | None:
    if not _FLEET_NAME.fullmatch(name):
        return f"{name!r} is not a name (allowed: 1 to 64 of A-Z a-z 0-9 _ . -)"
    return None


def _check_prefix(prefix: str) -> str | None:
    if not re.fullmatch(r"(/[A-Za-z0-9_.-]+)+", prefix):
        return f"{prefix!r} is not a key prefix (allowed: e.g. /vkvagent/fleet, no trailing /)"
    return None


@dataclass(frozen=True)
class FleetConfig:
    endpoints: tuple[str, ...] = setting(
        (),
        "etcd client URLs (etcd 3.4 or newer, its v3 JSON gateway), e.g. "
        '["https://etcd1:2379", "https://etcd2:2379"]; empty: no fleet, this host restarts '
        "on its own policy alone.",
        item=str, check=_check_endpoint,
    )  # fmt: skip
    group: str = setting(
        "default",
        "Hosts that must not restart together (e.g. the replicas behind one load balancer) "
        "share a group.",
        check=_check_fleet_name,
    )
    max_concurrent: int = setting(
        1,
        "Hosts of the group that may restart at once (the same value on every host of it).",
        min=1, max=1000,
    )  # fmt: skip
    lease_ttl: int = setting(
        60,
        "Seconds a slot outlives a host that died holding it (the etcd lease, renewed every "
        "third of it while the restart runs). etcd grants at least its own minimum (2 s).",
        min=2, max=3600,
    )  # fmt: skip
    on_unreachable: str = setting(
        "hold",
        "When etcd does not answer: hold (no restart: fail closed) or emergency-only (causes "
        "in [policy] emergency restart without a slot; others are held).",
        choices=("hold", "emergency-only"),
    )  # fmt: skip
    prefix: str = setting(
        "/vkvagent/fleet", "etcd key prefix; slots are PREFIX/GROUP/slot-N.", check=_check_prefix
    )
    name: str = setting("", "This host's name in the slot holders; empty: its host name.")
    timeout: float = setting(
        2.0,
        "Seconds one etcd request may take, connecting included (each endpoint in turn).",
        min=0.1, max=30,
    )  # fmt: skip
    ca_file: str = setting("", "CA bundle to verify etcd's certificate; empty: the system's.")
    cert_file: str = setting("", "Client certificate (PEM) for etcd's TLS; empty: none.")
    key_file: str = setting("", "The client certificate's key (PEM).")
    username: str = setting("", "etcd user (etcd's auth); empty: no authentication.")
    password_file: str = setting(
        "",
        "File holding the etcd user's password (one line; keep it mode 0600). Never the "
        "password itself in the config.",
    )

    def check(self) -> None:
        """ValueError when keys contradict each other."""
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("fleet: cert_file and key_file go together")
        if bool(self.username) != bool(self.password_file):
            raise ValueError("fleet: username and password_file go together")


@dataclass(frozen=True)
class Config:
    agent: AgentConfig = section(AgentConfig, "The daemon itself.")
    metrics: MetricsConfig = section(MetricsConfig, "vkvagent's own Prometheus metrics.")
    vllm: VllmConfig = section(VllmConfig, "The vLLM server being watched.")
    probe: ProbeConfig = section(ProbeConfig, "The active probe: one tiny completion.")
    gpu: GpuConfig = section(GpuConfig, "GPU readings through NVML.")
    history: HistoryConfig = section(HistoryConfig, "The sample history kept on disk.")
    restart: RestartConfig = section(RestartConfig, "How vkvagent restarts vLLM.")
    baseline: BaselineConfig = section(
        BaselineConfig, "Baselines: what this vLLM run does while fresh, per load regime."
    )
    diagnosis: DiagnosisConfig = section(
        DiagnosisConfig, "Diagnosis: when the server counts as degraded, and why."
    )
    policy: PolicyConfig = section(
        PolicyConfig,
        "Policy: when a restart that would help may happen. The default mode, observe, never "
        'restarts: set mode = "enforce" to let vkvagent act.',
    )
    slo: SloConfig = section(
        SloConfig,
        "Service-level objectives: what clients were promised, measured from vLLM's own "
        "metrics; restarts spend their error budgets (docs/configuration.md). None is "
        "declared until a target (availability, ttft_seconds, itl_seconds) is set.",
    )
    fleet: FleetConfig = section(
        FleetConfig,
        "Fleets: at most max_concurrent hosts of a group restart at once, through etcd leases "
        "(docs/fleet.md). Off until endpoints are set.",
    )

    def engine_settings(self, mode: str | None = None) -> Settings:
        """The engine's settings from this (loaded, hence valid) configuration; ``mode``
        overrides ``policy.mode``."""
        rules = self.policy.settings(self.restart)
        if mode is not None:
            rules = dataclasses.replace(rules, mode=mode)
        # vLLM drains for as long as [vllm.flags] tells it to, which overrides drain_timeout.
        drain = flags.validate(self.vllm.flags, None, check_versions=False).get("shutdown-timeout")
        if isinstance(drain, int):
            rules = dataclasses.replace(rules, drain_timeout=float(drain))
        probe_after = self.probe.after if self.probe.enabled else 0.0
        return Settings(
            baseline=self.baseline.settings(),
            diagnosis=dataclasses.replace(self.diagnosis.settings(), probe_after=probe_after),
            policy=rules,
            slo=self.slo.settings(),
            liveness=LivenessSettings(
                start_timeout=self.restart.start_timeout,
                start_default=self.restart.ready_timeout,
                crash_loop_exits=self.policy.crash_loop_exits,
                crash_loop_window=self.policy.crash_loop_window,
            ),
        )


class ConfigError(NeedsOperator):
    """One or more problems in the configuration, one ``file:line: key: ...`` line each."""

    def __init__(self, problems: Sequence[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = tuple(problems)


# -- finding and reading the files -------------------------------------------------------------


def config_files(path: Path | None = None) -> list[Path]:
    """The files to read, in order: ``path`` alone if it is a file, else ``DIR/config.toml``
    (if present) then ``DIR/conf.d/*.toml`` by name, where DIR is ``path`` or /etc/vkvagent."""
    if path is not None and not path.is_dir():
        return [path]
    directory = path if path is not None else DEFAULT_DIR
    files = [directory / MAIN_FILE] if (directory / MAIN_FILE).exists() else []
    dropins = directory / DROPIN_DIR
    if dropins.is_dir():
        files += sorted(p for p in dropins.iterdir() if p.suffix == ".toml" and p.is_file())
    return files


# Left behind by editors and package managers, and skipped without a word: nobody meant them
# to be read. Any other file in conf.d not named *.toml (60-win.tom) is a mistake to report.
_LEFTOVERS = re.compile(
    r"^\.|~$|\.(bak|orig|old|disabled|swp|rpmnew|rpmsave|rpmorig)$|\.(dpkg|ucf)-"
)


SKIPPED = "ignored: conf.d reads only *.toml files"


def skipped_files(path: Path | None = None) -> list[Path]:
    """The files in conf.d that are not read because they are not ``*.toml``, leftovers of
    editors and package managers (``*~``, ``.*.swp``, ``*.dpkg-old``, ``*.bak``) left out."""
    if path is not None and not path.is_dir():
        return []
    dropins = (path if path is not None else DEFAULT_DIR) / DROPIN_DIR
    if not dropins.is_dir():
        return []
    return sorted(
        p
        for p in dropins.iterdir()
        if p.suffix != ".toml" and p.is_file() and not _LEFTOVERS.search(p.name)
    )


def load(
    path: Path | None = None, *, as_root: bool | None = None, notes: list[str] | None = None
) -> Config:
    """Read, merge and check the configuration. Raises ConfigError listing every problem.

    ``as_root`` (default: whether this process is root) refuses files and directories that
    someone other than root could have written. ``notes``, when given, receives a line for
    each thing read otherwise than written (a completed unit name, a conf.d file skipped)."""
    notes = [] if notes is None else notes
    if as_root is None:
        as_root = os.geteuid() == 0
    if path is not None and not path.exists():
        raise ConfigError([f"{path}: no such file or directory"])
    files = config_files(path)
    if path is not None and not files and path.is_dir():
        # conf.d itself, or a directory of loose files: none of them would be read.
        loose = sorted(p.name for p in path.glob("*.toml"))
        if loose:
            raise ConfigError([
                f"{path}: {', '.join(loose)} would not be read: a directory is read as its "
                f"{MAIN_FILE} and {DROPIN_DIR}/*.toml; name a file, or the directory that "
                f"holds {DROPIN_DIR}/"
            ])  # fmt: skip
    notes += [f"{p}: {SKIPPED}" for p in skipped_files(path)]
    built: Config  # of the valid keys: contradictions show too
    built, origins, problems = read(Config, files, as_root=as_root, notes=notes)
    problems += _engine_problems(built, origins)
    notes += _undeclared(built.slo, origins)
    if problems:
        raise ConfigError(problems)
    return built


def _engine_problems(built: Config, origins: Mapping[tuple[str, ...], str]) -> list[str]:
    """Keys that are each valid but contradict each other (enter_ratio above leave_ratio,
    ...), as the engine's settings classes find them, located at the keys they name."""
    problems = []
    parts: dict[str, Callable[[], object]] = {
        "baseline": built.baseline.settings,
        "diagnosis": built.diagnosis.settings,
        "policy": lambda: built.policy.settings(built.restart),
        "slo": built.slo.settings,
        "fleet": built.fleet.check,
        "restart": built.restart.check,
    }
    for name, make in parts.items():
        try:
            make()
        except ValueError as exc:
            message = str(exc).removeprefix(f"{name}: ")
            problems.append(_located(name, message, getattr(built, name), origins))
    return problems


UNDECLARED = "ignored: it shapes no objective declared"


def _undeclared(slo: SloConfig, origins: Mapping[tuple[str, ...], str]) -> list[str]:
    """[slo] keys set to other than their default where no target declares the objective
    they shape: the operator meant one that is not enforced."""
    targets = {"ttft_share": "ttft_seconds", "itl_share": "itl_seconds"}
    declared = (slo.availability, slo.ttft_seconds, slo.itl_seconds) != (None, None, None)
    notes = []
    for key in ("period_days", *targets):
        target = targets.get(key)
        meant = getattr(slo, key) != getattr(SloConfig(), key) and ("slo", key) in origins
        if meant and (not declared if target is None else getattr(slo, target) is None):
            needs = f"slo.{target}" if target else "availability, ttft_seconds or itl_seconds"
            notes.append(f"{origins[('slo', key)]}: slo.{key}: set without {needs}: {UNDECLARED}")
    return notes


def _located(name: str, message: str, values: Any, origins: Mapping[tuple[str, ...], str]) -> str:
    """``file:line: section.key: message (key = value, ...)``, at the first key the message
    names that a file set."""
    keys = sorted(
        (message.find(f.name), f.name)
        for f in dataclasses.fields(values)
        if re.search(rf"\b{f.name}\b", message)
    )
    named = [key for _at, key in keys]
    shown = ", ".join(f"{key} = {toml_value(getattr(values, key))}" for key in named)
    key = next((key for key in named if (name, key) in origins), None)
    located = f"{origins[(name, key)]}: {name}.{key}" if key else f"config: {name}"
    return f"{located}: {message}" + (f" ({shown})" if shown else "")
