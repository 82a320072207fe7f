"""The one path for every restart and flag change: preflight, drain, drop-in and reload,
restart, wait until ready, attest, and roll back a flag change that broke or did not take.

Each step is written to the ledger before and after it runs (``steps``), so ``recover()`` can
finish or undo whatever a crash interrupted: a drop-in written but not yet in effect is
restored; a restart already requested is never requested twice.

Only one vkvagent acts on a unit at a time (``exclusive()``): a second one would take the
first's open action for an interrupted one and undo it mid-way.

The checks before it begins are ``preflight``'s; where the drop-in goes and what it says,
``unit_dropin``'s; the drain, ``drain``'s; when vLLM serves again, ``restarted``'s; how the
action ended, ``outcome``'s.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vkvagent import apikey
from vkvagent.actuation import unit_command
from vkvagent.actuation.drain import (
    DRAIN_FLAG,
    STOP_MARGIN,
    Costs,
    Stop,
    drain_change,
    drains_for,
    engine_stop_too_short,
    may_drain_itself,
    stop_reaches_the_engine,
    wait_for_quiet,
)
from vkvagent.actuation.outcome import Outcome
from vkvagent.actuation.preflight import (
    foreign_edit,
    foreign_refusal,
    gpu_fault_refusal,
    start_limit_refusal,
    unit_refusal,
    write_refusal,
)
from vkvagent.actuation.restarted import NotReady, attest_refusal, wait_ready
from vkvagent.actuation.steps import Step, first_index, last_restart, restart_note
from vkvagent.actuation.unit_dropin import (
    BaseFile,
    UnitDropinError,
    dropin_for,
    is_quadlets,
    quadlet_refusal,
    render,
    write_problem,
)
from vkvagent.adapters import unitlog
from vkvagent.adapters.gpu import GpuReader
from vkvagent.adapters.gpu_free import GpusBusy, Holder, clear_gpus, holders, is_gpu_memory_failure
from vkvagent.adapters.ledger import Action, Ledger
from vkvagent.adapters.systemd import TIMEOUT, Systemd, SystemdError, UnitState
from vkvagent.adapters.vllm import ScrapeError, VllmClient
from vkvagent.engine.samples import FlagValue, VllmMetrics
from vkvagent.errors import VkvagentError
from vkvagent.hooks import HookResult, run_hook
from vkvagent.knowledge import flags as vflags
from vkvagent.knowledge.config import Config
from vkvagent.knowledge.dropin import DropinFile, argv_hash, is_foreign_edit, other_settings
from vkvagent.knowledge.vllm_command import VllmCommandError, apply_flags, parse_command


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
        self._base_file = BaseFile(state_dir / f"base-{unit}.json")
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
        change = drain_change(current, wanted, state.kill_mode, vllm_version)
        if change is None:
            return None
        after, changes = change
        return Plan(self.unit, current, after, wanted, (), True, changes)

    @property
    def _quadlet(self) -> bool:
        """Whether this actuator writes a Quadlet ``.container``'s drop-in (``dropin_for``)."""
        return is_quadlets(self.dropin)

    def _quadlet_refusal(self, state: UnitState) -> str:
        """``quadlet_refusal``: why vkvagent cannot change this unit's flags; "" when it can."""
        try:
            return quadlet_refusal(self.unit, state, self._quadlet)
        except UnitDropinError as exc:
            raise ActuatorError(str(exc)) from None

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
            raise ActuatorError(foreign_edit(self.dropin.path))

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
            undo_from = first_index(action, "restore")
            restart = any(s.step == "restart" for s in action.steps[:undo_from])
            self._finish_restore(action, previous, restart=restart)
            return "rolled-back", "interrupted rollback of a failed flag change completed"
        if action.finished("attest") or (not change and action.finished("ready")):
            return "done", "interrupted action had completed"
        if self._restart_requested(action, 0):
            # systemd has it: never request it again. Wait for it; prove a flag change.
            try:
                with self._step(action.id, "ready"):
                    metrics = self._wait_ready(restart_note(action))
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
        undo_from = first_index(action, "restore")
        if undo_from is None or not action.finished("restore"):
            with self._step(action.id, "restore"):
                self._put_back(text)
        if not restart:
            return
        if self._restart_requested(action, undo_from or 0):
            with self._step(action.id, "ready"):
                self._wait_ready(restart_note(action))
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
                    self._render(current, argv_hash(own or current)),
                    keep=False,  # the same command line: nothing for a rollback to go back to
                )
            except OSError as exc:
                raise ActuatorError(write_problem(self.dropin.path, exc)) from None
            self._reload()
        return Plan(self.unit, current, current, {}, (), False, {})

    # -- steps ------------------------------------------------------------------------------

    def _preflight(self, change: bool, down: bool = False) -> UnitState:
        """The unit as it is, when nothing in ``preflight`` refuses the action."""
        state = self._unit()
        _refuse(unit_refusal(self.unit, state, down))
        if change:
            refusal = self._quadlet_refusal(state)
            _refuse(f"{self.unit}: {refusal}" if refusal else "")
            _refuse(write_refusal(self.dropin.path, self.unit))
        self._check_gpus()
        self._check_foreign(state)
        self._check_start_limit(state, 2 if change else 1)
        return state

    def _check_gpus(self) -> None:
        """ActuatorError on a GPU fault a restart cannot fix (``gpu_fault_refusal``)."""
        _refuse(gpu_fault_refusal(self._gpus) if self._gpus is not None else "")

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
        """ActuatorError when the drop-in is no longer vkvagent's to rewrite."""
        text, base = self.dropin.read(), self._base_file.load()
        _refuse(foreign_refusal(state, text, self.dropin.path, base, self._quadlet))

    def _check_start_limit(self, state: UnitState, need: int) -> None:
        """ActuatorError when ``need`` more starts could exceed the unit's start limit
        (``start_limit_refusal``)."""
        _refuse(
            start_limit_refusal(
                self.unit, state, need, self.ledger, self._wall(), self.settings.job_timeout
            )
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
        if self._base_file.load() is None or self.dropin.read() is None:
            # No drop-in of vkvagent's: the unit's command line as it is now is the base.
            self._save_base(_argv(state), own=unit_command.own(state))
        base = self._base_file.load()
        assert base is not None
        own = unit_command.fragment_command(state)
        # The unit's own prefix ("-", ":", "+", "@"...) and program path stay as they were; with
        # ":" systemd expands no variables, so "$" must not be doubled either.
        prefix = (
            own.prefix if own is not None else ("-" if state.exec_start[0].ignore_failure else "")
        )
        path = own.path if own is not None else None
        try:
            self.dropin.write(self._render(argv, base["own_hash"], path=path, prefix=prefix))
        except OSError as exc:
            raise ActuatorError(write_problem(self.dropin.path, exc)) from None

    def _render(
        self,
        argv: tuple[str, ...],
        source_hash: str,
        *,
        path: str | None = None,
        prefix: str = "",
    ) -> str:
        """The drop-in that makes the unit run ``argv`` (``unit_dropin.render``)."""
        try:
            return render(
                self.unit, argv, source_hash, quadlet=self._quadlet, path=path, prefix=prefix
            )
        except UnitDropinError as exc:
            raise ActuatorError(str(exc)) from None

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
        last = last_restart(action, start)
        if last is None:
            return False
        note, done = last
        if done:
            return True
        state = self._unit()
        return not note or state.invocation_id != note or state.active_state != "active"

    def _wait_ready(self, replaced: str | None) -> VllmMetrics:
        """Until vLLM serves from a process newer than invocation ``replaced`` (None: any):
        ``wait_ready``."""
        try:
            return wait_ready(
                self.unit, replaced, read_unit=self._unit, scrape=self.probe.scrape,
                timeout=self.settings.ready_timeout, poll_interval=self.settings.poll_interval,
                clock=self._clock, sleep=self._sleep, progress=self._progress,
            )  # fmt: skip
        except NotReady as exc:
            raise ActuatorError(str(exc)) from None

    def _attest(
        self, argv: tuple[str, ...], flags: Mapping[str, FlagValue], metrics: VllmMetrics
    ) -> None:
        _refuse(attest_refusal(self._unit(), argv, flags, metrics, self.proc))

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
            raise ActuatorError(write_problem(self.dropin.path, exc)) from None
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

    def _step(self, action: int, step: str, note: str = "") -> Step:
        return Step(self.ledger, action, step, note, self._wall)

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
        stored = self._base_file.load()
        if stored is None or self.dropin.read() is None:
            return _argv(state)
        return tuple(stored["argv"])

    def _save_base(self, argv: tuple[str, ...], own: tuple[str, ...] | None = None) -> None:
        try:
            self._base_file.save(argv, own)
        except OSError as exc:
            raise ActuatorError(write_problem(self._base_file.path, exc)) from None


def _with(plan: Plan) -> str:
    return " with the new flags" if plan.changes else " with systemd's stop settings for the drain"


def _refuse(refusal: str) -> None:
    """Raise a check's refusal (``preflight``) as ActuatorError; nothing when it is ""."""
    if refusal:
        raise ActuatorError(refusal)


def _argv(state: UnitState) -> tuple[str, ...]:
    if not state.exec_start:
        raise ActuatorError(f"{state.name} has no ExecStart")
    return tuple(state.exec_start[-1].argv)
