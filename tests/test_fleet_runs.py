"""What the hosts of a fleet group learn from each other, against a real etcd: a host's cured
runs and flag trials read back by its peers, a peer's garbage refused by name and kept out,
etcd down."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tests.etcd import Etcd
from tests.httpserver import free_port
from tests.test_fleet import (  # noqa: F401 - the `etcd` fixture
    Recorded,
    daemon_with_fleet,
    etcd_fixture,
    fleet_of,
)
from tests.test_prevention import cured, declining
from vkvagent.actuation.actuator import Plan
from vkvagent.adapters.fleet import RETRY_AFTER, FleetError
from vkvagent.adapters.fleet_flags import FleetTrials
from vkvagent.adapters.fleet_peers import READ_EVERY
from vkvagent.adapters.fleet_runs import FleetRuns, parse
from vkvagent.engine.baseline import Baseline, BaselineSettings, Regime
from vkvagent.engine.prevention import Track
from vkvagent.knowledge.reconcile import UNASKED, FlagState, Trial
from vkvagent.service.flag_loop import FlagLoop, FlagsDue, held_words

pytestmark = pytest.mark.fleet
SETTINGS = BaselineSettings()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def runs_of(
    etcd: Etcd, host: str, clock: Clock | None = None, group: str = "runs"
) -> tuple[FleetRuns, Recorded]:
    events = Recorded()
    return FleetRuns(fleet_of(etcd.url, group, name=host), events, clock or Clock()), events


def test_a_hosts_cured_runs_reach_its_peers_and_garbage_is_refused_by_name(etcd: Etcd) -> None:
    tracks = (cured(declining("a-1")), cured(declining("a-2", seed=2)), declining("a-3"))
    a, _ = runs_of(etcd, "gpu-a")
    a.share("s", tracks, None, SETTINGS)  # the run in progress (not cured) stays home
    clock = Clock()
    b, said = runs_of(etcd, "gpu-b", clock)
    b.share("s", (cured(declining("b-1", seed=3)),), None, SETTINGS)
    assert b.learned("s").runs == tracks[:2]  # gpu-a's, not its own
    assert b.learned("another server").runs == ()

    # A peer's garbage: refused with an event naming it, once; the others still count.
    raw = fleet_of(etcd.url, "runs").client
    raw.put(f"{b.prefix('s')}gpu-x", "{", "0")
    liar = {"schema": 1, "host": "gpu-y", "server": "s",
            "runs": [Track(run="y", server="s", cured=False).to_json()]}  # fmt: skip
    raw.put(f"{b.prefix('s')}gpu-y", json.dumps(liar), "0")
    assert b.learned("s").runs == tracks[:2]  # read again only every READ_EVERY
    clock.now += READ_EVERY
    assert b.learned("s").runs == tracks[:2]
    clock.now += READ_EVERY
    b.learned("s")
    refused = [
        (f["peer"], f["error"]) for name, _m, f in said.events if name == "fleet.peer_refused"
    ]
    assert refused == [
        ("gpu-x", "not JSON"), ("gpu-y", "a run that is not a cured one of this server")
    ]  # fmt: skip

    # etcd down: what was last read stands, and etcd is not asked again for a minute.
    etcd.stop()
    try:
        clock.now += READ_EVERY
        assert b.learned("s").runs == tracks[:2]
    finally:
        etcd.start()
    a.share("s", (*tracks[:2], cured(declining("a-3", seed=4))), None, SETTINGS)
    clock.now += RETRY_AFTER / 2
    assert b.learned("s").runs == tracks[:2]
    clock.now += RETRY_AFTER / 2
    assert len(b.learned("s").runs) == 3


@pytest.mark.parametrize(
    ("document", "refusal"),
    [
        (
            {"schema": 2, "host": "p", "server": "s", "runs": []},
            r"schema 2: newer than this vkvagent reads \(1\)",
        ),
        ({"schema": "1", "host": "p", "server": "s", "runs": []}, "schema .1.: expected 1"),
        ({"schema": 1, "host": "q", "server": "s", "runs": []}, "another host or server"),
        ({"schema": 1, "host": "p", "server": "t", "runs": []}, "another host or server"),
        ({"schema": 1, "host": "p", "server": "s", "runs": {}}, "runs: expected a list"),
        ({"schema": 1, "host": "p", "server": "s", "runs": [{"run": 1}]}, "track: KeyError"),
        ({"schema": 1, "host": "p", "server": "s", "runs": ["x" * 40000]}, "over the 32768"),
    ],
)
def test_what_is_not_a_peers_runs_is_refused_saying_why(
    document: dict[str, object], refusal: str
) -> None:
    with pytest.raises(ValueError, match=refusal):
        parse("p", "s", json.dumps(document))


def test_a_daemon_plans_from_its_peers_runs_then_shares_its_own(etcd: Etcd, tmp_path: Path) -> None:
    peer, _ = runs_of(etcd, "gpu-peer", group="learning")
    hour_ago = time.time() - 3600  # the daemon plans on the wall clock: runs of this week
    theirs = tuple(cured(declining(f"p-{i}", seed=i), ended_at=hour_ago) for i in (1, 2))
    peer.share("s", theirs, None, SETTINGS)
    daemon, _stream = daemon_with_fleet(tmp_path, etcd.url, group="learning")
    try:
        # A new host of server "s": a baseline, no run of its own yet.
        daemon.state = replace(daemon.state, baseline=Baseline(run="r", server="s"))
        daemon.tick()
        assert daemon.state.plan is not None and daemon.state.plan.peers == 2
        # Its first cured run: shared with the group, and its own plan from then on.
        mine = cured(declining("mine", onset_h=8.0), ended_at=hour_ago)
        daemon.state = replace(daemon.state, past=(mine,), planned_at=None)
        daemon.tick()
        assert daemon.state.plan is not None and daemon.state.plan.peers == 0
        later = Clock()
        later.now += READ_EVERY
        other, _ = runs_of(etcd, "gpu-other", later, group="learning")
        assert other.learned("s").runs == (mine, *theirs)  # by host: gpu-here, gpu-peer
    finally:
        daemon.close()


def test_a_hosts_flag_trials_reach_its_peers_and_garbage_is_refused_by_name(etcd: Etcd) -> None:
    a = FleetTrials(fleet_of(etcd.url, "trials", name="gpu-a"), Recorded(), Clock())
    trying = Trial("gpu-a", "k", "s0", "trying", 1000.0)
    a.share([trying])
    clock, said = Clock(), Recorded()
    b = FleetTrials(fleet_of(etcd.url, "trials", name="gpu-b"), said, clock)
    b.share([Trial("gpu-b", "k", "s0", "trying", 1000.0)])
    assert b.learned() == (trying,)  # gpu-a's, not its own
    # The verdict replaces the trial; a host with nothing to tell withdraws what it said.
    rejected = Trial("gpu-a", "k", "s0", "rejected", None, "slower: 0.80 (action 3)")
    a.share([rejected])
    clock.now += READ_EVERY
    assert b.learned() == (rejected,)
    # Its lease gone (etcd heard nothing from it for a lease's time): the keys went with it,
    # and once the host has a lease again (its entry's next publish), they are put again.
    raw = fleet_of(etcd.url, "trials").client
    raw.revoke(a.fleet.own_lease or "")
    assert raw.range_prefix(a.prefix + "gpu-a") == []
    a.fleet.put_own(f"{a.fleet.prefix}hosts/gpu-a", "{}", 60)
    a.share([rejected])
    assert [kv["key"] for kv in raw.range_prefix(a.prefix + "gpu-a")] == [a.prefix + "gpu-a"]
    a.share([])
    # A host that never tried a set writes nothing.
    quiet = FleetTrials(fleet_of(etcd.url, "trials", name="gpu-q"), Recorded(), Clock())
    quiet.share([])
    assert raw.range_prefix(a.prefix + "gpu-q") == []
    raw.put(f"{b.prefix}gpu-x", json.dumps({"schema": 1, "host": "gpu-x", "trials": [{}]}), "0")
    raw.put(f"{b.prefix}gpu-y", json.dumps({"schema": 1, "host": "gpu-a", "trials": []}), "0")
    clock.now += READ_EVERY
    assert b.learned() == ()
    refused = [(f["peer"], f["error"]) for n, _m, f in said.events if n == "fleet.peer_refused"]
    assert refused == [("gpu-x", "trial: KeyError: 'key'"), ("gpu-y", "it names another host")]


def regimes(**per_regime: tuple[int, float]) -> dict[int, Regime]:
    """Regimes by key ``r<key>``: (windows kept, mean ITL of each)."""
    return {
        int(key[1:]): Regime(count, {"itl": (itl,) * count, "per_request": (50.0,) * count})
        for key, (count, itl) in per_regime.items()
    }


def test_a_hosts_fresh_baseline_reaches_its_peers_by_its_known_loads(etcd: Etcd) -> None:
    """A run's fresh baseline goes out with its known loads' medians, again only when it
    knows another load; a late one stays home; one of another server is refused."""
    a, _ = runs_of(etcd, "gpu-a", group="baselines")
    clock = Clock()
    b, said = runs_of(etcd, "gpu-b", clock, group="baselines")
    raw = fleet_of(etcd.url, "baselines").client

    def revision() -> int:
        return int(raw.call("kv/range", {"key": "eA=="})["header"]["revision"])

    fresh = Baseline(run="start:1", regimes=regimes(r11=(12, 0.02), r13=(4, 0.03)),
                     server="s", busy_from=900.0, last_added=5.0)  # fmt: skip
    a.share("s", (), fresh, SETTINGS)
    (theirs,) = b.learned("s").baselines
    assert theirs.run == "start:1@gpu-a" and theirs.server == "s"
    assert theirs.known_keys(SETTINGS) == [11] and 13 not in theirs.regimes  # r13: unknown
    assert theirs.regimes[11].median("itl") == 0.02 and theirs.regimes[11].count == 12
    # More windows at the loads it knows: nothing put.
    before = revision()
    a.share("s", (), replace(fresh, regimes=regimes(r11=(20, 0.021), r13=(6, 0.03))), SETTINGS)
    assert revision() == before
    # Another load known: put.
    a.share("s", (), replace(fresh, regimes=regimes(r11=(20, 0.021), r13=(10, 0.03))), SETTINGS)
    clock.now += READ_EVERY
    (theirs,) = b.learned("s").baselines
    assert theirs.known_keys(SETTINGS) == [11, 13]
    # Restarted, its new run knowing no load yet: the last fresh one stays with its runs.
    young = Baseline(run="start:2", regimes=regimes(r11=(2, 0.02)), server="s", busy_from=900.0)
    a.share("s", (cured(replace(declining("a-1"), server="s")),), young, SETTINGS)
    clock.now += READ_EVERY
    learned = b.learned("s")
    assert len(learned.runs) == 1 and [x.run for x in learned.baselines] == ["start:1@gpu-a"]
    # Learned late (it may hold a slowness), or of another server: not shared.
    c, _ = runs_of(etcd, "gpu-c", group="baselines")
    c.share("s", (), replace(fresh, busy_from=SETTINGS.learn_within + 1), SETTINGS)
    c.share("s", (), replace(fresh, server="t"), SETTINGS)
    clock.now += READ_EVERY
    assert [x.run for x in b.learned("s").baselines] == ["start:1@gpu-a"]
    liar = {"schema": 1, "host": "gpu-y", "server": "s", "runs": [],
            "baseline": replace(fresh, server="t").to_json()}  # fmt: skip
    raw.put(f"{b.prefix('s')}gpu-y", json.dumps(liar), "0")
    clock.now += READ_EVERY
    assert len(b.learned("s").baselines) == 1
    refused = [(f["peer"], f["error"]) for n, _m, f in said.events if n == "fleet.peer_refused"]
    assert refused == [("gpu-y", "a baseline of another server")]


PLAN = Plan(unit="vllm.service", before=(), after=(), flags={"max-num-seqs": 20},
            attestable=(), changed=True, changes={"max-num-seqs": 20})  # fmt: skip
DUE = FlagsDue("apply", "apply --max-num-seqs 20", PLAN, "k")


def test_of_two_hosts_about_to_apply_a_set_the_first_to_announce_goes(etcd: Etcd) -> None:
    """Just before a restart that carries [vllm.flags], a host reads its peers' trials
    afresh and says it is trying the set (``FlagLoop.announce``): the second host holds it
    back, whatever its cached read said, and whatever its clock says. It tells nothing."""
    hosts = {name: FleetTrials(fleet_of(etcd.url, "announce", name=name), Recorded(), Clock())
             for name in ("gpu-a", "gpu-b")}  # fmt: skip
    loops = {name: FlagLoop(FlagState(), Recorded()) for name in hosts}
    assert hosts["gpu-a"].learned() == ()  # cached: nothing yet
    assert loops["gpu-b"].announce(hosts["gpu-b"], DUE, "s0", 1000.0) is DUE
    # gpu-a's clock is behind, and its name sorts first: it still comes second.
    assert loops["gpu-a"].announce(hosts["gpu-a"], DUE, "s0", 999.0) is None
    held = loops["gpu-a"].held
    assert held is not None and (held.host, held.state, held.since) == ("gpu-b", "trying", 1000.0)
    raw = fleet_of(etcd.url, "announce").client
    said = {kv["key"].rsplit("/", 1)[1]: json.loads(kv["value"])["trials"]
            for kv in raw.range_prefix(hosts["gpu-a"].prefix)}  # fmt: skip
    assert said == {"gpu-b": [Trial("gpu-b", "k", "s0", "trying", 1000.0).to_json()]}
    assert raw.range_prefix(hosts["gpu-a"].fleet.prefix + "flag-turns/") == []  # let go
    # A rollback is not announced: it puts back what ran before.
    back = FlagsDue("rollback", "roll back", PLAN, "k")
    assert loops["gpu-a"].announce(hosts["gpu-a"], back, "s0", 1002.0) is back


def test_of_hosts_announcing_a_set_at_once_one_goes(etcd: Etcd) -> None:
    """Eight hosts announce the same set at the same moment, each in a thread of its own:
    the set's turn lets exactly one go, whichever gets it first; the others are held back by
    its trial, or by whichever host had the turn when they asked. Only its trial is told."""
    names = [f"gpu-{i}" for i in range(8)]
    hosts = {n: FleetTrials(fleet_of(etcd.url, "at-once", name=n), Recorded(), Clock())
             for n in names}  # fmt: skip
    loops = {n: FlagLoop(FlagState(), Recorded()) for n in names}
    ready = threading.Barrier(len(names))

    def announce(name: str) -> FlagsDue | None:
        ready.wait()
        return loops[name].announce(hosts[name], DUE, "s0", 1000.0)

    with ThreadPoolExecutor(len(names)) as pool:
        went = dict(zip(names, pool.map(announce, names)))
    (first,) = [n for n, due in went.items() if due is DUE]
    assert all(loops[n].held is not None for n in names if n != first)
    raw = fleet_of(etcd.url, "at-once").client
    assert [kv["key"].rsplit("/", 1)[1] for kv in raw.range_prefix(hosts[first].prefix)] == [first]
    assert raw.range_prefix(hosts[first].fleet.prefix + "flag-turns/") == []


def test_a_set_whose_turn_a_peer_holds_waits_for_it_and_etcd_not_answering_holds_it_too(
    etcd: Etcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer holding the set's turn holds it back until its lease ends; without etcd's
    answer to the turn, the read or the put, the set waits too (it is never tried untold),
    and the turn is let go."""
    fleet = fleet_of(etcd.url, "turns", name="gpu-a")
    host, loop = FleetTrials(fleet, Recorded(), Clock()), FlagLoop(FlagState(), Recorded())
    key = f"{fleet.prefix}flag-turns/s0/k"
    lease, _ttl = fleet.client.grant(60)
    assert fleet.client.create(key, json.dumps({"host": "gpu-z", "since": 990.0}), lease)
    assert loop.announce(host, DUE, "s0", 1000.0) is None
    assert loop.held == Trial("gpu-z", "k", "s0", "trying", 990.0)
    assert fleet.client.range_prefix(key)  # not its to take away
    fleet.client.revoke(lease)  # gpu-z let go (or its lease ended)
    assert loop.announce(host, DUE, "s0", 1000.0) is DUE
    assert fleet.client.range_prefix(key) == []

    def refused(*_args: object) -> None:
        raise FleetError("etcd unreachable: no answer within 0.5 s")

    other = FleetTrials(fleet_of(etcd.url, "turns-put", name="gpu-b"), Recorded(), Clock())
    monkeypatch.setattr(other.fleet.client, "put", refused)
    loop = FlagLoop(FlagState(), Recorded())
    assert loop.announce(other, DUE, "s0", 1001.0) is None  # its trial could not be told
    assert loop.held is not None and loop.held.state == UNASKED
    assert held_words(loop.held) == (
        "the group could not be asked (etcd did not answer); it waits for etcd"
    )
    assert fleet.client.range_prefix(other.fleet.prefix) == []  # the turn let go all the same
    closed = f"http://127.0.0.1:{free_port()}"
    down = FleetTrials(fleet_of(closed, "turns", name="gpu-c"), Recorded(), Clock())
    loop = FlagLoop(FlagState(), Recorded())
    assert loop.announce(down, DUE, "s0", 1000.0) is None
    assert loop.held is not None and loop.held.state == UNASKED
