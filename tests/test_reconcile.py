"""The flags loop's memory and verdicts (knowledge/reconcile.py): pure, on values. The loop in
the daemon, against a real systemd, is tests/test_flag_loop.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from vkvagent.engine.baseline import Baseline, BaselineSettings, Regime
from vkvagent.knowledge.flags import shown
from vkvagent.knowledge.reconcile import (
    TRIAL_FOR,
    Change,
    FlagState,
    Judged,
    Trial,
    change_of,
    flags_key,
    held_back,
)

SETTINGS = BaselineSettings()
BEFORE = ("vllm", "serve", "m")
APPLIED = 1000.0  # the change's action: from 1000 to 1030 (UTC seconds)


def run(name: str, speed: float | None) -> Baseline:
    if speed is None:
        return Baseline(run=name)
    n = SETTINGS.min_values
    return Baseline(run=name, regimes={24: Regime(n, {"in_system": (speed,) * n})})


def change(**values: object) -> Change:
    fields: dict[str, object] = dict(
        action=7, started=APPLIED, ended=APPLIED + 30, flags={"max-num-seqs": 20},
        key=flags_key({"max-num-seqs": 20}), before=BEFORE,
    )  # fmt: skip
    fields.update(values)
    return Change(**fields)  # type: ignore[arg-type]


def judge(
    state: FlagState, started: float | None, speed: float | None, uptime: float = 900.0
) -> tuple[FlagState, Judged | None]:
    return state.judge(
        run_started=started,
        run_uptime=uptime,
        previous=run("start:1", 100.0),
        current=run("start:2", speed),
        settings=SETTINGS,
        margin=0.10,
    )


def test_a_slower_change_is_rejected_and_due_for_rollback_once() -> None:
    state = FlagState().noticed(change())
    # The run before the change, and the new run before it learned a load in common: wait.
    assert judge(state, APPLIED - 3600, 60.0) == (state, None)
    assert judge(state, APPLIED + 20, None) == (state, None)
    judged_state, judged = judge(state, APPLIED + 20, 60.0)
    assert judged is not None and judged.comparison is not None
    last = judged_state.last
    assert last is not None
    assert (last.verdict, last.ratio, last.speed_before, last.speed_after) == (
        "worse", 0.6, 100.0, 60.0,
    )  # fmt: skip
    assert last.rollback_due
    assert judged_state.rejected[last.key].startswith("slower: 0.60 of the previous flags'")
    # Judged once; the rollback's outcome is kept and ends what is due.
    assert judge(judged_state, APPLIED + 20, 10.0) == (judged_state, None)
    done = judged_state.rolled_back("done (action 8)")
    assert done.last is not None and not done.last.rollback_due
    # An older action is not taken for a newer change.
    assert done.noticed(change(action=3)) is done


@pytest.mark.parametrize(("speed", "verdict"), [(95.0, "same"), (120.0, "better")])
def test_a_change_that_is_not_slower_stays(speed: float, verdict: str) -> None:
    state, judged = judge(FlagState().noticed(change()), APPLIED + 20, speed)
    assert judged is not None and state.last is not None
    assert state.last.verdict == verdict and not state.last.rollback_due and not state.rejected


def test_too_little_comparable_load_is_no_verdict_never_a_rollback() -> None:
    state = FlagState().noticed(change())
    # The new run never served a load: it could learn as fresh until learn_within.
    fresh_until = SETTINGS.learn_within + SETTINGS.window
    assert judge(state, APPLIED + 20, None, uptime=fresh_until - 1) == (state, None)
    ended, judged = judge(state, APPLIED + 20, None, uptime=fresh_until + 1)
    assert judged is not None and judged.why == "no load both runs served while fresh"
    assert ended.last is not None and ended.last.verdict == "no verdict"
    assert not ended.last.rollback_due and not ended.rejected
    # A run begun after the change's own (a crash, another restart) cannot speak for it.
    later, judged = judge(state, APPLIED + 600, 10.0)
    assert judged is not None and later.last is not None and later.last.verdict == "no verdict"


def test_a_change_is_judged_only_against_the_run_just_before_it() -> None:
    # The run before the change learned nothing while fresh: the engine's previous run is an
    # older one, of other flags, and says nothing about this change.
    state = FlagState().noticed(change(previous_run="start:0"))
    ended, judged = judge(state, APPLIED + 20, 60.0)
    assert judged is not None and judged.why == "the run before it learned no load while fresh"
    assert ended.last is not None and ended.last.verdict == "no verdict" and not ended.rejected
    # The run just before it ("start:1" in judge()) is the one compared with.
    assert judge(FlagState().noticed(change(previous_run="start:1")), APPLIED + 20, 60.0)[1]


def test_a_rejection_lasts_until_the_config_asks_for_another_set() -> None:
    state = FlagState().reject("slow", "slower: 0.6").reject("broken", "did not start")
    assert state.desired("slow").rejected == {"slow": "slower: 0.6"}
    assert state.desired("slow").desired("slow") == state.desired("slow")
    assert state.desired("new").rejected == {}


def test_a_host_tells_its_group_the_set_it_tries_then_the_set_it_rejected() -> None:
    """What a host publishes (adapters/fleet_flags.py): the set its run is trying, from the
    server of the run before it, until the verdict; then a rejection, from that server."""
    state = FlagState().noticed(change(server_before="s0"))
    key = flags_key({"max-num-seqs": 20})
    assert state.trials("gpu-a") == [Trial("gpu-a", key, "s0", "trying", APPLIED + 30)]
    judged, _ = judge(state, APPLIED + 20, 60.0)
    (rejected,) = judged.trials("gpu-a")
    assert (rejected.key, rejected.server, rejected.state) == (key, "s0", "rejected")
    assert rejected.since is None and rejected.why.startswith("slower: 0.60")
    same, _ = judge(state, APPLIED + 20, 100.0)
    assert same.trials("gpu-a") == []  # kept: nothing to tell
    # A set vLLM did not start with: from the server it was tried from; one whose server is
    # not known (rejected before the fleet knew servers) stays home. Both survive engine.json.
    broken = FlagState().reject("k2", "vLLM did not start or run with them (action 9): x", "s0")
    broken = broken.reject("k3", "did not start")
    assert [(t.key, t.server) for t in broken.trials("gpu-a")] == [("k2", "s0")]
    assert FlagState.from_json(json.loads(json.dumps(broken.to_json()))) == broken
    assert broken.desired("k2").origins == {"k2": "s0"}
    # Round trip, and what is not a trial: a time that is not one included.
    assert Trial.from_json("gpu-a", json.loads(json.dumps(rejected.to_json()))) == rejected
    trying = Trial("gpu-a", "k", "s0", "trying", 1000.0).to_json()
    for bad in ({"key": "k"}, {**rejected.to_json(), "state": "liked"},
                {**rejected.to_json(), "since": 5.0}, "x", {**trying, "since": 1e12},
                {**trying, "since": float("inf")}, {**trying, "since": -1.0}):  # fmt: skip
        with pytest.raises(ValueError, match="trial: "):
            Trial.from_json("gpu-a", bad)


def test_a_peers_trial_holds_the_same_set_from_the_same_server_back() -> None:
    now = 10 * TRIAL_FOR
    trying = Trial("gpu-a", "k", "s0", "trying", now - 3600)
    rejected = Trial("gpu-b", "k", "s0", "rejected", None, "slower: 0.80")
    assert held_back([trying], "k", "s0", now) == trying
    assert held_back([trying, rejected], "k", "s0", now) == rejected  # the rejection first
    assert held_back([trying, rejected], "other set", "s0", now) is None
    # From another server (another vLLM, model, cache or flags): it says nothing here.
    assert held_back([trying, rejected], "k", "s1", now) is None
    # A trial with no verdict after TRIAL_FOR holds nothing (its host stalled), nor one dated
    # further ahead (a lie); one from a clock ahead of this host's does.
    assert held_back([trying], "k", "s0", now + TRIAL_FOR) is None
    assert held_back([replace(trying, since=now + TRIAL_FOR)], "k", "s0", now) is None
    assert held_back([replace(trying, since=now + 90)], "k", "s0", now) is not None


def test_the_ledger_says_which_actions_changed_flags() -> None:
    drain = frozenset({"shutdown-timeout"})
    detail = {
        "flags": {"max-num-seqs": 20, "shutdown-timeout": 120},
        "changes": {"max-num-seqs": 20, "shutdown-timeout": 120},
        "before": list(BEFORE),
    }
    found = change_of(7, APPLIED, APPLIED + 30, detail, drain)
    assert found == change()
    # The drain's flag alone (a plain restart's), a rollback's empty change, an open action.
    only_drain = {"flags": {"shutdown-timeout": 120}, "changes": {"shutdown-timeout": 120}}
    assert change_of(8, APPLIED, APPLIED + 30, only_drain, drain) is None
    assert change_of(9, APPLIED, APPLIED + 30, {"flags": {}, "changes": {}}, drain) is None
    assert change_of(10, APPLIED, None, detail, drain) is None
    assert shown({"max-num-seqs": 20, "enable-prefix-caching": False}) == (
        "--max-num-seqs 20 --no-enable-prefix-caching"
    )


def test_the_state_survives_engine_json_and_refuses_garbage() -> None:
    state, _ = judge(FlagState().noticed(change()), APPLIED + 20, 60.0)
    state = state.rolled_back("done (action 8)")
    assert FlagState.from_json(json.loads(json.dumps(state.to_json()))) == state
    assert FlagState.from_json(None) == FlagState()  # a state written before the loop
    bad: object
    for bad in ({"last": {"action": 1}}, {"last": None}, {"last": dict(state.to_json()["last"],
                verdict="fine"), "rejected": {}}, []):  # fmt: skip
        with pytest.raises(ValueError, match=r"^flag state: "):
            FlagState.from_json(bad)
