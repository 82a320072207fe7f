"""The daemon's parts: the adapters one configuration wires together, and its events.

``Parts`` is what a config builds (the sampler, the prober, the history, the ledger, the
actuator, the fleet gate, the plan of [vllm.flags]); a reload builds a new one and swaps it in
whole, so no tick ever sees half of an old config and half of a new one. ``RememberedEvents``
emits the daemon's events and keeps the last few for the status.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vkvagent import apikey
from vkvagent.actuation.actuator import Actuator, ActuatorError, Plan
from vkvagent.actuation.drain import DRAIN_FLAG, STOP_MARGIN
from vkvagent.adapters.gpu import reader_for
from vkvagent.adapters.history import History
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.probe import Prober
from vkvagent.adapters.sampler import Sampler
from vkvagent.adapters.systemd import RELOAD_TIMEOUT, Systemd
from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge import config, status
from vkvagent.knowledge.events import Events
from vkvagent.knowledge.flags import FlagError

if TYPE_CHECKING:
    from vkvagent.adapters.fleet import Gate
    from vkvagent.adapters.fleet_flags import FleetTrials
    from vkvagent.adapters.fleet_runs import FleetRuns


class Parts:
    """What one configuration builds; a reload builds a new one and swaps it in whole."""

    def __init__(
        self,
        cfg: config.Config,
        *,
        wall: Callable[[], float],
        mono: Callable[[], float],
        use_systemd: bool,
        progress: Callable[[str], None] = lambda _message: None,
        emit: Callable[..., None] = lambda *_args, **_fields: None,
    ) -> None:
        self.config = cfg
        # [fleet]: at most N hosts of a group restarting at once (None: no fleet configured)
        self.fleet: Gate | None = None
        # and what its hosts learn from each other: their cured runs, by server, and the flag
        # sets they are trying or rejected
        self.fleet_runs: FleetRuns | None = None
        self.fleet_trials: FleetTrials | None = None
        if cfg.fleet.endpoints:
            from vkvagent.adapters import fleet  # noqa: PLC0415 - etcd's client only for a fleet
            from vkvagent.adapters.fleet_flags import FleetTrials  # noqa: PLC0415 - as above
            from vkvagent.adapters.fleet_runs import FleetRuns  # noqa: PLC0415 - as above

            self.fleet = fleet.Gate(cfg.fleet, emit, mono=mono, wall=wall)
            self.fleet_runs = FleetRuns(self.fleet.fleet, emit, mono)
            self.fleet_trials = FleetTrials(self.fleet.fleet, emit, mono)
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
            wall=wall,
            mono=mono,
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
            wall=wall,
            mono=mono,
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
                mono=mono,
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
