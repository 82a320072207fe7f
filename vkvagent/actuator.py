"""The one path for every restart and flag change: preflight, drain, drop-in and reload,
restart, wait until ready, attest, and roll back a flag change that broke or did not take.

Each step is written to the ledger before and after it runs, so ``recover()`` can finish or
undo whatever a crash interrupted: a drop-in written but not yet in effect is restored; a
restart already requested is never requested twice.

Only one vkvagent acts on a unit at a time (``exclusive()``): a second one would take the
first's open action for an interrupted one and undo it mid-way.

``VKVAGENT_KILL_AT=<step>`` makes the process SIGKILL itself when that step begins: the fault
injection the reliability tests use to prove the above. It does nothing unless set.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vkvagent import apikey, container, unitlog
from vkvagent import flags as vflags
from vkvagent.atomicfile import write_atomically
from vkvagent.cgroup import pids_in
from vkvagent.config import Config
from vkvagent.container import Container
from vkvagent.dropin import (
    DROPIN_NAME,
    DropinFile,
    ExecCommand,
    ExecSyntaxError,
    argv_hash,
    expand_exec_env,
    is_foreign_edit,
    other_settings,
    parse_dropin,
    render_container_dropin,
    render_dropin,
    split_exec_start,
)
from vkvagent.engine.gpu_faults import describe_xid
from vkvagent.engine.samples import FlagValue, VllmMetrics
from vkvagent.errors import VkvagentError
from vkvagent.gpu import GpuReader
from vkvagent.gpu_free import GpusBusy, Holder, clear_gpus, holders, is_gpu_memory_failure
from vkvagent.hardening import QUADLET_DIR, SYSTEMD_DIR
from vkvagent.hooks import HookResult, run_hook
from vkvagent.ledger import Action, Ledger
from vkvagent.systemd import TIMEOUT, Systemd, SystemdError, UnitState
from vkvagent.vllm import ScrapeError, VllmClient

STEPS = (
    "preflight", "pre_stop", "drain", "write", "reload", "restart", "ready", "attest",
    "post_ready",
)  # fmt: skip
# TimeoutStopSec= beyond vLLM's --shutdown-timeout: its teardown after the drain (the worker's
# exit took 8 s on 0.32's CPU build), so that systemd's SIGKILL never cuts the drain short.
STOP_MARGIN = 30
DRAIN_FLAG = vflags.CATALOGUE["shutdown-timeout"]  # vLLM's own drain on SIGTERM


class ActuatorError(VkvagentError):
    """The action was refused or failed; one line saying why and what to do."""


class _JobRefused(ActuatorError):
    """systemd refused the restart job (access denied, no such unit, no bus): nothing was
    restarted."""


@dataclass(frozen=True)
class RestartSettings:
    drain_max_in_flight: int = 0  # running + waiting requests allowed when the restart begins
    drain_timeout: float = 120.0
    graceful_shutdown: bool = True  # drain through vLLM's --shutdown-timeout where it has one
    when_busy: str = "proceed"  # still busy after a quiet-moment wait: proceed | give-up
    pre_stop: tuple[str, ...] = ()
    post_ready: tuple[str, ...] = ()
    hook_timeout: float = 60.0
    job_timeout: float = 120.0  # for systemd's restart job
    ready_timeout: float = 600.0  # real cold starts take minutes (weights, compile, graphs)
    # Between two looks at the unit and /metrics while draining and waiting. Readiness is
    # noticed up to two of these late (tokens must be seen to advance), time that would be
    # counted as vLLM's own start: 1 s made a 0.3 s start look like 2.1 s.
    poll_interval: float = 0.25


@dataclass(frozen=True)
class Plan:
    """What a flag change would do: argv before and after, and which flags can be proven."""

    unit: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    flags: dict[str, FlagValue]
    attestable: tuple[str, ...]  # flags cache_config_info shows
    changed: bool
    changes: dict[str, FlagValue]  # the flags whose value the unit does not run yet


@dataclass(frozen=True)
class Costs:
    """What a restart cost vLLM's clients, as /metrics showed it. ``drain_mode``: how the requests
    in flight were let finish: ``vllm`` (its graceful shutdown), ``quiet`` (a wait for a quiet
    moment), ``busy`` (no quiet moment came within drain_timeout: restarted anyway, as
    when_busy = proceed says), ``none`` (cut off: an emergency, or --no-drain)."""

    drain_mode: str
    in_flight: float | None  # requests running + waiting when the stop was requested
    aborted: float | None  # of those, cut off by the stop (None: vLLM did not say)
    drain_seconds: float | None  # the stop until nothing was in flight (or vLLM went away)
    down_seconds: float | None  # the stop until ready again: no new request was admitted
    missed: float | None  # requests estimated to have arrived meanwhile (the run's mean rate)

    def to_json(self) -> dict[str, Any]:
        return {
            key: round(value, 3) if isinstance(value, float) else value
            for key, value in self.__dict__.items()
        }


@dataclass(frozen=True)
class Outcome:
    action_id: int
    result: str  # done | rolled-back | failed | aborted
    message: str
    seconds: float  # decision to ready (or to the end)
    service_seconds: float | None  # restart job requested to service ready: vLLM's own start
    flags: Mapping[str, FlagValue] = field(default_factory=dict)  # the flags it changed
    vllm_error: str | None = None  # vLLM's own reason for not starting, from its journal
    costs: Costs | None = None  # None: vLLM was never stopped
    hooks: tuple[HookResult, ...] = ()  # pre_stop and post_ready, as they ran
    freed: tuple[str, ...] = ()  # the run before's processes killed on the GPUs before a start
    # vLLM failed for GPU memory that these processes held: not the flags' fault (kept).
    gpus_held: str = ""

    def events(self, unit: str, cause: str) -> list[tuple[str, str, dict[str, Any]]]:
        """Every event this outcome reports, in order: its hooks' runs, then ``event``."""
        return [hook.event(self.action_id) for hook in self.hooks] + [self.event(unit, cause)]

    def event(self, unit: str, cause: str) -> tuple[str, str, dict[str, Any]]:
        """The event that reports this outcome: (name, message, fields), for the daemon's
        restarts and the operator's alike."""
        fields: dict[str, Any] = {
            "cause": cause,
            "action": self.action_id,
            "result": self.result,
            "seconds": round(self.seconds, 3),
            "service_seconds": self.service_seconds,
        }
        if self.flags:
            fields["flags"] = vflags.rendered(self.flags)
        if self.vllm_error is not None:
            fields["vllm_error"] = self.vllm_error
        if self.costs is not None:
            fields.update(self.costs.to_json())
        if self.freed:
            fields["gpu_leftovers_killed"] = list(self.freed)
        if self.gpus_held:
            fields["gpus_held_by"] = self.gpus_held
        if self.result == "done":
            killed = f"; killed the run before's leftovers: {'; '.join(self.freed)}"
            return (
                "restart.completed",
                f"restarted {unit} ({cause}) in {self.seconds:.1f} s"
                + (killed if self.freed else ""),
                fields,
            )
        if self.result == "rolled-back":
            return "restart.rolled_back", self.message, fields
        return "restart.failed", self.message, {**fields, "error": self.message}


SYSTEMD_UNIT_DIR = Path(SYSTEMD_DIR)  # where the drop-in goes: /etc overrides /lib
# Where a Quadlet `.container` file's drop-in goes: its generator reads NAME.container.d/ in
# every directory it searches, and this is the administrator's.
QUADLET_UNIT_DIR = Path(QUADLET_DIR)


def dropin_for(unit: str, source_path: str, keep_dir: Path) -> DropinFile:
    """vkvagent's drop-in for ``unit``: systemd's, or, for a unit Quadlet generates from the
    ``.container`` file ``source_path``, that file's (a drop-in of the service would fight the
    generator). Each keeps its earlier versions apart."""
    if _is_quadlet(source_path):
        return DropinFile(os.path.basename(source_path), QUADLET_UNIT_DIR, keep_dir / "quadlet")
    return DropinFile(unit, SYSTEMD_UNIT_DIR, keep_dir)


class Actuator:
    """Acts on one unit. ``probe`` reads vLLM; ``proc`` is the /proc of the unit's processes
    (the container's, in tests)."""

    def __init__(
        self,
        *,
        unit: str,
        systemd: Systemd,
        ledger: Ledger,
        dropin: DropinFile,
        probe: VllmClient,
        state_dir: Path,
        settings: RestartSettings = RestartSettings(),
        proc: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        progress: Callable[[str], None] = lambda _message: None,
        gpus: GpuReader | None = None,
        why_it_failed: Callable[[str, float, str], str | None] = unitlog.why_it_failed,
        vllm_version: str | None = None,
    ) -> None:
        self.unit, self.systemd, self.ledger, self.dropin = unit, systemd, ledger, dropin
        self.probe, self.settings, self.proc = probe, settings, proc
        self._gpus = gpus
        self._why_it_failed = why_it_failed
        self._vllm_version = vllm_version  # [vllm] version: when vLLM does not say its own
        self._state_dir = state_dir
        self._base_file = state_dir / f"base-{unit}.json"
        self._clock, self._wall, self._sleep, self._progress = clock, wall, sleep, progress

    @classmethod
    def for_config(
        cls,
        cfg: Config,
        *,
        systemd: Systemd,
        ledger: Ledger,
        gpus: GpuReader | None,
        progress: Callable[[str], None] = lambda _message: None,
        mono: Callable[[], float] = time.monotonic,
    ) -> Actuator:
        """The actuator a configuration describes: the CLI's and the daemon's."""
        state_dir, r = Path(cfg.agent.state_dir), cfg.restart
        return cls(
            unit=cfg.vllm.unit,
            systemd=systemd,
            ledger=ledger,
            dropin=dropin_for(
                cfg.vllm.unit, _source_path(systemd, cfg.vllm.unit), state_dir / "dropins"
            ),
            probe=VllmClient.from_config(cfg.vllm),
            state_dir=state_dir,
            settings=RestartSettings(
                drain_max_in_flight=r.drain_max_in_flight,
                drain_timeout=r.drain_timeout,
                graceful_shutdown=r.graceful_shutdown,
                when_busy=r.when_busy,
                pre_stop=r.pre_stop,
                post_ready=r.post_ready,
                hook_timeout=r.hook_timeout,
                job_timeout=r.job_timeout,
                # A start_timeout the operator set bounds vkvagent's own starts too.
                ready_timeout=min(r.ready_timeout, r.start_timeout or r.ready_timeout),
            ),
            progress=progress,
            gpus=gpus,
            clock=mono,
            vllm_version=cfg.vllm.version or None,
        )

    # -- planning ---------------------------------------------------------------------------

    def plan(self, wanted: Mapping[str, object], vllm_version: str | None) -> Plan:
        """The command line ``wanted`` (with the drain's flags, ``drain_flags``) makes."""
        state = self._unit()
        refusal = self._quadlet_refusal(state)
        if refusal:
            raise ActuatorError(f"{self.unit}: {refusal}")
        current = _argv(state)
        base = self._base(state)
        drains = self.drain_flags(vllm_version, state)
        values = vflags.validate({**drains, **wanted}, vllm_version)
        try:
            after = tuple(vflags.apply_flags(base, values, vllm_version=vllm_version))
        except ValueError as exc:  # VllmCommandError: not a vllm serve command line
            said = str(exc)
            if said == apikey.ON_COMMAND_LINE and self._quadlet:
                said = apikey.ON_QUADLET_LINE
            raise ActuatorError(f"{self.unit}: {said}") from None
        attestable = tuple(n for n in values if vflags.CATALOGUE[n].attest_label)
        try:
            running = vflags.parse_command(current)
            changes = {n: v for n, v in values.items() if running.value(n) != v}
        except vflags.VllmCommandError:
            changes = dict(values)
        return Plan(self.unit, current, after, values, attestable, after != current, changes)

    def plan_back(self, argv: Sequence[str]) -> Plan:
        """The change that puts ``argv`` (a command line an earlier change replaced) back."""
        current = _argv(self._unit())
        after = tuple(argv)
        return Plan(self.unit, current, after, {}, (), after != current, {})

    def vllm_version(self) -> str | None:
        """The running vLLM's version: as it says (``/version``), else as configured."""
        return self.probe.version() or self._vllm_version

    def drain_flags(
        self, vllm_version: str | None, state: UnitState | None = None
    ) -> dict[str, FlagValue]:
        """The flags that make vLLM drain when systemd stops it: ``--shutdown-timeout`` (the
        drain's budget) on a version known to have it, unless graceful_shutdown is off or
        the unit's ExecStop= would kill vLLM's container before that drain ends
        (``engine_stop_too_short``). [vllm.flags] may set it otherwise."""
        drain = math.ceil(self.settings.drain_timeout)
        if not self._may_drain_itself(vllm_version):
            return {}
        if engine_stop_too_short(state or self._unit(), drain):
            return {}
        return {DRAIN_FLAG.name: drain}

    def drain_cut_short(self, vllm_version: str | None) -> str:
        """Why a vLLM that could drain itself cannot in this unit's container
        (``engine_stop_too_short``); "" when it can, or could not anyway. A version not known
        (vLLM down) is taken to have --shutdown-timeout, as `config check` takes it."""
        if not self.settings.graceful_shutdown:
            return ""
        if vllm_version is not None and not self._may_drain_itself(vllm_version):
            return ""
        return engine_stop_too_short(self._unit(), math.ceil(self.settings.drain_timeout))

    def _may_drain_itself(self, vllm_version: str | None) -> bool:
        """graceful_shutdown on, and a vLLM version known to have --shutdown-timeout."""
        if not self.settings.graceful_shutdown or vllm_version is None:
            return False
        try:
            return DRAIN_FLAG.available(vflags.parse_version(vllm_version))
        except ValueError:
            return False

    def drain_plan(self, vllm_version: str | None) -> Plan | None:
        """The change a plain restart carries so that vLLM drains by itself from then on: the
        running command line with ``drain_flags`` set. None when it has them already (or the
        version lacks them)."""
        state = self._unit()
        wanted = self.drain_flags(vllm_version, state)
        if not wanted:
            return None
        if self._quadlet_refusal(state):
            return None  # plan() says why it is not rewritten
        current = _argv(state)
        try:
            running = vflags.parse_command(current)
            changes = {n: v for n, v in wanted.items() if running.value(n) != v}
            # The flags alone do not drain where the unit's stop signals vLLM's engine too:
            # the drop-in's KillMode=mixed (``_stop_settings``) is then the change.
            if not changes and state.kill_mode != "control-group":
                return None
            after = tuple(vflags.apply_flags(current, wanted, vllm_version=vllm_version))
        except vflags.VllmCommandError:
            # Not vLLM's command line, or one with its API key: plan() would refuse it, a
            # restart need not.
            return None
        return Plan(self.unit, current, after, wanted, (), True, changes)

    @property
    def _quadlet(self) -> bool:
        """Whether this actuator writes a Quadlet ``.container``'s drop-in (``dropin_for``)."""
        return self.dropin.path.parent.name.endswith(".container.d")

    def _quadlet_refusal(self, state: UnitState) -> str:
        """Why vkvagent cannot change the flags of a unit Quadlet generates; "" when it can,
        through the ``.container`` file's drop-in (podman 4.8 and later), or the unit is not
        Quadlet's."""
        quadlet = _is_quadlet(state.source_path)
        if quadlet != self._quadlet:
            whose = "the .container file's" if quadlet else "the unit's"
            return (
                f"{'now' if quadlet else 'no longer'} generated by Quadlet, since vkvagent read "
                f"it: reload or restart vkvagent so that it writes {whose} drop-in"
            )
        if not quadlet:
            return ""
        service = SYSTEMD_UNIT_DIR / f"{self.unit}.d" / DROPIN_NAME
        if service.exists():  # from before the move to Quadlet: it overrides the generator
            return (
                f"{service}, written before the unit was Quadlet's, overrides what Quadlet "
                "generates: remove it and run systemctl daemon-reload"
            )
        version = container.quadlet_version(_argv(state))
        try:
            old = version is not None and vflags.parse_version(version) < container.QUADLET_DROPINS
        except ValueError:
            old = False
        if not old:
            return ""
        return (
            f"generated by Quadlet from {state.source_path}, whose drop-ins podman {version} "
            "does not read (Quadlet does from podman 4.8): vkvagent changes no flags here (it "
            "watches and restarts the unit as ever); edit Exec= there and run systemctl "
            "daemon-reload"
        )

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the state directory's lock while acting: refuses (ActuatorError) while another
        vkvagent holds it. One lock for the directory, not per unit: the ledger is shared, and
        another unit's open action must never be taken for an interrupted one of this unit.
        The kernel drops it when the process dies, so ``kill -9`` leaves none."""
        path = self._state_dir / "lock"
        try:
            self._state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise ActuatorError(f"{path}: cannot open the lock: {exc.strerror or exc}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ActuatorError(
                    f"another vkvagent is acting on {self.unit} now (it holds {path}); "
                    "try again when it has finished"
                ) from None
            yield
        finally:
            os.close(fd)

    # -- the procedure ----------------------------------------------------------------------

    def restart(
        self,
        reason: str,
        *,
        plan: Plan | None = None,
        drain: bool = True,
        cause: str = "manual",
        down: bool = False,
    ) -> Outcome:
        """Restart the unit, applying ``plan``'s command line first if it changes anything.

        ``down``: vLLM serves nothing (it died and stayed down, or its start hangs): a unit
        that is inactive or failed is started (StartUnit), and ``pre_stop`` is skipped, since
        there is nothing to take out of rotation that serves.

        With ``drain``, requests in flight finish first: by vLLM's graceful shutdown when the
        running vLLM has ``--shutdown-timeout`` (systemd's stop then drains), else by a wait
        for a quiet moment; without ``plan``, the restart also gives vLLM the flags to drain
        by itself from then on (``drain_plan``). Without ``drain``, requests in flight are cut
        off at once. ``pre_stop`` runs before anything else touches vLLM and ``post_ready``
        once it serves again; ``cause`` is handed to them."""
        if plan is None and drain and self.settings.graceful_shutdown:
            # Unreadable now, the unit fails the preflight below, where the ledger has it.
            with contextlib.suppress(ActuatorError):
                plan = self.drain_plan(self.vllm_version())
        started = self._clock()
        change = plan is not None and plan.changed
        detail: dict[str, Any] = {"previous_dropin": self.dropin.read()}
        if change and plan is not None:
            detail.update(
                intended=list(plan.after),
                before=list(plan.before),
                flags=plan.flags,
                changes=plan.changes,
            )
        action = self.ledger.begin(
            "apply" if change else "restart", reason, self._wall(), detail, mono=started
        )
        ran: list[HookResult] = []
        stop: _Stop | None = None
        freed: tuple[Holder, ...] = ()
        try:
            with self._step(action, "preflight"):
                before = self._preflight(change, down)
            if self._gpus is not None and before.active_state in ("inactive", "failed"):
                with self._step(action, "gpus"):  # a restart's stop kills its own cgroup
                    freed = self._free_gpus(before)
            if self.settings.pre_stop and before.active_state == "active":
                with self._step(action, "pre_stop"):
                    self._hook("pre_stop", action, cause, ran)
            shutdown = self._shutdown_timeout(before) if drain else 0
            how, waited = ("vllm" if shutdown else "quiet") if drain else "none", None
            if how == "quiet":
                with self._step(action, "drain"):
                    waiting = self._clock()
                    how = "quiet" if self._drain() else "busy"
                    waited = self._clock() - waiting
            if change and plan is not None:
                with self._step(action, "write"):
                    self._write(plan.after, before)
                with self._step(action, "reload"):
                    self._reload()
                    if _argv(self._unit()) != plan.after:
                        raise ActuatorError(
                            "after the reload systemd shows another command "
                            "line: another drop-in overrides vkvagent's"
                        )
            stop = _Stop(self, before, how, waited, shutdown)
            self._restart_step(action, before, stop)
            with self._step(action, "ready"):
                after = self._wait_ready(before.invocation_id)
            ready_at = self._clock()
            if change and plan is not None:
                with self._step(action, "attest"):
                    self._attest(plan.after, plan.flags, after)
        except ActuatorError as exc:
            costs = None  # until systemd has the restart (a refused job stopped nothing)
            if stop is not None and not isinstance(exc, _JobRefused):
                costs = stop.costs(None)
            return self._fail(action, exc, change, started, costs, tuple(ran), cause)
        self._post_ready(action, "done", cause, ran)
        return self._finish(
            action,
            "done",
            "restarted" + (_with(plan) if change and plan is not None else ""),
            started,
            ended=ready_at,
            service_seconds=ready_at - stop.requested,
            flags=plan.changes if change and plan is not None else {},
            costs=stop.costs(ready_at),
            hooks=tuple(ran),
            freed=tuple(str(h) for h in freed),
        )

    def check_rollback(self) -> None:
        """Raise ActuatorError when there is nothing ``rollback`` may undo."""
        if not self.dropin.has_previous():
            raise ActuatorError("nothing to roll back: vkvagent has not changed this unit")
        text = self.dropin.read()
        if text is not None and is_foreign_edit(text):  # someone's edit is not for us to drop
            raise ActuatorError(_foreign(self.dropin.path))

    def rollback(self, reason: str) -> Outcome:
        """Undo vkvagent's last change to the drop-in (one level; again goes one further),
        and restart with it."""
        self.check_rollback()
        previous = self.dropin.previous()
        started = self._clock()
        action = self.ledger.begin(
            "rollback", reason, self._wall(), {"restored": previous}, mono=started
        )
        try:
            self._restore(action, previous, restart=True)
        except ActuatorError as exc:
            return self._finish(action, "failed", f"rollback failed: {exc}", started)
        return self._finish(action, "done", "previous command line restored", started)

    def recover(self) -> Outcome | None:
        """Finish or undo the action a crash interrupted; None when there is none.

        A restart systemd already received is never requested again: it is waited for (and a
        flag change attested, rolled back only if that fails). A drop-in written but not yet in
        effect is restored, without a restart. Raises ActuatorError (the action then ends
        "failed") when neither can be done."""
        action = self.ledger.open_action()
        if action is None:
            return None
        started = self._clock()
        try:
            result, message = self._recover(action)
        except ActuatorError as exc:
            self.ledger.end(action.id, "failed", self._wall())
            raise ActuatorError(
                f"the interrupted {action.kind} (action {action.id}) could not be completed "
                f"or undone: {exc}"
            ) from None
        ran: list[HookResult] = []
        if action.finished("pre_stop") and not action.reached("post_ready"):
            # The host left the load balancer's rotation before the crash: put it back.
            self._post_ready(action.id, result, action.reason.split(":", 1)[0], ran)
        return self._finish(action.id, result, message, started, hooks=tuple(ran))

    def _recover(self, action: Action) -> tuple[str, str]:
        detail = action.detail
        if action.kind == "rollback":
            restored = detail.get("restored")
            self._finish_restore(action, restored, restart=True)
            return "done", "interrupted rollback completed"
        change = "intended" in detail
        previous = detail.get("previous_dropin")
        if action.reached("restore"):  # undoing a failed change was under way: finish it
            undo_from = _index(action, "restore")
            restart = any(s.step == "restart" for s in action.steps[:undo_from])
            self._finish_restore(action, previous, restart=restart)
            return "rolled-back", "interrupted rollback of a failed flag change completed"
        if action.finished("attest") or (not change and action.finished("ready")):
            return "done", "interrupted action had completed"
        if self._restart_requested(action, 0):
            # systemd has it: never request it again. Wait for it; prove a flag change.
            try:
                with self._step(action.id, "ready"):
                    metrics = self._wait_ready(_restart_note(action))
                if change:
                    with self._step(action.id, "attest"):
                        self._attest(tuple(detail["intended"]), detail["flags"], metrics)
            except ActuatorError as exc:
                if not change:
                    raise
                self._restore(action.id, previous, restart=True)
                return "rolled-back", f"interrupted flag change failed: {exc}; undone"
            if change:
                return "done", "interrupted flag change completed: the new flags are in effect"
            return "done", "interrupted restart completed"
        if change and action.reached("write"):
            # Written, maybe loaded, not running: put the drop-in back; nothing to restart.
            self._restore(action.id, previous, restart=False)
            return "rolled-back", "interrupted flag change undone before it took effect"
        return "aborted", "interrupted before anything changed"

    def _finish_restore(self, action: Action, text: str | None, *, restart: bool) -> None:
        """Complete an undo that an interruption cut short, from where it was."""
        undo_from = _index(action, "restore")
        if undo_from is None or not action.finished("restore"):
            with self._step(action.id, "restore"):
                self._put_back(text)
        if not restart:
            return
        if self._restart_requested(action, undo_from or 0):
            with self._step(action.id, "ready"):
                self._wait_ready(_restart_note(action))
        else:
            before = self._unit()
            self._restart_step(action.id, before)
            with self._step(action.id, "ready"):
                self._wait_ready(before.invocation_id)

    def adopt(self) -> Plan:
        """Take the unit's current command line, including someone's manual edits, as the base
        that managed flags are applied to."""
        text = self.dropin.read()
        if text is not None:
            extra = other_settings(text)
            if extra:  # a re-signed vkvagent drop-in carries ExecStart= only
                raise ActuatorError(
                    f"{self.dropin.path} also sets {', '.join(extra)}: move that to another "
                    f"drop-in in {self.dropin.path.parent}, then run `vkvagent adopt` again"
                )
            self._reload()  # an edit not yet reloaded is what is adopted, not the old line
        state = self._unit()
        refusal = self._quadlet_refusal(state)
        if refusal:
            raise ActuatorError(f"{self.unit}: {refusal}")
        current = _argv(state)
        if apikey.spelled_out(current):  # the drop-in would say <redacted>
            said = apikey.ON_QUADLET_LINE if self._quadlet else apikey.ON_COMMAND_LINE
            raise ActuatorError(f"{self.unit}: {said}")
        own = _own(state)
        self._save_base(current, own=own)
        if text is not None:  # re-sign it, so it is vkvagent's again
            try:
                self.dropin.write(
                    self._render(current, state, argv_hash(own or current)),
                    keep=False,  # the same command line: nothing for a rollback to go back to
                )
            except OSError as exc:
                raise ActuatorError(_write_problem(self.dropin.path, exc)) from None
            self._reload()
        return Plan(self.unit, current, current, {}, (), False, {})

    # -- steps ------------------------------------------------------------------------------

    def _preflight(self, change: bool, down: bool = False) -> UnitState:
        state = self._unit()
        if state.load_state != "loaded":
            raise ActuatorError(f"{self.unit} is {state.load_state}")
        if down and state.active_state in ("inactive", "failed"):
            pass  # started below: the point of the action
        elif state.active_state != "active":
            raise ActuatorError(
                f"{self.unit} is {state.active_state} ({state.sub_state}); "
                "systemd's Restart= handles a unit that is down"
            )
        if len(state.exec_start) != 1:
            raise ActuatorError(
                f"{self.unit} has {len(state.exec_start)} ExecStart= commands; vkvagent manages "
                "units that run one"
            )
        if change:
            refusal = self._quadlet_refusal(state)
            if refusal:
                raise ActuatorError(f"{self.unit}: {refusal}")
            self._check_access()
        self._check_gpus()
        self._check_foreign(state)
        self._check_start_limit(state, 2 if change else 1)
        return state

    def _check_access(self) -> None:
        """Before anything is drained or written: can this process write the drop-in?"""
        directory = self.dropin.path.parent
        while not directory.exists() and directory != directory.parent:
            directory = directory.parent
        targets = [directory] + ([self.dropin.path] if self.dropin.path.exists() else [])
        for target in targets:
            if not os.access(target, os.W_OK):
                raise ActuatorError(
                    f"access denied: cannot write {self.dropin.path} "
                    f"(changing {self.unit}'s flags needs root)"
                )

    def _check_gpus(self) -> None:
        """A GPU with uncorrectable memory errors or a hardware or driver XID within the
        reader's fault window needs a reset or a person; a restart would only bring vLLM back
        onto the faulty device. An application XID is what a restart fixes: no refusal. The
        XIDs come from the reader's log, so the sampler still sees them (and vice versa)."""
        if self._gpus is None:
            return
        readings, _problem = self._gpus.read(consume_xids=False)
        found: dict[int, list[str]] = {}
        for event in self._gpus.faults():
            found.setdefault(event.index, []).append(describe_xid(event.xid))
        for gpu in readings:
            if (gpu.ecc_uncorrected_volatile or 0) > 0:
                found.setdefault(gpu.index, []).append(
                    f"{gpu.ecc_uncorrected_volatile} uncorrectable ECC errors"
                )
        if found:
            index = min(found, key=lambda i: (i < 0, i))
            uuid = next((gpu.uuid for gpu in readings if gpu.index == index), "")
            name = f"GPU {index}" if index >= 0 else "a GPU that NVML did not name"
            raise ActuatorError(
                f"{name}{f' ({uuid})' if uuid else ''} reports "
                f"{', '.join(dict.fromkeys(found[index]))}: a restart cannot fix a GPU fault; "
                "it needs a GPU reset or a person"
            )

    def _free_gpus(self, before: UnitState) -> tuple[Holder, ...]:
        """No process of the run before on the GPUs (``gpu_free``): the unit's leftovers
        killed, another's refused. systemd kills them (KillUnit: every process left in the
        down unit's cgroup, which systemd still reports while any is there), so the agent
        needs no CAP_KILL for a vLLM that runs as another user."""
        assert self._gpus is not None
        try:
            return clear_gpus(
                self._gpus, self.unit, timeout=self.settings.job_timeout,
                cgroup=before.control_group, proc=self.proc, clock=self._clock,
                sleep=self._sleep, kill=lambda _pid: self._kill(),
            ).killed  # fmt: skip
        except (GpusBusy, _JobRefused) as exc:
            raise ActuatorError(str(exc)) from None

    def _gpus_held(self, vllm_error: str | None) -> str:
        """Who holds the GPUs, when vLLM failed for lack of GPU memory; "" otherwise."""
        if self._gpus is None or not is_gpu_memory_failure(vllm_error):
            return ""
        listed, _problem = self._gpus.processes()
        return "; ".join(str(h) for h in holders(listed, self.unit, self.proc))

    def _check_foreign(self, state: UnitState) -> None:
        text = self.dropin.read()
        if text is not None and is_foreign_edit(text):
            raise ActuatorError(_foreign(self.dropin.path))
        base = self._stored_base()
        if base is not None and text is not None:
            own = _own(state)
            if own is not None and argv_hash(own) != base["own_hash"]:
                raise ActuatorError(
                    f"{state.source_path if self._quadlet else state.fragment_path} changed "
                    "since vkvagent derived its command line (run `vkvagent adopt`)"
                )

    def _check_start_limit(self, state: UnitState, need: int) -> None:
        """Refuse when ``need`` more starts (two for a flag change: its own and a rollback's)
        could exceed the unit's start limit, which would leave it failed (start-limit-hit).

        systemd does not publish its count, so it is estimated: every restart vkvagent began
        within StartLimitIntervalSec, the start of the process the first of them replaced, and
        the running process's start when it is not one of vkvagent's. Other starts by others
        (systemctl, Restart=) before the running one are not seen."""
        if state.start_limit_burst <= 0 or state.start_limit_interval_usec <= 0:
            return
        window = state.start_limit_interval_usec / 1e6
        since = self._wall() - window
        ours: list[tuple[float, float]] = []  # (begun, ended) of each restart step
        for action in self.ledger.since(since):
            if action.outcome == "aborted":  # nothing reached systemd (a refused job included)
                continue
            begun: float | None = None
            for step in action.steps:
                if step.step != "restart":
                    continue
                if step.state == "begin":
                    begun = step.at
                    if begun >= since:
                        ours.append((begun, begun + self.settings.job_timeout))
                elif begun is not None and begun >= since:
                    ours[-1] = (begun, step.at)
        running = state.exec_main_start_timestamp / 1e6
        own_start = any(begun - 1 <= running <= ended + 1 for begun, ended in ours)
        others = (1 if ours else 0) + (1 if running >= since and not own_start else 0)
        starts = len(ours) + others
        if starts + need > state.start_limit_burst:
            raise ActuatorError(
                f"{self.unit} was started about {starts} times in the last {window:g} s; "
                f"{need} more (a {'flag change and its rollback' if need > 1 else 'restart'}) "
                f"could exceed its StartLimitBurst={state.start_limit_burst} "
                f"(StartLimitIntervalSec={window:g}) and leave it failed: try again later"
            )

    def _drain(self) -> bool:
        """Wait for a quiet moment (at most drain_max_in_flight requests in flight), for a vLLM
        that cannot drain by itself. Past drain_timeout, go on (False) or give up as when_busy
        says."""
        deadline = self._clock() + self.settings.drain_timeout
        while True:
            metrics = self._scrape()
            in_flight = _in_flight(metrics)
            if in_flight is None or in_flight <= self.settings.drain_max_in_flight:
                return True
            if self._clock() >= deadline:
                busy = (
                    f"still {in_flight:.0f} requests in flight after "
                    f"{self.settings.drain_timeout:g} s"
                )
                if self.settings.when_busy == "give-up":
                    raise ActuatorError(f"{busy} (when_busy = give-up; --no-drain restarts now)")
                self._progress(f"{busy}: restarting anyway (when_busy = proceed)")
                return False
            self._progress(f"draining: {in_flight:.0f} requests in flight")
            self._sleep(self.settings.poll_interval)

    def _hook(self, name: str, action: int, cause: str, ran: list[HookResult]) -> None:
        """Run the pre_stop or post_ready hook and add it to ``ran``; ActuatorError when it
        failed."""
        argv = getattr(self.settings, name)
        self._progress(f"running {name}: {' '.join(argv)}")
        env = {"VKVAGENT_UNIT": self.unit, "VKVAGENT_CAUSE": cause, "VKVAGENT_ACTION": str(action)}
        result = run_hook(name, argv, env, self.settings.hook_timeout)
        ran.append(result)
        if not result.ok:
            said = result.output.strip().splitlines()[-1:] or [""]
            raise ActuatorError(
                f"{name} {argv[0]} {result.problem}" + (f": {said[0][:200]}" if said[0] else "")
            )

    def _post_ready(self, action: int, result: str, cause: str, ran: list[HookResult]) -> None:
        """Run post_ready when vLLM serves at the end of the action: restarted (``done``),
        put back (``rolled-back``), or never stopped after pre_stop ran (``aborted``). A
        failure is reported (``Outcome.hooks``) and changes nothing about the result."""
        if not self.settings.post_ready or result == "failed":
            return
        if result == "aborted" and not self.ledger.action(action).finished("pre_stop"):
            return
        with contextlib.suppress(ActuatorError), self._step(action, "post_ready"):
            self._hook("post_ready", action, cause, ran)

    def _shutdown_timeout(self, state: UnitState) -> int:
        """The running vLLM's --shutdown-timeout (the process's own command line, else the
        unit's): seconds it drains after SIGTERM; 0 when it aborts or is not running."""
        if state.active_state != "active" or self._stop_reaches_the_engine(state):
            return 0
        seconds = _drains_for(_cmdline(self.proc, state.main_pid) or _argv(state))
        # Cut short by the engine's stop: a wait for a quiet moment drains instead.
        return 0 if engine_stop_too_short(state, seconds) else seconds

    def _stop_reaches_the_engine(self, state: UnitState) -> bool:
        """Whether systemd's stop sends its SIGTERM to vLLM's engine core and workers as well
        as to the API server (KillMode=control-group, with more processes in the unit's cgroup
        than its main one): they then fail the requests in flight at once instead of draining
        them (measured on 0.32, docs/operations.md), so the drain is a quiet moment's."""
        if state.kill_mode != "control-group":
            return False
        return any(pid != state.main_pid for pid in pids_in(state.control_group, self.proc))

    def _write(self, argv: tuple[str, ...], state: UnitState) -> None:
        if self._stored_base() is None or self.dropin.read() is None:
            # No drop-in of vkvagent's: the unit's command line as it is now is the base.
            self._save_base(_argv(state), own=_own(state))
        base = self._stored_base()
        assert base is not None
        own = _fragment_command(state)
        # The unit's own prefix ("-", ":", "+", "@"...) and program path stay as they were; with
        # ":" systemd expands no variables, so "$" must not be doubled either.
        prefix = (
            own.prefix if own is not None else ("-" if state.exec_start[0].ignore_failure else "")
        )
        path = own.path if own is not None else None
        try:
            self.dropin.write(self._render(argv, state, base["own_hash"], path=path, prefix=prefix))
        except OSError as exc:
            raise ActuatorError(_write_problem(self.dropin.path, exc)) from None

    def _render(
        self,
        argv: tuple[str, ...],
        state: UnitState,
        source_hash: str,
        *,
        path: str | None = None,
        prefix: str = "",
    ) -> str:
        """The drop-in that makes the unit run ``argv`` (in unit form, hence no ``$$``); for a
        unit Quadlet generates, its ``.container``'s, with vLLM's arguments after the image
        (the engine's part is the generator's, and ``plan`` keeps it as it is)."""
        stop = _stop_settings(argv)
        if self._quadlet:
            run = container.find(argv)
            if run is None:
                raise ActuatorError(f"{self.unit}: Quadlet's command line runs no podman")
            try:
                return render_container_dropin(
                    self.unit, argv[run.image + 1 :], source_hash=source_hash,
                    escape_dollar=False, stop=stop,
                )  # fmt: skip
            except ValueError as exc:
                raise ActuatorError(f"{self.unit}: {exc}") from None
        return render_dropin(
            self.unit, argv, source_hash=source_hash, path=path, prefix=prefix,
            escape_dollar=False, stop=stop,
        )  # fmt: skip

    def _reload(self) -> None:
        try:
            self.systemd.reload()
        except SystemdError as exc:
            raise ActuatorError(str(exc)) from None

    def _restart_step(self, action: int, before: UnitState, stop: _Stop | None = None) -> None:
        # The note is the invocation being replaced: recover() compares it with the unit's to
        # tell a restart systemd received from one that was only about to be requested.
        with self._step(action, "restart", note=before.invocation_id):
            if stop is not None and stop.drain == "none" and self._shutdown_timeout(before):
                # This vLLM would drain on SIGTERM, however long a hung engine takes.
                self._kill()
            self._restart_job(stop, start=before.active_state in ("inactive", "failed"))

    def _kill(self) -> None:
        try:
            self.systemd.kill(self.unit, signal.SIGKILL)
        except SystemdError as exc:
            raise _JobRefused(str(exc)) from None

    def _restart_job(self, stop: _Stop | None = None, start: bool = False) -> None:
        timeout, tick = self.settings.job_timeout, None
        if stop is not None and stop.drain == "vllm":  # systemd's stop is vLLM's drain
            timeout, tick = timeout + stop.shutdown + STOP_MARGIN, stop.tick
        job = self.systemd.start if start else self.systemd.restart
        try:
            result = job(self.unit, timeout=timeout, tick=tick)
            if stop is not None:
                stop.stopped_at = self._clock()
        except SystemdError as exc:
            if exc.reason == TIMEOUT:  # the job goes on
                raise ActuatorError(str(exc)) from None
            raise _JobRefused(str(exc)) from None
        if result != "done":
            what = "start" if start else "restart"
            raise ActuatorError(f"systemd's {what} job for {self.unit} ended '{result}'")

    def _restart_requested(self, action: Action, start: int) -> bool:
        """Whether the last restart step begun at or after ``start`` reached systemd."""
        begun = [
            i
            for i, s in enumerate(action.steps)
            if i >= start and s.step == "restart" and s.state == "begin"
        ]
        if not begun:
            return False
        note = action.steps[begun[-1]].note
        if any(s.step == "restart" and s.state == "done" for s in action.steps[begun[-1] :]):
            return True
        state = self._unit()
        return not note or state.invocation_id != note or state.active_state != "active"

    def _wait_ready(self, replaced: str | None) -> VllmMetrics:
        """Until /metrics answers from a process newer than invocation ``replaced`` (None: any)
        and, with traffic, tokens advance."""
        deadline = self._clock() + self.settings.ready_timeout
        last: VllmMetrics | None = None
        problem = "not started"
        while self._clock() < deadline:
            state = self._unit()
            if state.active_state == "failed" or (
                state.active_state == "inactive" and state.sub_state == "dead"
            ):
                raise ActuatorError(
                    f"{self.unit} {state.active_state} ({state.sub_state}, {state.result}) "
                    "after the restart"
                )
            # The new process died and Restart= starts it again (NRestarts counts those since
            # the last start that was asked for): waiting on would only spend the start limit
            # a rollback needs.
            if state.sub_state == "auto-restart" or (replaced is not None and state.n_restarts):
                raise ActuatorError(
                    f"{self.unit} exited and Restart= is starting it again ({state.result})"
                )
            fresh = replaced is None or state.invocation_id != replaced
            if fresh and state.active_state == "active":
                try:
                    metrics = self.probe.scrape()
                except ScrapeError as exc:
                    problem = str(exc)
                else:
                    busy = (metrics.num_requests_running or 0) > 0
                    if not busy or (last is not None and _advanced(last, metrics)):
                        return metrics
                    last, problem = metrics, "requests running, tokens not advancing yet"
            self._progress(f"waiting for {self.unit}: {problem}")
            self._sleep(self.settings.poll_interval)
        raise ActuatorError(
            f"{self.unit} not ready within {self.settings.ready_timeout:g} s: {problem}"
        )

    def _attest(
        self,
        argv: tuple[str, ...],
        flags: Mapping[str, FlagValue],
        metrics: VllmMetrics,
    ) -> None:
        state = self._unit()
        running, argv = self._vllms_command(state, argv)
        environ = _environ(self.proc, state.main_pid)
        if running is not None and not _same_command(running, argv, environ):
            raise ActuatorError(
                f"the running process's command line is not the one written: "
                f"{' '.join(running)[:200]}"
            )
        for name, value in flags.items():
            spec = vflags.CATALOGUE[name]
            if spec.attested(value, metrics.cache_config) is False:
                raise ActuatorError(
                    f"--{name} is not in effect: cache_config_info shows "
                    f"{spec.attest_label}={metrics.cache_config.get(spec.attest_label or '')}"
                )

    def _vllms_command(
        self, state: UnitState, argv: tuple[str, ...]
    ) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
        """vLLM's own command line as it runs, and the part of ``argv`` it must equal. In a
        container MainPID is the engine, whose argv is the unit's whatever vLLM received: the
        process that proves the flags is vLLM's in the container, found in the unit's cgroup
        (podman with --cgroups=split or disabled, Quadlet) or through the engine by the
        container's name (Docker); its arguments are compared with those after the image.
        (None, argv) when it cannot be found: cache_config_info alone proves the flags."""
        written = vflags.parse_command(argv)
        engine = written.container
        if engine is None:
            return _cmdline(self.proc, state.main_pid), argv
        for pid in _container_pids(state, engine, argv, self.proc):
            running = _cmdline(self.proc, pid) or ()
            try:
                inside = vflags.parse_command(running)
            except vflags.VllmCommandError:
                continue
            if inside.container is None:  # vLLM itself, not the engine's copy of the line
                return running[inside.args_start :], argv[written.args_start :]
        return None, argv

    def _restore(self, action: int, previous: str | None, *, restart: bool) -> None:
        with self._step(action, "restore"):
            self._put_back(previous)
        if restart:
            before = self._unit()
            self._restart_step(action, before)
            with self._step(action, "ready"):
                self._wait_ready(before.invocation_id)

    def _put_back(self, previous: str | None) -> None:
        try:
            self.dropin.restore(previous)
        except OSError as exc:
            raise ActuatorError(_write_problem(self.dropin.path, exc)) from None
        self._reload()

    def _finish(
        self,
        action: int,
        result: str,
        message: str,
        started: float,
        *,
        ended: float | None = None,
        service_seconds: float | None = None,
        flags: Mapping[str, FlagValue] | None = None,
        vllm_error: str | None = None,
        costs: Costs | None = None,
        hooks: tuple[HookResult, ...] = (),
        freed: tuple[str, ...] = (),
        gpus_held: str = "",
    ) -> Outcome:
        """End the ledger's action, with what it cost and its hooks' output, and say how it
        went: the one way every action ends. Its seconds run from ``started`` to ``ended``
        (vLLM ready), or to now."""
        notes: dict[str, Any] = {}
        if costs is not None:
            notes["costs"] = costs.to_json()
        if hooks:
            notes["hooks"] = [hook.to_json() for hook in hooks]
        self.ledger.end(action, result, self._wall(), notes)
        seconds = (self._clock() if ended is None else ended) - started
        return Outcome(
            action,
            result,
            message,
            seconds,
            service_seconds,
            dict(flags or {}),
            vllm_error,
            costs,
            hooks,
            freed,
            gpus_held,
        )

    def _fail(
        self,
        action: int,
        error: ActuatorError,
        change: bool,
        started: float,
        costs: Costs | None = None,
        hooks: tuple[HookResult, ...] = (),
        cause: str = "manual",
    ) -> Outcome:
        message = str(error)
        progress = self.ledger.action(action)
        previous = progress.detail.get("previous_dropin")
        restarted = progress.reached("restart") and not isinstance(error, _JobRefused)
        flags = progress.detail.get("changes") or {}
        vllm_error = None
        if restarted:  # vLLM's own words say why better than the unit's state
            begun = [s for s in progress.steps if (s.step, s.state) == ("restart", "begin")]
            if begun:  # the restart's note is the invocation it replaced
                vllm_error = self._why_it_failed(self.unit, begun[0].at, begun[0].note)
            if vllm_error is not None:
                message = f"{message}; vLLM: {vllm_error}"
        # A write that failed before changing the file leaves nothing to undo.
        wrote = progress.reached("write") and (
            progress.reached("reload") or self.dropin.read() != previous
        )
        held = self._gpus_held(vllm_error) if restarted else ""
        if held:  # the flags are not to blame: kept, neither rolled back nor refused
            result = "failed"
            message = f"{message}; the GPUs are held by {held}: not the flags' fault, kept"
        elif change and wrote:
            try:
                self._restore(action, previous, restart=restarted)
            except ActuatorError as exc:
                result, message = "failed", f"{message}; the rollback failed too: {exc}"
            else:
                result, message = "rolled-back", f"{message}; previous command line restored"
        else:
            result = "failed" if restarted else "aborted"
        ran = list(hooks)
        self._post_ready(action, result, cause, ran)
        return self._finish(
            action,
            result,
            message,
            started,
            flags=flags,
            vllm_error=vllm_error,
            costs=costs,
            hooks=tuple(ran),
            gpus_held=held,
        )

    # -- helpers ----------------------------------------------------------------------------

    class _StepContext:
        def __init__(self, actuator: Actuator, action: int, step: str, note: str) -> None:
            self.actuator, self.action, self.step, self.note = actuator, action, step, note

        def __enter__(self) -> None:
            a = self.actuator
            a.ledger.step(self.action, self.step, "begin", a._wall(), self.note)
            if os.environ.get("VKVAGENT_KILL_AT") == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

        def __exit__(self, kind: object, exc: object, _tb: object) -> None:
            a = self.actuator
            state = "done" if kind is None else "failed"
            a.ledger.step(self.action, self.step, state, a._wall(), "" if exc is None else str(exc))

    def _step(self, action: int, step: str, note: str = "") -> Actuator._StepContext:
        return Actuator._StepContext(self, action, step, note)

    def _unit(self) -> UnitState:
        try:
            return self.systemd.unit(self.unit)
        except SystemdError as exc:
            raise ActuatorError(str(exc)) from None

    def _scrape(self) -> VllmMetrics | None:
        try:
            return self.probe.scrape()
        except ScrapeError:
            return None

    def _base(self, state: UnitState) -> tuple[str, ...]:
        """The command line flags are applied to: the one vkvagent derived its drop-in from
        while that drop-in is in place, else the unit's as it is now (the unit file may have
        been edited since a rollback removed the drop-in)."""
        stored = self._stored_base()
        if stored is None or self.dropin.read() is None:
            return _argv(state)
        return tuple(stored["argv"])

    def _stored_base(self) -> dict[str, Any] | None:
        try:
            loaded: dict[str, Any] = json.loads(self._base_file.read_text(encoding="utf-8"))
            return loaded
        except (OSError, ValueError):
            return None

    def _save_base(self, argv: tuple[str, ...], own: tuple[str, ...] | None = None) -> None:
        record = {"argv": list(argv), "own_hash": argv_hash(own or argv)}
        try:
            write_atomically(self._base_file, json.dumps(record), 0o640)
        except OSError as exc:
            raise ActuatorError(_write_problem(self._base_file, exc)) from None


class _Stop:
    """One stop of vLLM, watched through /metrics from just before the restart job: the
    requests in flight when it was asked for, how long vLLM's own drain took (``drain``
    "vllm", its ``shutdown`` timeout), and what was cut off (``Costs``). ``waited``: the
    quiet-moment wait before it, if any."""

    def __init__(
        self, actuator: Actuator, before: UnitState, drain: str, waited: float | None, shutdown: int
    ) -> None:
        self.actuator, self.drain, self.waited, self.shutdown = actuator, drain, waited, shutdown
        metrics = actuator._scrape()
        self.in_flight = _in_flight(metrics)
        self.busy = self.in_flight or 0.0  # the last non-zero count seen
        self.rate: float | None = None  # the run's mean requests/s until the stop
        start = before.exec_main_start_timestamp / 1e6
        if metrics is not None and metrics.request_success_total is not None and start:
            uptime = actuator._wall() - start
            self.rate = metrics.request_success_total / uptime if uptime >= 60 else None
        self.drained_at: float | None = None  # when none were left in flight
        self.gone_at: float | None = None  # when vLLM stopped answering
        self.stopped_at: float | None = None  # when systemd's job (stop and start) ended
        self.requested = actuator._clock()  # the restart job is asked for now

    def tick(self) -> None:
        """While systemd stops a vLLM that drains: watch the requests in flight fall."""
        a = self.actuator
        if self.gone_at is not None:
            return
        metrics = a._scrape()
        now = a._clock()
        if metrics is None:
            self.gone_at = now
            return
        left = _in_flight(metrics) or 0.0
        if left:
            self.busy = left
            a._progress(
                f"stopping: vLLM finishing {left:.0f} requests in flight "
                f"({now - self.requested:.0f} s of at most {self.shutdown} s)"
            )
        elif self.drained_at is None:
            self.drained_at = now

    def costs(self, ready_at: float | None) -> Costs:
        drained: float | None = self.waited
        aborted: float | None = self.in_flight  # stopped without a drain: all of them
        if self.drain == "vllm":
            # None left in flight; vLLM went away (it exits once its drain is over, so it may
            # go between two looks that saw requests in flight); or it was gone before a
            # first look.
            ends = (self.drained_at, self.gone_at, self.stopped_at)
            end = next((t for t in ends if t is not None), None)
            drained = None if end is None else end - self.requested
            # vLLM aborts what is left only at its --shutdown-timeout.
            aborted = self.busy if drained is not None and drained >= self.shutdown else 0.0
        down = None if ready_at is None else ready_at - self.requested
        missed = None if self.rate is None or down is None else self.rate * down
        return Costs(self.drain, self.in_flight, aborted, drained, down, missed)


def _with(plan: Plan) -> str:
    return " with the new flags" if plan.changes else " with systemd's stop settings for the drain"


def _drains_for(argv: tuple[str, ...]) -> int:
    """The seconds ``argv``'s vLLM drains after SIGTERM (its --shutdown-timeout); 0: none."""
    try:
        value = vflags.parse_command(argv).value("shutdown-timeout")
    except vflags.VllmCommandError:
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def engine_stop_too_short(state: UnitState, drain: int) -> str:
    """Why a drain of ``drain`` seconds through vLLM's --shutdown-timeout cannot happen in
    this unit: its ExecStop= stops vLLM's container through the engine, which kills it sooner
    than the drain and vLLM's teardown (STOP_MARGIN) take. The operator's ExecStop= stands:
    vkvagent then drains by waiting for a quiet moment before the stop. "" when it fits, or
    when the unit runs no container or stops none through an engine."""
    try:
        run = container.find(_argv(state))
    except (ActuatorError, container.ContainerError):
        return ""
    if run is None or not drain:
        return ""
    grace, need = container.stop_grace(run, state.exec_stop), drain + STOP_MARGIN
    if grace is None or grace[0] >= need:
        return ""
    if " rm " not in f" {grace[1]} ":
        fix = f"give the engine's stop -t {need} or more"
    elif run.engine == "podman":  # Quadlet's rm -f: stopped after the run's timeout
        fix = f"run the container with --stop-timeout {need} or more (Quadlet: PodmanArgs=)"
    else:
        fix = f"stop the container with `{run.engine} stop -t {need}` first"
    return (
        f"ExecStop= `{grace[1]}` kills vLLM's container {grace[0]} s after its stop signal, "
        f"before a drain of {drain} s and vLLM's teardown end: vkvagent drains by waiting for "
        f"a quiet moment before the stop instead; {fix} to let vLLM drain itself"
    )


def _stop_settings(argv: tuple[str, ...]) -> dict[str, str]:
    """How systemd must stop a command line whose vLLM drains on SIGTERM: wait the drain out
    (TimeoutStopSec=), and signal the API server alone (KillMode=mixed). A SIGTERM of their own
    kills the engine and its workers at once, failing the requests in flight (measured on 0.32);
    from the API server they get the drain."""
    seconds = _drains_for(argv)
    return {"TimeoutStopSec": str(seconds + STOP_MARGIN), "KillMode": "mixed"} if seconds else {}


def _index(action: Action, step: str) -> int | None:
    """Where ``step`` was first begun in ``action``'s steps."""
    return next((i for i, s in enumerate(action.steps) if s.step == step), None)


def _restart_note(action: Action) -> str | None:
    """The invocation the last restart step replaced (its note), None if unrecorded."""
    notes = [s.note for s in action.steps if s.step == "restart" and s.state == "begin"]
    return notes[-1] if notes and notes[-1] else None


def _foreign(path: Path) -> str:
    return (
        f"{path} was edited by someone else; vkvagent will not overwrite it "
        "(run `vkvagent adopt` to take it over)"
    )


def _write_problem(path: Path, exc: OSError) -> str:
    reason = exc.strerror or str(exc)
    if isinstance(exc, PermissionError):
        return f"access denied: cannot write {path}: {reason}"
    return f"cannot write {path}: {reason}"


def _argv(state: UnitState) -> tuple[str, ...]:
    if not state.exec_start:
        raise ActuatorError(f"{state.name} has no ExecStart")
    return tuple(state.exec_start[-1].argv)


def _fragment_command(state: UnitState) -> ExecCommand | None:
    """The unit file's own ExecStart, whatever drop-ins say; None when it cannot be read."""
    try:
        text = Path(state.fragment_path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    exec_start = parse_dropin(text).exec_start  # a unit file reads like a drop-in
    if exec_start is None:
        return None
    try:
        commands = split_exec_start(exec_start, specifiers=_specifiers(state.name), strict=False)
    except ExecSyntaxError:
        return None
    return commands[-1] if commands else None


def _fragment_argv(state: UnitState) -> tuple[str, ...] | None:
    command = _fragment_command(state)
    return apikey.mask_argv(command.argv) if command is not None else None


def _specifiers(unit: str) -> dict[str, str]:
    """The unit-name specifiers of ``unit`` (``vllm@a.service``: %n, %N, %p, %i, %I, %j)."""
    name, _dot, _kind = unit.rpartition(".")
    prefix, at, instance = name.partition("@")
    return {
        "n": unit, "N": name, "p": prefix, "P": prefix, "i": instance if at else "",
        "I": instance if at else "", "j": prefix.rsplit("-", 1)[-1], "J": prefix.rsplit("-", 1)[-1],
    }  # fmt: skip


def _in_flight(metrics: VllmMetrics | None) -> float | None:
    if metrics is None or metrics.num_requests_running is None:
        return None
    return metrics.num_requests_running + (metrics.num_requests_waiting or 0)


def _advanced(before: VllmMetrics, after: VllmMetrics) -> bool:
    pairs = (
        (before.generation_tokens_total, after.generation_tokens_total),
        (before.engine_steps_total, after.engine_steps_total),
    )
    return any(old is not None and new is not None and new > old for old, new in pairs)


def _is_quadlet(source_path: str) -> bool:
    """Whether a unit is Quadlet's: generated from the ``.container`` file ``source_path``."""
    return source_path.endswith(".container")


def _source_path(systemd: Systemd, unit: str) -> str:
    """The file a generator made ``unit`` from; "" for a unit file, or when systemd cannot say
    now (the actuator's preflight then reports why)."""
    try:
        return systemd.unit(unit).source_path
    except SystemdError:
        return ""


def _own(state: UnitState) -> tuple[str, ...] | None:
    """What vkvagent's drop-in is derived from, to notice later that it changed: the unit
    file's own ExecStart, or Quadlet's whole ``.container`` file (the unit it generates holds
    the drop-in's Exec= too). None when it cannot be read."""
    if not _is_quadlet(state.source_path):
        return _fragment_argv(state)
    try:
        return (Path(state.source_path).read_text(encoding="utf-8"),)
    except (OSError, UnicodeDecodeError):
        return None


def _container_pids(
    state: UnitState, engine: Container, argv: tuple[str, ...], proc: Path
) -> Iterator[int]:
    """The processes that may be vLLM's in a container: the unit's but its MainPID, then the
    container's first process by the engine's word (asked only if those are not)."""
    yield from (pid for pid in pids_in(state.control_group, proc) if pid != state.main_pid)
    pid = engine.main_pid(argv)
    if pid is not None:
        yield pid


def _cmdline(proc: Path, pid: int) -> tuple[str, ...] | None:
    if pid <= 0:
        return None
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    argv = (part.decode("utf-8", "surrogateescape") for part in raw.split(b"\0")[:-1])
    return apikey.mask_argv(tuple(argv))  # as systemd's ExecStart reads (systemd.UnitState)


def _environ(proc: Path, pid: int) -> dict[str, str] | None:
    if pid <= 0:
        return None
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode("utf-8", "surrogateescape").partition("=") for item in raw.split(b"\0"))
    return {name: value for name, _eq, value in pairs if name}


def _same_command(
    running: tuple[str, ...], intended: tuple[str, ...], environ: dict[str, str] | None
) -> bool:
    """The process's argv against the written one, after systemd's ``$VAR`` expansion with
    the process's own environment (``$EXTRA_ARGS`` may become several words). Without the
    environment, arguments with ``$`` are compared by position only."""
    if environ is not None:  # the key `--api-key ${VAR}` expands to is masked in ``running``
        return running == apikey.mask_argv(expand_exec_env(intended, environ))
    if len(running) != len(intended):
        return False
    return all("$" in want or got == want for got, want in zip(running, intended))
