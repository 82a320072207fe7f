"""The daemon, ``vkvagent run``: sample, decide, act, report, on a schedule.

One apscheduler job runs the tick every ``sample_interval``: take a sample (vLLM, GPUs, the
unit over D-Bus), store it, run the engine, act on a restart decision through the actuator
(one action at a time, under the state directory's lock), then write the status, publish
the metrics and tell systemd the loop is alive (``WATCHDOG=1`` from the tick itself, so a hung
tick is killed by ``WatchdogSec=``). The main thread only waits for signals: SIGHUP reloads
(the new config is validated first; on error the old one stays), SIGTERM stops after the tick
in progress (an action still draining is abandoned before anything changed; one past that
point is finished, or completed by ``recover()`` at the next start).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

import sdnotify
from apscheduler.schedulers.background import BackgroundScheduler

from vkvagent import __version__, apikey, config, controls, fleet, status, unitlog
from vkvagent.actuator import DRAIN_FLAG, STOP_MARGIN, Actuator, ActuatorError, Outcome, Plan
from vkvagent.apikey import KeyFileError
from vkvagent.atomicfile import write_atomically
from vkvagent.engine import Decision, EngineState, Observation, Recent, decide
from vkvagent.engine.diagnosis import ProbeFacts
from vkvagent.engine.liveness import CAUSES as DOWN
from vkvagent.engine.policy import DAY, FLAGS, RestartRecord, window_state
from vkvagent.engine.rates import Rates, window_rates
from vkvagent.engine.samples import GpuReading, Sample, UnitFacts
from vkvagent.events import Events
from vkvagent.exporter import AgentMetrics, Exporter
from vkvagent.flags import FlagError, VllmCommandError, parse_command, rendered, shown
from vkvagent.gpu import reader_for
from vkvagent.history import History, HistoryError
from vkvagent.jsonsafe import finite
from vkvagent.ledger import Ledger, LedgerError
from vkvagent.probe import Prober, ProbeResult
from vkvagent.reconcile import FlagState, change_of, flags_key
from vkvagent.sampler import Sampler
from vkvagent.systemd import RELOAD_TIMEOUT, Systemd, SystemdError
from vkvagent.vllm import VllmClient

STATE_FILE = "engine.json"
RESTART_KINDS = ("restart", "apply", "rollback")
JOURNAL_LAG = 30.0  # seconds journald may take to hold a dead process's last lines
HISTORY_PRUNE_EVERY = 3600.0
# engine.json is rewritten (and fsynced) at most this often, and after every action: a crash
# costs at most this much of the state's progress, never the baseline. Every tick cost 1.5 ms.
STATE_EVERY = 60.0


@dataclass(frozen=True)
class Clock:
    """The daemon's clocks. ``scale`` > 1 runs the schedule that many times faster than real
    time (the demo's fast clock: ``wall`` and ``mono`` must then run fast too)."""

    wall: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic
    scale: float = 1.0


@dataclass(frozen=True)
class _FlagsDue:
    """A flag change waiting for a restart: [vllm.flags] to apply, or a slower change to
    roll back."""

    kind: str  # apply | rollback
    what: str  # "apply --max-num-seqs 4": for the decision's reason and the events
    plan: Plan
    key: str  # flags_key of the set applied (of the set rolled back, for a rollback)


class Parts:
    """What one configuration builds; a reload builds a new one and swaps it in whole."""

    def __init__(
        self,
        cfg: config.Config,
        clock: Clock,
        *,
        use_systemd: bool,
        progress: Callable[[str], None] = lambda _message: None,
        emit: Callable[..., None] = lambda *_args, **_fields: None,
    ) -> None:
        self.config = cfg
        # [fleet]: at most N hosts of a group restarting at once (None: no fleet configured)
        self.fleet = fleet.Gate(cfg.fleet, emit) if cfg.fleet.endpoints else None
        self.settings = cfg.engine_settings()
        self.state_dir = Path(cfg.agent.state_dir)
        self.state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        unit = cfg.vllm.unit
        self.systemd = Systemd() if use_systemd else None
        gpus = (
            reader_for(cfg.gpu.devices, cfg.gpu.recording, cfg.diagnosis.fault_memory)
            if cfg.gpu.enabled
            else None
        )
        bus = self.systemd
        self.sampler = Sampler(
            VllmClient.from_config(cfg.vllm),
            gpus,
            unit=(lambda: bus.unit(unit)) if bus is not None else None,
            version=cfg.vllm.version,
            wall=clock.wall,
            mono=clock.mono,
        )
        # The active probe: its timeout bounds the whole exchange. A reload builds a new one,
        # since what the old one found (or has in flight) was of the old server or settings.
        connect = min(cfg.vllm.connect_timeout, cfg.probe.timeout / 2)
        self.api_key = (
            apikey.read_key_file(cfg.vllm.api_key_file) if cfg.vllm.api_key_file else None
        )
        self.prober = Prober(
            VllmClient(
                cfg.vllm.url,
                connect_timeout=connect,
                read_timeout=cfg.probe.timeout - connect,
                ca_file=cfg.vllm.ca_file,
            ),
            wall=clock.wall,
            mono=clock.mono,
        )
        self.history = History(self.state_dir)
        self.ledger = Ledger(self.state_dir)
        self.actuator: Actuator | None = None
        if self.systemd is not None:
            self.actuator = Actuator.for_config(
                cfg,
                systemd=self.systemd,
                ledger=self.ledger,
                gpus=gpus,
                progress=progress,
                mono=clock.mono,
            )
        # What [vllm.flags] asks for, and of which vLLM version and unit invocation.
        self._plan: Plan | str | None = None
        self._planned_for: tuple[str | None, str | None] | None = None

    @property
    def action_seconds(self) -> float:
        """The longest a restart may take, all of its timeouts added (vLLM drains once: by
        itself during the stop, or in a wait for a quiet moment before it; a flag change that
        is rolled back reloads systemd and restarts vLLM twice)."""
        r = self.config.restart
        hooks = r.hook_timeout * (bool(r.pre_stop) + bool(r.post_ready))
        starts = 2 * (RELOAD_TIMEOUT + r.job_timeout + r.ready_timeout)
        return hooks + r.drain_timeout + STOP_MARGIN + starts + 60.0

    def flag_plan(self, vllm_version: str | None, invocation: str | None) -> Plan | str | None:
        """The change [vllm.flags] asks for, planned against the unit once per config, vLLM
        version and unit invocation (anyone's restart may have changed the command line), and
        again after ``replan()``; None without [vllm.flags] (or systemd). A string says why
        it cannot be planned: ``invalid: ...`` stays until one of those changes; ``unknown:
        ...`` (systemd did not answer, or no version to check the flags against yet) is asked
        again next time."""
        if not self.config.vllm.flags or self.actuator is None:
            return None
        version = vllm_version or self.config.vllm.version or None
        if self._plan is None or self._planned_for != (version, invocation):
            try:
                self._plan = self.actuator.plan(self.config.vllm.flags, version)
            except FlagError as exc:
                if version is None:  # a version-limited flag cannot be checked yet
                    return f"unknown: vLLM's version is not known yet: {exc}"
                self._plan = f"invalid: {exc}"
            except ActuatorError as exc:
                return f"unknown: {exc}"
            self._planned_for = (version, invocation)
        return self._plan

    def drain_flag_names(self) -> frozenset[str]:
        """The flags a restart adds for the drain (``--shutdown-timeout``), unless
        [vllm.flags] sets them itself: never part of the flag set a change is judged by."""
        if not self.config.restart.graceful_shutdown:
            return frozenset()
        return frozenset({DRAIN_FLAG.name}) - set(self.config.vllm.flags)

    def replan(self) -> None:
        """Forget the plan: an action may have changed the unit's command line."""
        self._plan = None

    def close(self) -> None:
        for closing in (self.history.close, self.ledger.close):
            with contextlib.suppress(Exception):
                closing()
        if self.systemd is not None:
            with contextlib.suppress(Exception):
                self.systemd.close()


class RememberedEvents:
    """The daemon's events, emitted as ever, the last few kept for the status: `vkvagent
    status` shows them as `systemctl status` shows a unit's last journal lines."""

    def __init__(self, events: Events, now: Callable[[], float]) -> None:
        self.events, self._now = events, now
        self.recent: deque[status.RecentEvent] = deque(maxlen=status.EVENTS_KEPT)

    def emit(self, name: str, message: str, **fields: Any) -> None:
        self.events.emit(name, message, **fields)
        if name != "decision.unchanged":  # a reminder says nothing new
            self.recent.append(status.RecentEvent(round(self._now(), 1), name, message[:300]))


class Daemon:
    def __init__(
        self,
        config_path: Path | None = None,
        *,
        clock: Clock = Clock(),
        events: Events | None = None,
        notify: Callable[[str], None] | None = None,
        use_systemd: bool = True,
    ) -> None:
        self.config_path, self.clock, self.use_systemd = config_path, clock, use_systemd
        self.events = RememberedEvents(events or Events.for_environment(now=clock.wall), clock.wall)
        self.notify = notify or sdnotify.SystemdNotifier().notify
        self.metrics = AgentMetrics()
        # ConfigError: `vkvagent run` exits 78 with the problems. The notes (a unit name
        # completed, a conf.d file not read) go into agent.started.
        self._config_notes: list[str] = []
        cfg = config.load(config_path, notes=self._config_notes)
        self.parts = Parts(
            cfg, clock, use_systemd=use_systemd, progress=self._progress, emit=self.events.emit
        )
        self._slot: fleet.Slot | None = None  # the fleet slot held while restarting
        self._acting: status.StatusReport | None = None  # the status while restarting
        self._progress_at = 0.0  # when the restart's progress was last written to it
        self.exporter = Exporter(self.metrics, cfg.metrics.listen, cfg.metrics.textfile)
        self.lock = threading.Lock()  # one tick or reload at a time
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._reload = False
        self.recent = Recent(self.parts.settings.baseline, margin=3 * cfg.agent.sample_interval)
        self.state, self.judged, self.trend, self.flag_state = self._load_state()
        self._flags_said: tuple[str, ...] = ()  # the pending or refused flags last reported
        self._logged: tuple[Any, ...] | None = None
        self._logged_at = -math.inf
        self._failing: dict[str, str] = {}  # source or "state" -> its last error
        # source -> its first failed sample's UTC and monotonic times
        self._failing_since: dict[str, tuple[float, float]] = {}
        self._pruned = -math.inf
        self._saved_at = -math.inf
        self.last: Decision | None = None
        self._unit_seen: UnitFacts | None = None  # the unit as the last sample saw it
        self._active_run = ""  # the invocation last seen active: its stop is an exit
        # Why vLLM is down, read from the journal per state of the unit (_why_down): (the
        # unit's state, who stopped it, vLLM's own error line, when first read, monotonic).
        self._down_read: tuple[tuple[Any, ...], str, str, float] | None = None
        self._restart_mono: dict[int, float] = {}  # ledger action id -> its monotonic start
        self._probe_failing = ""  # "outcome: detail" of the failing probes, reported once
        self._burning: dict[str, str] = {}  # objective -> its burn alert last reported

    @classmethod
    def offline(cls, config_path: Path, stream: TextIO, clock: Clock = Clock()) -> Daemon:
        """A daemon outside systemd (the demo, benchmarks, tests): no D-Bus, no actuator, no
        sd_notify; its events as JSON lines to ``stream``, stamped with ``clock``."""
        return cls(
            config_path,
            clock=clock,
            events=Events(stream=stream, now=clock.wall),
            notify=lambda _message: None,
            use_systemd=False,
        )

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        """Until SIGTERM or SIGINT. Returns the exit status."""
        logging.getLogger("apscheduler").setLevel(logging.ERROR)
        self._recover()
        scheduler = BackgroundScheduler(timezone=timezone.utc)
        scheduler.add_job(
            self._job,
            "interval",
            seconds=self.parts.config.agent.sample_interval / self.clock.scale,
            next_run_time=datetime.now(timezone.utc),
            max_instances=1,
            coalesce=True,
            misfire_grace_time=None,
            id="tick",
        )
        handlers = {
            signal.SIGTERM: self._on_stop,
            signal.SIGINT: self._on_stop,
            signal.SIGHUP: self._on_hup,
        }
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            scheduler.start()
            self.notify("READY=1\nSTATUS=started; first evaluation under way")
            cfg = self.parts.config
            self.events.emit(
                "agent.started",
                f"vkvagent {__version__} watching {cfg.vllm.unit} at {cfg.vllm.url}, mode "
                f"{cfg.policy.mode}",
                version=__version__,
                unit=cfg.vllm.unit,
                url=cfg.vllm.url,
                mode=cfg.policy.mode,
                config=[str(p) for p in config.config_files(self.config_path)],
                notes=self._config_notes,
                interval_s=cfg.agent.sample_interval,
            )
            while not self.stopping.is_set():
                self._wake.wait()
                self._wake.clear()
                if self._reload and not self.stopping.is_set():
                    self._reload = False
                    self.reload()
                    scheduler.reschedule_job(
                        "tick",
                        trigger="interval",
                        seconds=self.parts.config.agent.sample_interval / self.clock.scale,
                    )
        finally:
            self.notify("STOPPING=1")
            self.events.emit("agent.stopping", "vkvagent is stopping")
            scheduler.shutdown(wait=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
        return 0

    def stop(self) -> None:
        """Ask ``run`` to return (what SIGTERM does)."""
        self.stopping.set()
        self._wake.set()

    def _on_stop(self, _signum: int, _frame: object) -> None:
        self.stop()

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self._reload = True
        self._wake.set()

    def _job(self) -> None:
        try:
            self.tick()
        except Exception as exc:  # a bug: keep the loop (and its watchdog) honest about it
            self.notify(f"STATUS=tick failed: {type(exc).__name__}: {exc}")
            raise

    def close(self) -> None:
        self._write_state("state", self._save_state)
        self.exporter.close()
        self.parts.close()

    def reload(self) -> bool:
        """Read the config again; keep the old one (and say why) if the new one is invalid."""
        self.notify(
            f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}"
        )
        try:
            with self.lock:
                notes: list[str] = []
                cfg = config.load(self.config_path, notes=notes)
                parts = Parts(
                    cfg,
                    self.clock,
                    use_systemd=self.use_systemd,
                    progress=self._progress,
                    emit=self.events.emit,
                )
                old = self.parts
                self.parts = parts
                old.close()
                if (cfg.metrics.listen, cfg.metrics.textfile) != (
                    old.config.metrics.listen,
                    old.config.metrics.textfile,
                ):
                    self.exporter.close()
                    self.exporter = Exporter(self.metrics, cfg.metrics.listen, cfg.metrics.textfile)
                self.recent.keep = parts.settings.baseline.window + 3 * cfg.agent.sample_interval
                self._probe_failing = ""  # the new prober has not failed yet
        except (
            config.ConfigError, KeyFileError, HistoryError, LedgerError, OSError, SystemdError
        ) as exc:  # fmt: skip
            problems = str(exc).splitlines()
            self.events.emit(
                "agent.reload_failed",
                f"reload refused, keeping the running config: {problems[0]}",
                problems=problems,
            )
            self.notify("READY=1\nSTATUS=reload refused: the config is invalid; old config kept")
            return False
        self.events.emit(
            "agent.reloaded",
            f"config reloaded: mode {cfg.policy.mode}",
            mode=cfg.policy.mode,
            config=[str(p) for p in config.config_files(self.config_path)],
            notes=notes,
        )
        self.notify("READY=1\nSTATUS=config reloaded")
        return True

    # -- one tick ---------------------------------------------------------------------------

    def tick(self) -> Decision:
        with self.lock:
            p = self.parts
            sample = p.sampler.take()
            self._note_sources(sample)
            down = self._why_down(sample)
            self._note_unit(sample, down)
            self._write_state("history", lambda: p.history.append(sample))
            unit = sample.unit
            self.recent.add(
                sample,
                unit.growth_bytes if unit else None,
                unit.growth_source if unit else "",
            )
            now = datetime.fromtimestamp(sample.time, timezone.utc)
            restarts = self._restarts(sample.time, sample.mono)
            for result in p.prober.collect():
                self._note_probe(result)
            version = sample.vllm.version if sample.vllm else None
            invocation = sample.unit.invocation_id if sample.unit else None
            plan = p.flag_plan(version, invocation)
            self._notice_flag_change()
            due = self._flags_due(plan)
            observed = Observation(
                samples=tuple(self.recent.samples),
                unit_active=None if sample.unit is None else sample.unit.active_state == "active",
                memory=self.recent.memory,
                restarts=restarts,
                controls=controls.read(p.state_dir),
                flags=self._flags_in_effect(plan),
                probe=p.prober.facts() if p.config.probe.enabled else ProbeFacts(),
                unit_started=sample.unit.active_since if sample.unit else None,
                flags_due=self._proposed(due),
                flags_slower=self._slower(due),
                **down,
            )
            decision = decide(p.settings, self.state, observed, now)
            self.state = decision.state
            slo = self._slo(decision, sample.time)
            self._judge_flags(decision)
            if decision.probe_wanted:
                self._send_probe(sample)
            self._judge(decision)
            self._log(decision)
            self._say_flags(plan, due, decision)
            outcome = None
            if decision.action == "restart" and p.actuator is not None:
                # Say "acting" for as long as the restart may take, before it begins.
                acting = self._status(
                    sample, decision, restarts, plan, due, slo, stale_after=p.action_seconds
                )
                self._write_state("status", lambda: self._write_status(acting))
                self.metrics.update(acting)  # /ready says so while the restart runs
                self._acting = acting
                # Any restart carries the change due, but an emergency's: that one must not
                # risk vLLM's start on flags nobody has seen run.
                emergency = decision.cause in (*p.settings.policy.emergency, *DOWN)
                manual = p.config.vllm.apply_flags == "manual"
                carried = None if emergency or manual else due
                try:
                    outcome = self._restart(p.actuator, decision, carried)
                finally:
                    self._acting = None
                if carried is not None:
                    self._carried(carried, outcome)
                restarts = self._restarts(sample.time, sample.mono)
                p.replan()
                plan = p.flag_plan(version, invocation)
                self._notice_flag_change()
                due = self._flags_due(plan)
            self.last = decision
            self.metrics.count(
                action=decision.action,
                errors={
                    "vllm": sample.vllm_error is not None,
                    "gpu": sample.gpu_error is not None,
                    "systemd": sample.unit_error is not None,
                },
            )
            report = self._status(sample, decision, restarts, plan, due, slo)
            if outcome is not None or sample.time - self._saved_at >= STATE_EVERY:
                self._saved_at = sample.time
                self._write_state("state", self._save_state)
            self._write_state("status", lambda: self._write_status(report))
            self.metrics.update(report)
            self._write_state("textfile", self.exporter.publish)
            if sample.time - self._pruned >= HISTORY_PRUNE_EVERY:
                self._pruned = sample.time
                self._write_state(
                    "history", lambda: p.history.prune(sample.time, p.config.history.retention_days)
                )
            self.notify(f"WATCHDOG=1\nSTATUS={_status_line(report)}")
            return decision

    def _note_sources(self, sample: Sample) -> None:
        for source, error in (
            ("vllm", sample.vllm_error),
            ("gpu", sample.gpu_error),
            ("systemd", sample.unit_error),
        ):
            before = self._failing.get(source)
            if error is not None:
                self._failing[source] = error
                self._failing_since.setdefault(source, (sample.time, sample.mono))
            if error is not None and before is None:
                self.events.emit("source.failed", f"{source}: {error}", source=source, error=error)
            elif error is None and before is not None:
                del self._failing[source]
                del self._failing_since[source]
                self.events.emit(
                    "source.recovered", f"{source} answers again", source=source, error=before
                )

    def _note_unit(self, sample: Sample, down: dict[str, str]) -> None:
        """Report vLLM's process ending without vkvagent asking (a crash, the OOM killer, an
        engine that died and took the API server with it), with how it ended and its own
        error line. systemd's Restart= brings it back, or, when it stays down and nobody
        stopped it, the engine decides to start it (``dead``); the exits count toward a crash
        loop either way. A stop someone asked for is said as such."""
        before, now = self._unit_seen, sample.unit
        if now is not None:
            self._unit_seen = now
            if now.active_state == "active":
                self._active_run = now.invocation_id
        if before is None or now is None:
            return
        unit = self.parts.config.vllm.unit
        line = down.get("exit_line", "")
        fields: dict[str, Any] = {
            "unit": unit,
            "n_restarts": now.n_restarts,
            "active_state": now.active_state,
            "exit": now.last_exit or None,
            "error": line or None,
        }
        said = f"vLLM {now.last_exit or 'exited'}" + (f" ({line})" if line else "")
        # NRestarts counts Restart='s starts since the last requested one, which sets it to 0.
        if now.n_restarts > 0 and now.n_restarts != before.n_restarts:
            self.events.emit(
                "unit.exited",
                f"{unit}: {said}; systemd's Restart= started it again (automatic restart "
                f"{now.n_restarts} since the last requested start)",
                restarted_by_systemd=True,
                stopped_by=None,
                **fields,
            )
        # From active, or from the stop of an active run that a tick caught half-way (vLLM's
        # shutdown takes seconds); not a start that failed.
        elif now.active_state in ("failed", "inactive") and (
            before.active_state == "active"
            or (before.active_state == "deactivating" and before.invocation_id == self._active_run)
        ):
            stopped = down.get("stopped", "")
            if stopped:
                what = f"stopped on purpose ({stopped}); vkvagent leaves it down"
            else:  # vLLM 0.32 exits 0 when its engine dies: Restart=on-failure leaves it down.
                what = (
                    f"{said}, and systemd will not start it again (Restart="
                    f"{now.restart_policy or 'unknown'}); nobody stopped it"
                )
            self.events.emit(
                "unit.exited",
                f"{unit} is {now.active_state}: {what}",
                restarted_by_systemd=False,
                stopped_by=stopped or None,
                **fields,
            )

    def _why_down(self, sample: Sample) -> dict[str, str]:
        """With vLLM not answering: whether someone stopped its unit on purpose (a stop job
        or a kill they asked systemd for since it last became active) and vLLM's own error
        line, from the journal, read again when the unit's state changes, and while no line
        was found in the first JOURNAL_LAG seconds (journald may not have the dying process's
        last lines yet; a clean stop has none, and is not read again every tick)."""
        unit = sample.unit
        if unit is None or (sample.vllm is not None and unit.active_state == "active"):
            self._down_read = None  # the next outage reads afresh, if in the same state
            return {}
        key = (unit.active_state, unit.sub_state, unit.invocation_id, unit.n_restarts)
        read = self._down_read
        first = read[3] if read is not None and read[0] == key else sample.mono
        if read is None or read[0] != key or (not read[2] and sample.mono - first < JOURNAL_LAG):
            name, since = self.parts.config.vllm.unit, unit.active_since or 0.0
            stopped = (
                unitlog.stopped_on_purpose(name, since)
                if unit.active_state in ("inactive", "failed", "deactivating")
                else ""
            )
            line = unitlog.why_it_failed(name, since) or ""
            self._down_read = read = (key, stopped, line, first)
        return {"stopped": read[1], "exit_line": read[2]}

    def _send_probe(self, sample: Sample) -> None:
        """Send the probe the engine asked for (never when switched off: its settings then
        want none), unless one is in flight."""
        cfg = self.parts.config
        model = (
            cfg.probe.model or cfg.vllm.model or (sample.vllm.model_name if sample.vllm else None)
        )
        if model:
            # The operator's key file, else the key the unit gives vLLM now.
            self.parts.prober.client.api_key = self.parts.api_key or self.parts.sampler.unit_key
            self.parts.prober.send(model)
        else:
            self._probe_failed(
                "unusable", "vLLM names several models or none: set [probe] model to one"
            )

    def _note_probe(self, result: ProbeResult) -> None:
        """A finished probe: into the history and the metrics; an event when probes start
        failing (once per kind of failure) and when one is answered again."""
        self._write_state("history", lambda: self.parts.history.append_probe(result))
        self.metrics.count_probe(result.outcome, result.latency)
        if result.outcome != "ok":
            self._probe_failed(result.outcome, result.detail, result.latency)
        elif self._probe_failing:
            self._probe_failing = ""
            self.events.emit(
                "probe.recovered",
                f"the probe is answered again, in {result.latency:.2f} s",
                outcome=result.outcome,
                latency_s=result.latency,
            )

    def _probe_failed(self, outcome: str, detail: str, latency: float | None = None) -> None:
        if self._probe_failing.startswith(f"{outcome}:"):
            return
        self._probe_failing = f"{outcome}: {detail}"
        meaning = {
            "timeout": "no answer in time: the engine may be hung",
            "error": "vLLM answered with an error",
            "refused": "nothing listens: vLLM is down or loading",
            "unusable": "it can tell nothing until this is fixed",
        }[outcome]
        self.events.emit(
            "probe.failed",
            f"probe {outcome} ({meaning}): {detail}",
            outcome=outcome,
            latency_s=latency,
            error=detail,
        )

    def _write_state(self, what: str, write: Callable[[], object]) -> None:
        """Run a write to the state directory; a failure is an event (once until it works
        again), never the end of the loop: the next tick tries again."""
        key = f"state:{what}"
        try:
            write()
        except (OSError, HistoryError, LedgerError) as exc:
            if key not in self._failing:
                self._failing[key] = str(exc)
                self.events.emit(
                    "state.write_failed",
                    f"cannot write the {what}: {exc}",
                    what=what,
                    error=str(exc),
                )
            return
        if key in self._failing:
            del self._failing[key]
            self.events.emit("state.write_recovered", f"the {what} is written again", what=what)

    def _restarts(self, at: float, now_mono: float) -> tuple[RestartRecord, ...]:
        """Restarts in the ledger (the daemon's and manual ones) for the policy's budgets,
        each with its judged outcome, and the aborted attempts for its retry back-off.

        Each is placed on the monotonic clock, so a step of the wall clock changes no age:
        at the time the ledger took on this boot's clock, else (another boot's) at its
        wall-clock age when the daemon first read it, no less than zero, fixed from then on.
        A step back never forgets a restart; a step forward never ages one."""
        try:
            actions = self.parts.ledger.since(at - 8 * DAY)
        except LedgerError:
            return ()
        boot = self.parts.ledger.boot
        placed: dict[int, float] = {}
        for a in actions:
            began = self._restart_mono.get(a.id)
            if began is None:
                began = a.mono_on(boot)
            if began is None:
                began = now_mono - max(0.0, at - a.started)
            placed[a.id] = began
        self._restart_mono = placed
        return tuple(
            RestartRecord(
                a.started,
                a.reason.split(":", 1)[0],
                # A restart that failed (vLLM not back in time) helped nothing: it escalates
                # like one that did not restore the fresh speed.
                False if a.outcome == "failed" else self.judged.get(a.id),
                aborted=a.outcome == "aborted",
                mono=placed[a.id],
                cut_off=_cost(a.detail, "aborted"),
                refused=_cost(a.detail, "missed"),
            )
            for a in reversed(actions)
            if a.kind in RESTART_KINDS
        )

    def _slo(self, decision: Decision, at: float) -> status.SloStatus | None:
        """The objectives of [slo] for the status, and an event when one's burn alert rises
        (none to slow or fast, slow to fast) or stops; None, and no work, without [slo]."""
        settings = self.parts.settings.slo
        if not settings.declared:
            self._burning = {}
            return None
        objectives = tuple(
            status.SloObjective.from_json(o.to_json())
            for o in decision.state.slo.report(settings, at)
        )
        before, self._burning = self._burning, {o.objective: o.burning or "" for o in objectives}
        for o in objectives:
            was, alert = before.get(o.objective, ""), o.burning or ""
            if alert and (not was or (was, alert) == ("slow", "fast")):
                name, change = "slo.burning", f"burning {alert}"
            elif was and not alert:
                name, change = "slo.recovered", f"no longer burning {was}"
            else:
                continue
            self.events.emit(
                name,
                f"{o.objective} error budget {change} ({o.words}): burn rate "
                f"{status.burn_words(o.burn_rates)}; {status.budget_words(o.budget_remaining)}",
                objective=o.objective,
                words=o.words,
                target=o.target,
                alert=alert or was,
                burn_rates=dict(o.burn_rates),
                budget_remaining=o.budget_remaining,
                attainment=dict(o.attainment),
            )
        return status.SloStatus(settings.period_days, objectives)

    def _judge(self, decision: Decision) -> None:
        """Write the engine's judgement of the last restart (did the fresh speed come back?)
        to that restart, once."""
        if decision.recovered is None:
            return
        try:
            actions = [
                a
                for a in self.parts.ledger.recent(5)
                if a.kind in RESTART_KINDS and a.outcome == "done"
            ]
        except LedgerError:
            return
        if not actions or actions[0].id in self.judged:
            return
        action = actions[0]
        ignore = self.parts.drain_flag_names()
        if change_of(action.id, action.started, action.ended, action.detail, ignore):
            return  # new flags: the flags loop judges that run, against the flags before
        # Only the action that started this vLLM process (not a crash or an operator's
        # restart since) is judged by this run's speed.
        began = decision.state.run.started
        if began is not None and not action.started - 1 <= began <= (action.ended or began) + 1:
            return
        self.judged[action.id] = decision.recovered
        cause = action.reason.split(":", 1)[0]
        if decision.recovered:
            self.events.emit(
                "restart.recovered",
                f"action {action.id} ({cause}) restored the fresh speed",
                action=action.id,
                cause=cause,
            )
        else:
            self.metrics.count_restart(cause, "not-recovered")
            self.events.emit(
                "restart.not_recovered",
                f"action {action.id} ({cause}) did not restore the fresh speed",
                action=action.id,
                cause=cause,
            )

    def _log(self, decision: Decision) -> None:
        """A decision event when it changes, and a reminder while it does not."""
        # What vkvagent does, what it finds wrong and, when it holds back, what blocks it. With
        # nothing to do, a reason that only rewords that (the load moving between two regimes:
        # "healthy" then "unknown baseline") waits for the reminder.
        action, cause, head, run = decision.key()
        key = (action, cause, head if action != "none" else None, run)
        at = decision.time.timestamp()
        changed = key != self._logged
        if not changed and at - self._logged_at < self.parts.config.agent.reminder:
            return
        if changed and decision.reason.startswith("escalated"):
            self.events.emit("policy.escalated", decision.reason, cause=decision.cause)
        self._logged, self._logged_at = key, at
        self.events.emit(
            "decision.changed" if changed else "decision.unchanged",
            f"{decision.action}: {decision.reason}",
            **_decision_fields(decision),
        )

    def _restart(
        self, actuator: Actuator, decision: Decision, carried: _FlagsDue | None = None
    ) -> Outcome | None:
        """Restart, after taking a slot of the fleet's group when one is configured (none
        free, or etcd unreachable under on_unreachable = hold: not this tick; the next tick
        decides again). The slot is given back after the outcome, whatever it is."""
        gate = self.parts.fleet
        if gate is None:
            return self._act(actuator, decision, carried)
        cause = decision.cause or "unknown"
        emergency = cause in (*self.parts.settings.policy.emergency, *DOWN)
        with gate.slot(
            cause=cause, reason=f"{cause}: {decision.reason}", emergency=emergency
        ) as turn:
            if not turn.allowed:
                return None
            self._slot = turn.admission.slot
            turn.result = "refused"  # until the actuator says what the restart came to
            try:
                outcome = self._act(actuator, decision, carried)
            finally:
                self._slot = None
            if outcome is not None:
                turn.result = outcome.result
        return outcome

    def _act(
        self, actuator: Actuator, decision: Decision, carried: _FlagsDue | None = None
    ) -> Outcome | None:
        """Restart, carrying the flag change that is due (``carried``), if any."""
        cause = decision.cause or "unknown"
        reason = f"{cause}: {decision.reason}"
        if carried is not None and cause != FLAGS:
            reason += f"; flags: {carried.what}"
        drain = decision.drain_max_in_flight is not None
        self.events.emit(
            "restart.started",
            f"restarting {actuator.unit}: {reason}",
            cause=cause,
            reason=decision.reason,
            ratio=decision.ratio,
            drain=drain,
            evidence=dict(decision.evidence),
            flags=None if carried is None else carried.what,
        )
        # The action may outlast WatchdogSec (a cold start takes minutes): give systemd its
        # own bound for the time being, then the unit's again.
        watchdog = os.environ.get("WATCHDOG_USEC")
        if watchdog:
            self.notify(f"WATCHDOG_USEC={int(self.parts.action_seconds * 1e6)}")
        try:
            with actuator.exclusive():
                outcome = actuator.restart(
                    reason,
                    drain=drain,
                    cause=cause,
                    plan=None if carried is None else carried.plan,
                    down=cause in DOWN,
                )
        except (ActuatorError, LedgerError) as exc:
            self.metrics.count_restart(cause, "failed")
            self.events.emit(
                "restart.failed", f"restart refused: {exc}", cause=cause, error=str(exc)
            )
            return None
        finally:
            if watchdog:
                self.notify(f"WATCHDOG_USEC={watchdog}")
            self.notify("WATCHDOG=1")
        cut_off = outcome.costs.aborted if outcome.costs is not None else None
        self.metrics.count_restart(cause, outcome.result, cut_off)
        for name, message, fields in outcome.events(actuator.unit, cause):
            self.events.emit(name, message, **fields)
        return outcome

    def _progress(self, message: str) -> None:
        """The actuator's word while it drains or waits: the loop is alive. A stop request
        while draining abandons the restart before anything changed, as does the loss of the
        fleet slot (past the drain, the restart goes on: a unit left stopped is worse)."""
        self.notify(f"WATCHDOG=1\nSTATUS={message}")
        acting, now = self._acting, time.monotonic()
        if acting is not None and now - self._progress_at >= 1.0:
            self._progress_at = now
            # `vkvagent status` shows how the restart goes
            acting = self._acting = replace(acting, progress=message)
            self._write_state("status", lambda: self._write_status(acting))
        if self.stopping.is_set() and message.startswith("draining"):
            raise ActuatorError("vkvagent is stopping: restart abandoned while draining")
        gate, slot = self.parts.fleet, self._slot
        lost = gate is not None and slot is not None and not gate.check(slot)  # emits it once
        if lost and message.startswith("draining"):
            raise ActuatorError("fleet slot lost: restart abandoned while draining")

    def _recover(self) -> None:
        actuator = self.parts.actuator
        if actuator is None:
            return
        try:
            with actuator.exclusive():
                outcome = actuator.recover()
        except (ActuatorError, LedgerError) as exc:
            self.events.emit(
                "agent.action_recovered",
                f"interrupted action: {exc}",
                result="failed",
                error=str(exc),
            )
            return
        if outcome is not None:
            self.events.emit(
                "agent.action_recovered",
                f"action {outcome.action_id}: {outcome.message} ({outcome.result})",
                action=outcome.action_id,
                result=outcome.result,
            )

    # -- the flags loop (reconcile.py) ------------------------------------------------------

    def _notice_flag_change(self) -> None:
        """Take the ledger's newest flag change (the daemon's or `vkvagent apply`'s) as the
        one to judge, against the engine's run before it."""
        try:
            actions = self.parts.ledger.recent(5)
        except LedgerError:
            return
        run, ignore = self.state.run, self.parts.drain_flag_names()
        for action in actions:
            if action.kind != "apply" or action.outcome != "done":
                continue
            if self.flag_state.last is not None and action.id <= self.flag_state.last.action:
                return
            # The daemon's own change is noticed before the engine reads the new run; one of
            # `vkvagent apply` may be noticed after: then the engine's previous run stands.
            before = run.key if run.started is None or run.started < action.started else None
            if before is None and self.state.previous is not None:
                before = self.state.previous.run
            change = change_of(
                action.id, action.started, action.ended, action.detail, ignore, before
            )
            if change is not None:
                self.flag_state = self.flag_state.noticed(change)
                return

    def _flags_due(self, plan: Plan | str | None) -> _FlagsDue | None:
        """The flag change the next restart should carry: a slower change to put back, else
        [vllm.flags] when the unit runs other values and the set was not rejected."""
        p = self.parts
        last = self.flag_state.last
        if last is not None and last.rollback_due and p.actuator is not None:
            try:
                back = p.actuator.plan_back(last.before)
            except ActuatorError:
                return None
            if back.changed:
                what = f"roll back {shown(last.flags)} ({last.ratio or 0:.2f} of the fresh speed)"
                return _FlagsDue("rollback", what, back, last.key)
            # Someone put it back already (`vkvagent rollback`): nothing left to do.
            self.flag_state = self.flag_state.rolled_back("by someone: the line before runs")
        if not isinstance(plan, Plan):
            return None
        key = self._desired_key(plan)
        self.flag_state = self.flag_state.desired(key)
        changes = self._pending(plan)
        if not plan.changed or not changes or key in self.flag_state.rejected:
            return None
        return _FlagsDue("apply", f"apply {shown(changes)}", plan, key)

    def _proposed(self, due: _FlagsDue | None) -> str:
        """``Observation.flags_due``: the change the engine may propose a restart for. A
        rollback in every mode but manual; [vllm.flags] only under next-window."""
        apply = self.parts.config.vllm.apply_flags
        if due is None or apply == "manual":
            return ""
        return due.what if due.kind == "rollback" or apply == "next-window" else ""

    def _slower(self, due: _FlagsDue | None) -> float | None:
        """``Observation.flags_slower``: for a rollback, the speed the change was judged at."""
        last = self.flag_state.last
        if due is None or due.kind != "rollback" or last is None:
            return None
        return last.ratio

    def _say_flags(
        self, plan: Plan | str | None, due: _FlagsDue | None, decision: Decision
    ) -> None:
        """An event when flags become pending (and when they will be applied), or are
        refused; once each. systemd not answering changes nothing."""
        if isinstance(plan, str) and plan.startswith("unknown"):
            return
        apply = self.parts.config.vllm.apply_flags
        said: tuple[str, ...] = ()
        if isinstance(plan, str):
            said = ("refused", plan)
        elif due is not None:
            said = ("pending", due.what)
        if said == self._flags_said:
            return
        self._flags_said = said
        if isinstance(plan, str) and said:
            self.events.emit(
                "flags.refused",
                f"[vllm.flags] refused, not applied until the config changes: {plan}",
                flags=rendered(self.parts.config.vllm.flags),
                error=plan,
            )
        elif due is not None:
            self.events.emit(
                "flags.pending",
                f"flags pending: {due.what}; waiting for {_waiting_for(apply, decision, due)}",
                kind=due.kind,
                flags=rendered(due.plan.changes),
                apply=apply,
                next_window=_iso(decision.next_window.timestamp())
                if decision.next_window
                else None,
            )

    def _carried(self, due: _FlagsDue, outcome: Outcome | None) -> None:
        """What a restart that carried a flag change did with it. A set is rejected only when
        vLLM failed with it (not ready, or not proven): a refused D-Bus call or a foreign
        drop-in says nothing about the flags."""
        if outcome is None or outcome.result == "aborted":
            return  # nothing reached the unit: due again at the next restart
        if due.kind == "rollback":
            how = f"{outcome.result} (action {outcome.action_id})"
            if outcome.result != "done":
                how += f": {outcome.message}"
            self.flag_state = self.flag_state.rolled_back(how)
            return
        if (
            outcome.result == "done"
            or outcome.gpus_held
            or not self._vllm_failed(outcome.action_id)
        ):
            return  # (GPUs held by other processes: the flags were never tried)
        why = f"vLLM did not start or run with them (action {outcome.action_id}): "
        why += outcome.vllm_error or outcome.message
        self.flag_state = self.flag_state.reject(due.key, why)
        self.events.emit(
            "flags.refused",
            f"{due.what} refused, not tried again until [vllm.flags] changes: {why}",
            flags=rendered(due.plan.changes),
            error=why,
        )

    def _vllm_failed(self, action_id: int) -> bool:
        """Whether an action failed at vLLM's start or its proof, not before."""
        try:
            action = self.parts.ledger.action(action_id)
        except LedgerError:
            return False
        return action.reached("ready") and not action.finished("attest")

    def _judge_flags(self, decision: Decision) -> None:
        """The verdict on the last flag change, once its run can be compared."""
        p = self.parts
        run = decision.state
        self.flag_state, judged = self.flag_state.judge(
            run_started=run.run.started,
            run_uptime=decision.uptime,
            previous=run.previous,
            current=run.baseline,
            settings=p.settings.baseline,
            margin=p.config.vllm.rollback_margin,
        )
        if judged is None:
            return
        change, found = judged.change, judged.comparison
        if found is None:
            message = f"no verdict on flag change {change.action}: {judged.why}"
        else:
            message = (
                f"flag change {change.action} ({shown(change.flags)}): {change.verdict}, "
                f"{found.ratio:.2f} of the previous flags' fresh speed at "
                f"{', '.join(found.loads)}"
            )
            if change.verdict == "worse":
                message += "; the previous command line goes back at the next restart allowed"
        self.events.emit(
            "flags.judged",
            message,
            action=change.action,
            flags=rendered(change.flags),
            verdict=change.verdict,
            ratio=change.ratio,
            speed_before=change.speed_before,
            speed_after=change.speed_after,
            loads=list(change.loads),
        )

    def _flags_status(
        self, plan: Plan | str | None, due: _FlagsDue | None, decision: Decision
    ) -> status.FlagsStatus | None:
        cfg, last = self.parts.config.vllm, self.flag_state.last
        if not cfg.flags and last is None:
            return None
        running: dict[str, Any] | None = None
        pending: dict[str, Any] | None = None
        problem = plan if isinstance(plan, str) else None
        if isinstance(plan, Plan):
            running = _running_values(plan)
            pending = self._pending(plan) or None
            why = self.flag_state.rejected.get(self._desired_key(plan))
            if pending and why:
                problem = f"rejected: {why}"
        # The status's part is the change's own document, less what only the loop needs.
        change = None if last is None else status.FlagChange.from_json(last.to_json())
        return status.FlagsStatus(
            apply=cfg.apply_flags,
            desired=dict(cfg.flags),
            running=running,
            pending=pending,
            due=None if due is None else due.what,
            waiting_for=None if due is None else _waiting_for(cfg.apply_flags, decision, due),
            problem=problem,
            last_change=change,
        )

    def _pending(self, plan: Plan) -> dict[str, Any]:
        """The values of [vllm.flags] the unit does not run (the drain's left out)."""
        ignore = self.parts.drain_flag_names()
        return {k: v for k, v in plan.changes.items() if k not in ignore}

    def _flags_in_effect(self, plan: Plan | str | None) -> dict[str, Any]:
        """The managed flags as the unit's command line sets them (the drain's left out): part
        of the server's identity, so a run is compared only with runs of the same flags. The
        configured ones when the command line cannot be read."""
        if not isinstance(plan, Plan):
            return dict(self.parts.config.vllm.flags)
        ignore = self.parts.drain_flag_names()
        running = _running_values(plan).items()
        return {k: v for k, v in running if v is not None and k not in ignore}

    def _desired_key(self, plan: Plan) -> str:
        """The name of the flag set ``plan`` applies, the drain's flags left out."""
        ignore = self.parts.drain_flag_names()
        return flags_key({k: v for k, v in plan.flags.items() if k not in ignore})

    # -- persisted state --------------------------------------------------------------------

    def _load_state(
        self,
    ) -> tuple[EngineState, dict[int, bool], tuple[status.TrendPoint, ...], FlagState]:
        """The engine state, the restarts judged, the trend and the flags loop's state, as the
        last run left them. A missing or damaged file costs the learned baselines, never the
        start."""
        path = self.parts.state_dir / STATE_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            engine = EngineState.from_json(data["engine"])
            judged = {int(k): bool(v) for k, v in data.get("judged", {}).items()}
            trend = _trend(data.get("trend", []))
            flag_state = FlagState.from_json(data.get("flags"))
        except FileNotFoundError:
            return EngineState(), {}, (), FlagState()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.events.emit(
                "state.write_failed",
                f"{path}: unreadable ({exc}); starting with no baseline",
                what="state",
                error=str(exc),
            )
            return EngineState(), {}, (), FlagState()
        return engine, judged, trend, flag_state

    def _save_state(self) -> None:
        judged = dict(sorted(self.judged.items())[-50:])
        data = {
            "engine": self.state.to_json(),
            "judged": {str(k): v for k, v in judged.items()},
            "trend": [point.to_json() for point in self.trend],
            "flags": self.flag_state.to_json(),
        }
        write_atomically(
            self.parts.state_dir / STATE_FILE,
            json.dumps(finite(data), separators=(",", ":")),
            0o640,
        )

    def _write_status(self, report: status.StatusReport) -> None:
        write_atomically(
            # Compact: json's C encoder (indent= would take the pure-Python one, 4x slower).
            status.path(self.parts.state_dir),
            json.dumps(finite(report.to_json()), separators=(",", ":")),
            0o640,
        )

    def _status(
        self,
        sample: Sample,
        decision: Decision,
        restarts: tuple[RestartRecord, ...],
        plan: Plan | str | None,
        due: _FlagsDue | None,
        slo: status.SloStatus | None,
        *,
        stale_after: float | None = None,
    ) -> status.StatusReport:
        """The report of this tick; adds the trend's point when one is due."""
        p = self.parts
        first = self.recent.samples[0] if self.recent.samples else None
        rates = _rates_since(first, sample)
        self.trend = status.add_trend(
            self.trend, sample.time, rates.tokens_per_s if rates else None, decision.ratio
        )
        wanting = decision.action == "restart" and p.actuator is not None
        group = None if p.fleet is None else p.fleet.report(wanting=wanting)
        m = sample.vllm
        failing = tuple(
            status.SourceFailure(source, self._failing[source], since, sample.mono - mono)
            for source, (since, mono) in self._failing_since.items()
        )
        interval = p.config.agent.sample_interval
        failed = tuple(f.source for f in status.failed_sources(failing, sample.time, interval))
        return status.StatusReport(
            updated=sample.time,
            pid=os.getpid(),
            pid_namespace=status.pid_namespace(),
            agent_version=__version__,
            interval=p.config.agent.sample_interval,
            unit_name=p.config.vllm.unit,
            unit=_unit_status(sample.unit),
            unit_error=sample.unit_error,
            vllm=status.VllmStatus(
                version=m.version if m else None,
                flavor=m.flavor if m else None,
                recognised=p.sampler.page_recognised,
                uptime_s=decision.uptime,
                error=sample.vllm_error,
            ),
            now=_load_now(sample, rates),
            gpus=tuple(_gpu_status(g) for g in sample.gpus),
            verdict=_verdict(sample, decision, failed),
            policy=self._policy_status(sample, decision, restarts),
            last_restart=self._last_restart(),
            probe=self._probe_status(sample, decision),
            flags=self._flags_status(plan, due, decision),
            trend=self.trend,
            fleet=group,
            slo=slo,
            failing=failing,
            events=tuple(self.events.recent),
            stale_after=stale_after,
        )

    def _policy_status(
        self, sample: Sample, decision: Decision, restarts: tuple[RestartRecord, ...]
    ) -> status.PolicyStatus:
        pol, at = self.parts.settings.policy, sample.time
        is_open, upcoming = window_state(pol, decision.time)
        recent_restarts = sum(1 for r in restarts if r.age(at, sample.mono) < DAY and not r.aborted)
        paused_until = controls.read(self.parts.state_dir).paused_until
        return status.PolicyStatus(
            mode=pol.mode,
            window_open=is_open,
            budget_left=max(0, pol.max_per_day - recent_restarts),
            next_window=upcoming.isoformat() if upcoming else None,
            paused_until=_iso(paused_until) if paused_until and paused_until > at else None,
        )

    def _probe_status(self, sample: Sample, decision: Decision) -> status.ProbeStatus:
        in_flight = self.parts.prober.in_flight
        last = self.parts.prober.last
        return status.ProbeStatus(
            enabled=self.parts.config.probe.enabled,
            wanted=decision.probe_wanted,
            in_flight_s=None if in_flight is None else max(0.0, sample.mono - in_flight),
            last=None
            if last is None
            else status.LastProbe(last.time, last.outcome, last.latency, last.detail),
            failing=self._probe_failing or None,
        )

    def _last_restart(self) -> status.LastRestart | None:
        """The ledger's latest action, with the engine's judgement of it."""
        try:
            actions = self.parts.ledger.recent(1)
        except LedgerError:
            return None
        if not actions:
            return None
        last = actions[0]
        hooks = last.detail.get("hooks")
        return status.LastRestart(
            kind=last.kind,
            reason=last.reason,
            started=last.started,
            id=last.id,
            ended=last.ended,
            outcome=last.outcome,
            recovered=self.judged.get(last.id),
            costs=last.detail.get("costs"),
            hooks=None if hooks is None else tuple(hooks),
        )


def _cost(detail: dict[str, Any], name: str) -> float | None:
    """One of a restart's costs to the clients as the actuator wrote them in the ledger:
    ``aborted``, the requests in flight it cut off, or ``missed``, those estimated to have
    arrived while vLLM was down (None: vLLM was never stopped, or it did not say; a value
    that is not a finite count reads as None)."""
    costs = detail.get("costs")
    value = costs.get(name) if isinstance(costs, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _rates_since(first: Sample | None, sample: Sample) -> Rates | None:
    """Rates over the samples kept: from the first to this one."""
    if first is None or first.vllm is None or sample.vllm is None or sample.mono <= first.mono:
        return None
    return window_rates([(first.mono, first.vllm), (sample.mono, sample.vllm)])


def _unit_status(unit: UnitFacts | None) -> status.UnitStatus | None:
    if unit is None:
        return None
    return status.UnitStatus(
        active_state=unit.active_state,
        sub_state=unit.sub_state,
        main_pid=unit.main_pid,
        n_restarts=unit.n_restarts,
        memory_bytes=unit.memory_bytes,
        restart_policy=unit.restart_policy,
        wanted=unit.wanted,
    )


def _load_now(sample: Sample, rates: Rates | None) -> status.LoadNow:
    m = sample.vllm
    return status.LoadNow(
        tokens_per_s=rates.tokens_per_s if rates else None,
        requests_per_s=rates.requests_per_s if rates else None,
        kv_usage=m.kv_cache_usage if m else None,
        preemptions_per_s=rates.preemptions_per_s if rates else None,
        prefix_hit_ratio=rates.prefix_cache_hit_ratio if rates else None,
        ttft_p50_s=rates.ttft_p50 if rates else None,
        itl_p50_s=rates.itl_p50 if rates else None,
        running=m.num_requests_running if m else None,
        waiting=m.num_requests_waiting if m else None,
    )


def _gpu_status(g: GpuReading) -> status.GpuStatus:
    return status.GpuStatus(
        index=g.index,
        temperature_c=g.temperature_c,
        sm_clock_mhz=g.sm_clock_mhz,
        sm_clock_max_mhz=g.sm_clock_max_mhz,
        clock_event_reasons=tuple(g.clock_event_reasons),
        throttled_by=tuple(g.throttled_by),
    )


def _verdict(sample: Sample, decision: Decision, failed: tuple[str, ...]) -> status.Verdict:
    state = status.verdict_state(
        action=decision.action,
        cause=decision.cause,
        reason=decision.reason,
        has_data=sample.vllm is not None or sample.unit is not None,
        failed=failed,
    )
    return status.Verdict(
        state=state,
        action=decision.action,
        reason=decision.reason,
        cause=decision.cause,
        ratio=decision.ratio,
        enter_ratio=decision.band[0] if decision.band else None,
        leave_ratio=decision.band[1] if decision.band else None,
        stalled_s=decision.stalled_s,
        evidence=dict(decision.evidence),
        suggestion=dict(decision.suggestion),
        reasons=dict(decision.suggestion_reasons),
    )


def _decision_fields(decision: Decision) -> dict[str, Any]:
    return {
        "action": decision.action,
        "cause": decision.cause,
        "reason": decision.reason,
        "ratio": decision.ratio,
        "window_open": decision.window_open,
        "next_window": decision.next_window.isoformat() if decision.next_window else None,
        "uptime_s": decision.uptime,
        "evidence": {k: v for k, v in decision.evidence.items() if v is not None},
        "suggestion": dict(decision.suggestion),
    }


def _trend(points: object) -> tuple[status.TrendPoint, ...]:
    """The saved trend; a damaged one costs only the sparkline, never the baselines."""
    if not isinstance(points, list):
        return ()
    try:
        return tuple(status.TrendPoint.from_json(point) for point in points)
    except status.StatusError:
        return ()


def _waiting_for(apply: str, decision: Decision, due: _FlagsDue) -> str:
    """What a due flag change waits for, in words."""
    if apply == "manual":
        command = "apply" if due.kind == "apply" else "rollback"
        return f"`vkvagent {command}` (apply_flags = manual)"
    if apply == "with-next-restart" and due.kind == "apply":
        return "the next restart (apply_flags = with-next-restart)"
    if decision.cause == FLAGS:
        return "a restart now" if decision.action == "restart" else decision.reason.split(";")[0]
    return "the next restart the policy allows, once nothing else is wrong"


def _running_values(plan: Plan) -> dict[str, Any]:
    """The values the unit's command line gives the flags ``plan`` sets (None: unset)."""
    try:
        running = parse_command(plan.before)
    except VllmCommandError:
        return {}
    return {name: running.value(name) for name in plan.flags}


def _status_line(report: status.StatusReport) -> str:
    v = report.verdict
    ratio = "" if v.ratio is None else f", speed {v.ratio:.2f} of baseline"
    return f"{v.state}: {v.action} ({v.cause or 'no cause'}){ratio}"[:200]


def _iso(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, timezone.utc).isoformat()
