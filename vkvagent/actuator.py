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

from vkvagent import apikey, container, unit_command, unitlog
from vkvagent import flags as vflags
from vkvagent.atomicfile import write_atomically
from vkvagent.config import Config
from vkvagent.drain import (
    DRAIN_FLAG,
    STOP_MARGIN,
    Costs,
    Stop,
    drains_for,
    engine_stop_too_short,
    may_drain_itself,
    stop_reaches_the_engine,
    stop_settings,
    wait_for_quiet,
)
from vkvagent.dropin import (
    DROPIN_NAME,
    DropinFile,
    argv_hash,
    is_foreign_edit,
    other_settings,
    render_container_dropin,
    render_dropin,
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
from vkvagent.vllm_command import VllmCommandError, apply_flags, parse_command

STEPS = (
    "preflight", "pre_stop", "drain", "write", "reload", "restart", "ready", "attest",
    "post_ready",
)  # fmt: skip


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
    if unit_command.is_quadlet(source_path):
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
                cfg.vllm.unit,
                unit_command.source_path(systemd, cfg.vllm.unit),
                state_dir / "dropins",
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
            after = tuple(apply_flags(base, values, vllm_version=vllm_version))
        except ValueError as exc:  # VllmCommandError: not a vllm serve command line
            said = str(exc)
            if said == apikey.ON_COMMAND_LINE and self._quadlet:
                said = apikey.ON_QUADLET_LINE
            raise ActuatorError(f"{self.unit}: {said}") from None
        attestable = tuple(n for n in values if vflags.CATALOGUE[n].attest_label)
        try:
            running = parse_command(current)
            changes = {n: v for n, v in values.items() if running.value(n) != v}
        except VllmCommandError:
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
        if not may_drain_itself(self.settings.graceful_shutdown, vllm_version):
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
        if vllm_version is not None and not may_drain_itself(
            self.settings.graceful_shutdown, vllm_version
        ):
            return ""
        return engine_stop_too_short(self._unit(), math.ceil(self.settings.drain_timeout))

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
            running = parse_command(current)
            changes = {n: v for n, v in wanted.items() if running.value(n) != v}
            # The flags alone do not drain where the unit's stop signals vLLM's engine too:
            # the drop-in's KillMode=mixed (``_stop_settings``) is then the change.
            if not changes and state.kill_mode != "control-group":
                return None
            after = tuple(apply_flags(current, wanted, vllm_version=vllm_version))
        except VllmCommandError:
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
        quadlet = unit_command.is_quadlet(state.source_path)
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
        stop: Stop | None = None
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
            stop = Stop(
                before, how, waited, shutdown, scrape=self._scrape, clock=self._clock,
                wall=self._wall, progress=self._progress,
            )  # fmt: skip
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
        own = unit_command.own(state)
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
            own = unit_command.own(state)
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
        """Wait for a quiet moment (``wait_for_quiet``), for a vLLM that cannot drain by
        itself. Past drain_timeout, go on (False) or give up as when_busy says."""
        s = self.settings
        busy = wait_for_quiet(
            s.drain_max_in_flight, s.drain_timeout, s.poll_interval, scrape=self._scrape,
            clock=self._clock, sleep=self._sleep, progress=self._progress,
        )  # fmt: skip
        if not busy:
            return True
        if s.when_busy == "give-up":
            raise ActuatorError(f"{busy} (when_busy = give-up; --no-drain restarts now)")
        self._progress(f"{busy}: restarting anyway (when_busy = proceed)")
        return False

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
        if state.active_state != "active" or stop_reaches_the_engine(state, self.proc):
            return 0
        seconds = drains_for(unit_command.cmdline(self.proc, state.main_pid) or _argv(state))
        # Cut short by the engine's stop: a wait for a quiet moment drains instead.
        return 0 if engine_stop_too_short(state, seconds) else seconds

    def _write(self, argv: tuple[str, ...], state: UnitState) -> None:
        if self._stored_base() is None or self.dropin.read() is None:
            # No drop-in of vkvagent's: the unit's command line as it is now is the base.
            self._save_base(_argv(state), own=unit_command.own(state))
        base = self._stored_base()
        assert base is not None
        own = unit_command.fragment_command(state)
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
        stop = stop_settings(argv)
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

    def _restart_step(self, action: int, before: UnitState, stop: Stop | None = None) -> None:
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

    def _restart_job(self, stop: Stop | None = None, start: bool = False) -> None:
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
        running, argv = unit_command.vllms_command(state, argv, self.proc)
        environ = unit_command.environ(self.proc, state.main_pid)
        if running is not None and not unit_command.same_command(running, argv, environ):
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


def _with(plan: Plan) -> str:
    return " with the new flags" if plan.changes else " with systemd's stop settings for the drain"


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


def _advanced(before: VllmMetrics, after: VllmMetrics) -> bool:
    pairs = (
        (before.generation_tokens_total, after.generation_tokens_total),
        (before.engine_steps_total, after.engine_steps_total),
    )
    return any(old is not None and new is not None and new > old for old, new in pairs)
