"""The daemon, ``vkvagent run``: sample, decide, act, report, on a schedule.

A ``Ticker`` runs the tick every ``sample_interval``: take a sample (vLLM, GPUs, the
unit over D-Bus), store it, run the engine, act on a restart decision through the actuator
(one action at a time, under the state directory's lock), then write the status, publish
the metrics and tell systemd the loop is alive (``WATCHDOG=1`` from the tick itself, so a hung
tick is killed by ``WatchdogSec=``). The main thread only waits for signals: SIGHUP reloads
(the new config is validated first; on error the old one stays), SIGTERM stops after the tick
in progress (an action still draining is abandoned before anything changed; one past that
point is finished, or completed by ``recover()`` at the next start).

``Daemon`` is the conductor: it keeps the schedule and the order of a tick's stages, each of
which is a module of its own: the adapters a config wires (``parts``), what the samples and
probes show (``watch``), the flags loop (``flag_loop``), the restarts (``restarting``), the
decision's and the objectives' events (``decision_log``, ``slo_alerts``), the status
(``status_report``) and the files it keeps (``state_files``).
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TextIO

import sdnotify

from vkvagent import __version__
from vkvagent.actuation.actuator import Plan
from vkvagent.adapters import controls
from vkvagent.adapters.exporter import AgentMetrics, Exporter
from vkvagent.adapters.history import HistoryError
from vkvagent.adapters.ledger import Action, Ledger, LedgerError
from vkvagent.adapters.systemd import SystemdError
from vkvagent.apikey import KeyFileError
from vkvagent.engine import Decision, EngineState, Observation, Recent, decide, server_identity
from vkvagent.engine.liveness import CAUSES as DOWN
from vkvagent.engine.policy import FLAGS, RestartRecord
from vkvagent.engine.progress import ProbeFacts
from vkvagent.engine.samples import Sample
from vkvagent.knowledge import config, status
from vkvagent.knowledge.events import Events
from vkvagent.service import state_files
from vkvagent.service.decision_log import DecisionLog
from vkvagent.service.flag_loop import FlagLoop, FlagsDue, in_effect, proposed
from vkvagent.service.parts import Parts, RememberedEvents
from vkvagent.service.restarting import RestartBook, Restarter
from vkvagent.service.slo_alerts import BurnAlerts
from vkvagent.service.status_report import StatusReporter, last_restart, status_line
from vkvagent.service.ticker import Ticker
from vkvagent.service.watch import ProbeWatch, SourceWatch, UnitWatch

HISTORY_PRUNE_EVERY = 3600.0
# engine.json is rewritten (and fsynced) at most this often, and after every action: a crash
# costs at most this much of the state's progress, never the baseline. Every tick cost 1.5 ms.
STATE_EVERY = 60.0
RECENT_ACTIONS = 5  # the ledger's latest actions a tick reads (newest flag change, last restart)


@dataclass(frozen=True)
class Clock:
    """The daemon's clocks. ``scale`` > 1 runs the schedule that many times faster than real
    time (the demo's fast clock: ``wall`` and ``mono`` must then run fast too)."""

    wall: Callable[[], float] = time.time
    mono: Callable[[], float] = time.monotonic
    scale: float = 1.0


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
        emit = self.events.emit
        self.notify = notify or sdnotify.SystemdNotifier().notify
        self.metrics = AgentMetrics()
        self.lock = threading.Lock()  # one tick or reload at a time
        self.stopping = threading.Event()
        self._wake = threading.Event()
        self._reload = False
        self.writes = state_files.StateWrites(emit)
        self.restarter = Restarter(emit, self.notify, self.metrics, self.stopping, self._show)
        # ConfigError: `vkvagent run` exits 78 with the problems. The notes (a unit name
        # completed, a conf.d file not read) go into agent.started.
        self._config_notes: list[str] = []
        cfg = config.load(config_path, notes=self._config_notes)
        self.parts = self._parts(cfg)
        self.exporter = Exporter(self.metrics, cfg.metrics.listen, cfg.metrics.textfile)
        self.recent = Recent(self.parts.settings.baseline, margin=3 * cfg.agent.sample_interval)
        saved = state_files.load(self.parts.state_dir, emit)
        self.state = saved.engine
        self.restarts = RestartBook(saved.judged, emit, self.metrics)
        self.reporter = StatusReporter(saved.trend)
        self.flag_loop = FlagLoop(saved.flags, emit)
        self.sources = SourceWatch(emit)
        self.unit_watch = UnitWatch(emit)
        self.probes = ProbeWatch(emit, self.writes.write, self.metrics)
        self.decisions = DecisionLog(emit)
        self.burn = BurnAlerts(emit)
        self._pruned = -math.inf
        self._saved_at = -math.inf
        self.last: Decision | None = None

    def _parts(self, cfg: config.Config) -> Parts:
        return Parts(
            cfg,
            wall=self.clock.wall,
            mono=self.clock.mono,
            use_systemd=self.use_systemd,
            progress=self.restarter.progress,
            emit=self.events.emit,
        )

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
        self.restarter.recover(self.parts.actuator)
        ticker = Ticker(self._job, self.parts.config.agent.sample_interval / self.clock.scale)
        handlers = {
            signal.SIGTERM: self._on_stop,
            signal.SIGINT: self._on_stop,
            signal.SIGHUP: self._on_hup,
        }
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            ticker.start()
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
                    ticker.reschedule(self.parts.config.agent.sample_interval / self.clock.scale)
        finally:
            self.notify("STOPPING=1")
            self.events.emit("agent.stopping", "vkvagent is stopping")
            ticker.stop()
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
        self.writes.write("state", self._save)
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
                parts = self._parts(cfg)
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
                self.probes.failing = ""  # the new prober has not failed yet
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
            p, write = self.parts, self.writes.write
            sample = p.sampler.take()
            self.sources.note(sample)
            down = self.unit_watch.why_down(sample, p.config.vllm.unit)
            self.unit_watch.note(sample, down, p.config.vllm.unit)
            write("history", lambda: p.history.append(sample))
            unit = sample.unit
            self.recent.add(
                sample,
                unit.growth_bytes if unit else None,
                unit.growth_source if unit else "",
            )
            now = datetime.fromtimestamp(sample.time, timezone.utc)
            restarts = self.restarts.records(p.ledger, sample.time, sample.mono)
            for result in p.prober.collect():
                self.probes.note(p, result)
            version = sample.vllm.version if sample.vllm else None
            invocation = sample.unit.invocation_id if sample.unit else None
            plan = p.flag_plan(version, invocation)
            # The ledger's latest actions, read once for the flags loop, the judgement of the
            # last restart and the status; again after an action of this tick.
            actions = _recent_actions(p.ledger)
            self.flag_loop.notice(actions, self.state, p)
            flags = in_effect(p, plan)
            # The server this run is, for what the fleet's peers know of it: the baseline's,
            # and before the baseline's first sample, vLLM's now.
            here = _server(self.state) or (
                server_identity(sample.vllm, flags) if sample.vllm else ""
            )
            trials = () if p.fleet_trials is None else p.fleet_trials.learned()
            peers = None if p.fleet_runs is None else p.fleet_runs.learned(here)
            due = self.flag_loop.due(p, plan, trials, here, sample.time)
            observed = Observation(
                samples=tuple(self.recent.samples),
                unit_active=None if sample.unit is None else sample.unit.active_state == "active",
                memory=self.recent.memory,
                restarts=restarts,
                controls=controls.read(p.state_dir),
                flags=flags,
                probe=p.prober.facts() if p.config.probe.enabled else ProbeFacts(),
                unit_started=sample.unit.active_since if sample.unit else None,
                flags_due=proposed(p.config.vllm.apply_flags, due),
                flags_slower=self.flag_loop.slower(due),
                stopped=down.get("stopped", ""),
                exit_line=down.get("exit_line", ""),
                peer_runs=peers.runs if peers else (),
                peer_baselines=peers.baselines if peers else (),
            )
            decision = decide(p.settings, self.state, observed, now)
            self.state = decision.state
            if p.fleet_runs is not None:
                server = _server(self.state)
                p.fleet_runs.share(
                    server, self.state.past, self.state.baseline, p.settings.baseline
                )
            slo = self.burn.report(p.settings.slo, decision, sample.time)
            self.flag_loop.judge(p, decision)
            if p.fleet_trials is not None:
                p.fleet_trials.share(self.flag_loop.trials(p.fleet_trials.fleet.host))
            if decision.probe_wanted:
                self.probes.send(p, sample)
            self.restarts.judge(actions, decision, p.drain_flag_names())
            self.decisions.say(decision, p.config.agent.reminder)
            self.flag_loop.say(p, plan, due, decision)
            outcome = None
            carried, withheld = None, False
            if decision.action == "restart" and p.actuator is not None:
                # Any restart carries the change due, but an emergency's: that one must not
                # risk vLLM's start on flags nobody has seen run.
                emergency = decision.cause in (*p.settings.policy.emergency, *DOWN)
                manual = p.config.vllm.apply_flags == "manual"
                carried = None if emergency or manual else due
                if carried is not None and p.fleet_trials is not None:
                    carried = self.flag_loop.announce(p.fleet_trials, carried, here, sample.time)
                    # A restart for the flags alone waits while a peer holds them back.
                    withheld = carried is None and decision.cause == FLAGS
            if decision.action == "restart" and p.actuator is not None and not withheld:
                # Say "acting" for as long as the restart may take, before it begins.
                acting = self._status(
                    sample,
                    decision,
                    restarts,
                    plan,
                    due,
                    slo,
                    actions,
                    stale_after=p.action_seconds,
                )
                self._show(acting)
                self.metrics.update(acting)  # /ready says so while the restart runs
                self.restarter.acting = acting
                try:
                    outcome = self.restarter.restart(p, p.actuator, decision, carried)
                finally:
                    self.restarter.acting = None
                if carried is not None:
                    self.flag_loop.carried(p.ledger, carried, outcome, here)
                restarts = self.restarts.records(p.ledger, sample.time, sample.mono)
                p.replan()
                plan = p.flag_plan(version, invocation)
                actions = _recent_actions(p.ledger)  # with this tick's action
                self.flag_loop.notice(actions, self.state, p)
            if decision.action == "restart" and p.actuator is not None:
                trials = () if p.fleet_trials is None else p.fleet_trials.learned()
                due = self.flag_loop.due(p, plan, trials, here, sample.time)
            self.last = decision
            self.metrics.count(
                action=decision.action,
                errors={
                    "vllm": sample.vllm_error is not None,
                    "gpu": sample.gpu_error is not None,
                    "systemd": sample.unit_error is not None,
                },
            )
            report = self._status(sample, decision, restarts, plan, due, slo, actions)
            if outcome is not None or sample.time - self._saved_at >= STATE_EVERY:
                self._saved_at = sample.time
                write("state", self._save)
            self._show(report)
            self.metrics.update(report)
            write("textfile", self.exporter.publish)
            if sample.time - self._pruned >= HISTORY_PRUNE_EVERY:
                self._pruned = sample.time
                write(
                    "history", lambda: p.history.prune(sample.time, p.config.history.retention_days)
                )
            self.notify(f"WATCHDOG=1\nSTATUS={status_line(report)}")
            return decision

    def _status(
        self,
        sample: Sample,
        decision: Decision,
        restarts: tuple[RestartRecord, ...],
        plan: Plan | str | None,
        due: FlagsDue | None,
        slo: status.SloStatus | None,
        actions: list[Action] | None,
        *,
        stale_after: float | None = None,
    ) -> status.StatusReport:
        """The report of this tick, from what each stage found."""
        p = self.parts
        return self.reporter.report(
            p,
            sample,
            decision,
            restarts,
            first=self.recent.samples[0] if self.recent.samples else None,
            failing=self.sources.failures(sample.mono),
            probe_failing=self.probes.failing,
            flags=self.flag_loop.status(p, plan, due, decision),
            slo=slo,
            last_restart=last_restart(actions, self.restarts.judged),
            events=self.events.recent,
            stale_after=stale_after,
        )

    def _show(self, report: status.StatusReport) -> None:
        """Write ``report`` as the status (`vkvagent status`, the exporter's /ready), and
        publish it to the fleet's group (`vkvagent fleet status`)."""
        self.writes.write("status", lambda: state_files.write_status(self.parts.state_dir, report))
        if self.parts.fleet is not None:
            self.parts.fleet.publish(report)

    def _save(self) -> None:
        saved = state_files.SavedState(
            self.state, self.restarts.judged, self.reporter.trend, self.flag_loop.state
        )
        state_files.save(self.parts.state_dir, saved)


def _server(state: EngineState) -> str:
    """The server identity this host runs (``carry.server_identity``); "" before a baseline."""
    return state.baseline.server if state.baseline is not None else ""


def _recent_actions(ledger: Ledger) -> list[Action] | None:
    """The ledger's latest actions, newest first; None when it cannot be read."""
    try:
        return ledger.recent(RECENT_ACTIONS)
    except LedgerError:
        return None
