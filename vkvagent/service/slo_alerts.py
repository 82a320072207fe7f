"""The [slo] objectives' burn alerts: the status's ``slo`` part each tick, and an event when
an objective's error budget starts burning (none to slow or fast, slow to fast) or stops.
The engine keeps the counts (``engine.slo``); this says what changed, once.
"""

from __future__ import annotations

from collections.abc import Callable

from vkvagent.engine import Decision
from vkvagent.engine.slo import SloSettings
from vkvagent.knowledge import status, status_text


class BurnAlerts:
    """The burn alert last reported for each objective."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self.emit = emit
        self._burning: dict[str, str] = {}  # objective -> its burn alert last reported

    def report(
        self, settings: SloSettings, decision: Decision, at: float
    ) -> status.SloStatus | None:
        """The objectives of [slo] for the status, and an event when one's burn alert rises
        (none to slow or fast, slow to fast) or stops; None, and no work, without [slo]."""
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
            self.emit(
                name,
                f"{o.objective} error budget {change} ({o.words}): burn rate "
                f"{status_text.burn_words(o.burn_rates)}; "
                f"{status_text.budget_words(o.budget_remaining)}",
                objective=o.objective,
                words=o.words,
                target=o.target,
                alert=alert or was,
                burn_rates=dict(o.burn_rates),
                budget_remaining=o.budget_remaining,
                attainment=dict(o.attainment),
            )
        return status.SloStatus(settings.period_days, objectives)
