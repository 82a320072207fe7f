"""Hysteresis: a symptom that must hold a while to count, and clearly go to be gone.

A threshold alone flips with every minute's noise. Each symptom diagnosis watches (the speed
below the baseline, KV pressure, stranded KV, a KV leak, one data-parallel engine behind its
peers) enters below one line and leaves above another, counts only once it has held for
``hold``, and is forgotten when not seen again within it. Bursty traffic's light minutes are
no evidence against a symptom seen at its heavy ones (``SAME_LOAD_SHARE``). Times are
monotonic seconds (``Sample.mono``); the state goes into engine.json with the diagnosis state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from vkvagent.engine.samples import optional_float

# A window at this share of the lightest load a symptom was seen at, or more, can show it gone:
# the same load, give or take its minute-to-minute noise.
SAME_LOAD_SHARE = 0.9


@dataclass(frozen=True)
class Hysteresis:
    """A symptom that must hold for ``hold`` seconds to become active, and stays active until
    its leaving condition is seen. Times are monotonic seconds (``Sample.mono``)."""

    active: bool = False
    pending_since: float | None = None
    active_since: float | None = None
    last_entering: float | None = None  # when the entering threshold was last crossed
    load: float | None = None  # the lightest load (requests/s) it was crossed at
    # The heaviest of the lighter loads it was seen gone at: evidence once it is crossed at a
    # load as light.
    cleared: float | None = None

    def step(
        self,
        entering: bool | None,
        leaving: bool | None,
        now: float,
        hold: float,
        load: float | None = None,
    ) -> Hysteresis:
        """``entering``: the symptom's threshold is crossed now; ``leaving``: it is clearly
        gone. In between (or None: no evidence, e.g. no baseline at this load) nothing
        changes, so noise around the entering threshold neither resets the clock nor fires:
        the symptom becomes active when it is crossed again ``hold`` after it first was. A
        symptom not crossed again within ``hold`` is forgotten, so one dip before a quiet night
        and one after it are not a held symptom. With ``load`` (the window's), a lighter window
        (under SAME_LOAD_SHARE of the lightest load it was crossed at) does not show a pending
        symptom gone: bursty traffic's light minutes are no evidence against a slowdown seen
        at its heavy ones. They count once it is crossed at a load that light: if one showed
        it gone there, it starts over. An active one is cleared as before: the run stays due
        for its cause (``Due``), which recovers only under comparable load."""
        seen_at = None if self.active else self.load
        lighter = seen_at is not None and load is not None and load < seen_at * SAME_LOAD_SHARE
        if leaving and not lighter:
            return Hysteresis()
        if self.active:
            return self
        if not entering:
            if self.last_entering is not None and now - self.last_entering > hold:
                return Hysteresis()
            if leaving and load is not None:  # (lighter, so load is known) kept for later
                return replace(self, cleared=max(self.cleared or 0.0, load))
            return self
        # Not crossed within the hold, or crossed at a load it was seen gone at since: it
        # starts over from this crossing.
        starts_over = (self.last_entering is not None and now - self.last_entering > hold) or (
            load is not None and self.cleared is not None and self.cleared >= load * SAME_LOAD_SHARE
        )
        since = self.pending_since if self.pending_since is not None and not starts_over else now
        loads = [x for x in (None if starts_over else self.load, load) if x is not None]
        lightest = min(loads) if loads else None
        if now - since >= hold:
            return Hysteresis(True, since, now, now, lightest)
        cleared = None if starts_over else self.cleared
        return Hysteresis(False, since, None, now, lightest, cleared)

    def held_for(self, now: float) -> float:
        return 0.0 if self.pending_since is None else now - self.pending_since

    def to_json(self) -> dict[str, Any]:
        return {
            "active": self.active,
            "pending_since": self.pending_since,
            "active_since": self.active_since,
            "last_entering": self.last_entering,
            "load": self.load,
            "cleared": self.cleared,
        }

    @classmethod
    def from_json(cls, data: Any) -> Hysteresis:
        return cls(
            bool(data["active"]),
            optional_float(data["pending_since"]),
            optional_float(data["active_since"]),
            optional_float(data.get("last_entering")),
            optional_float(data.get("load")),  # these two absent in state saved before them
            optional_float(data.get("cleared")),
        )
