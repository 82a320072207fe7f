"""How an action ended: ``Outcome``, what the actuator hands back for every restart, flag
change, rollback and recovery, and the events that report it.

Apart from the actuator because its readers (the CLI, the daemon, the fleet) need only what
happened, not how the restart is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vkvagent.actuation.drain import Costs
from vkvagent.engine.samples import FlagValue
from vkvagent.hooks import HookResult
from vkvagent.knowledge import flags as vflags


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
