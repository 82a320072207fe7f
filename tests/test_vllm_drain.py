"""Restarting the real vLLM 0.32 (CPU build, tests/realvllm.py) as vllm.service under a real
systemd 252 (tests/sandbox.py) while clients stream completions, with vkvagent's drain:

- the first restart gives vLLM its own graceful shutdown: ``--shutdown-timeout`` in vkvagent's
  drop-in, with ``TimeoutStopSec=`` above it and ``KillMode=mixed``;
- from then on a restart lets the requests its engine holds finish (checked on the client
  side, with the stop timed to come while the engine holds a stream), and the ledger and the
  output say what it cost: 0 cut off by vLLM's count, the drain's and the outage's seconds;
- with a ``pre_stop`` hook that takes the host out of rotation (the clients stop sending) and a
  ``post_ready`` that puts it back, no request fails at all;
- ``--no-drain`` cuts the requests in flight off, and says how many;
- a failing ``pre_stop`` leaves vLLM untouched.

One container for the module; the tests run in file order and each leaves vLLM serving. About
5 minutes in all (each restart costs a 40 s vLLM start)."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest

from tests.realvllm import (
    START_TIMEOUT,
    VERSION,
    Streams,
    vllm_box_fixture,  # noqa: F401 - the `vllm_box` fixture
    wait_until,
)
from tests.sandbox import Sandbox
from tests.test_actuator import CONFIG, DROPIN, actions, output, running_argv, unit, vkvagent

pytestmark = [pytest.mark.vllm, pytest.mark.systemd]

DRAIN = 30  # [restart] drain_timeout: vLLM's --shutdown-timeout
COMMAND_TIMEOUT = 3 * START_TIMEOUT
MARK = "/var/lib/lb/out"  # what the hooks below make of "out of the load balancer's rotation"


def configure(box: Sandbox, *restart: str) -> None:
    """vkvagent's config in the container, with the drain's defaults and ``restart``'s lines
    added to [restart]."""
    file = box.root / CONFIG.lstrip("/")
    file.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    file.write_text(
        "[agent]\n"
        'state_dir = "/var/lib/vkvagent"\n'
        "[vllm]\n"
        'url = "http://127.0.0.1:8000"\n'
        "[gpu]\n"
        "enabled = false\n"
        "[restart]\n"
        f"drain_timeout = {DRAIN}\n"
        f"ready_timeout = {START_TIMEOUT:g}\n"
        f"job_timeout = {START_TIMEOUT:g}\n" + "".join(f"{line}\n" for line in restart)
    )
    file.chmod(0o644)


def restart(box: Sandbox, *args: str) -> tuple[str, dict[str, Any]]:
    """``vkvagent restart ARGS``: its output, and the costs the ledger recorded."""
    done = vkvagent(box, "restart", "--reason", "test", *args, timeout=COMMAND_TIMEOUT)
    assert done.returncode == 0, output(done)
    costs = actions(box)[-1].detail["costs"]
    assert isinstance(costs, dict)
    return done.stdout, costs


def stop_requested(box: Sandbox) -> float:
    """When the last action asked systemd for the restart (wall clock)."""
    action = actions(box)[-1]
    return next(s.at for s in action.steps if (s.step, s.state) == ("restart", "begin"))


def test_the_first_restart_gives_vllm_its_own_graceful_shutdown(vllm_box: Sandbox) -> None:
    configure(vllm_box)
    said, costs = restart(vllm_box)
    # It could not drain by itself yet: a wait for a quiet moment (no traffic here).
    assert costs["drain_mode"] == "quiet", said
    action = actions(vllm_box)[-1]
    assert action.kind == "apply"
    assert action.detail["changes"] == {"shutdown-timeout": DRAIN}
    text = (vllm_box.root / DROPIN).read_text()
    assert f"--shutdown-timeout {DRAIN}" in text
    assert f"\nTimeoutStopSec={DRAIN + 30}\nKillMode=mixed\n" in text
    shown = vllm_box.run("systemctl", "show", "-P", "TimeoutStopUSec", "vllm.service").stdout
    assert shown.strip() == "1min"
    shown = vllm_box.run("systemctl", "show", "-P", "KillMode", "vllm.service").stdout
    assert shown.strip() == "mixed"
    argv = running_argv(vllm_box)
    assert argv[argv.index("--shutdown-timeout") + 1] == str(DRAIN)

    # Applied once: the next plan changes nothing.
    planned = vkvagent(vllm_box, "plan")
    assert "the unit needs no change" in planned.stdout, output(planned)


def running(box: Sandbox) -> float:
    """vLLM's ``num_requests_running`` gauge: the requests its engine holds."""
    _status, page = box.http_get(8000, "/metrics")
    found = re.search(rb"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", page, re.MULTILINE)
    assert found, "vLLM's /metrics has no num_requests_running"
    return float(found.group(1))


ASKED, GO = "/var/lib/lb/asked", "/var/lib/lb/go"  # the pre_stop hook's and the test's marks
# A pre_stop hook that holds the restart until the test lets it go.
HOLD = ["/bin/sh", "-c", f"touch {ASKED}; while [ ! -e {GO} ]; do sleep 0.01; done"]
YOUNG_WAIT = 60.0  # s the test waits for a young stream before it lets the restart go anyway
# [restart]'s lines for that hook, with a timeout above the wait: a premise missed lets the
# restart go and is tried again, where vkvagent's 60 s default would kill the hook and abort.
HELD = (f"pre_stop = {json.dumps(HOLD)}", f"hook_timeout = {2 * YOUNG_WAIT:g}")
# The most restarts tried to meet the drain tests' premise (about 80 s each).
ATTEMPTS = 5
YOUNG = 0.3  # s since a stream's first token: most of its answer (about 1.4 s) still ahead


def restart_when_the_engine_holds_a_young_stream(
    box: Sandbox,
    clients: int,
    act: Callable[[Sandbox], tuple[str, dict[str, Any]]] = restart,
) -> tuple[str, dict[str, Any], Streams, float | None, float]:
    """A restart (``act``: ``vkvagent restart`` by default) under ``clients`` streaming
    clients, let go by the ``pre_stop`` hook (HOLD) when the engine runs every client's
    request and the longest answer's first token came at most YOUNG s ago: the output, the
    costs, the streams, when that young stream began (None when none came within a minute:
    the restart was let go anyway, a premise missed) and when the test let the restart go.

    The age counts from the first token, not from the client's start: on a starved host the
    API server may take longer than YOUNG to hand a request to the engine."""
    box.run("rm", "-f", ASKED, GO)
    young: list[float] = []

    def engine_holds_a_young_stream() -> bool:
        now = time.time()
        young[:] = [t for t, token in streams.flowing(client=0).items() if now - token <= YOUNG]
        return bool(young) and running(box) >= clients

    with Streams(box, clients=clients, max_tokens=500) as streams:
        wait_until(lambda: streams.count("ok") >= 6, 60, "streams before the restart")
        with ThreadPoolExecutor(1) as pool:
            restarting = pool.submit(act, box)
            asked = box.root / ASKED.lstrip("/")
            # The command starts among the CPU engine's threads, a dozen runnable on a
            # 2-CPU host while it streams: its steps before the hook took 3 to 43 s there,
            # and over 60 s once in CI. Its own limits (COMMAND_TIMEOUT) bound the wait.
            wait_until(
                lambda: asked.exists() or restarting.done(), COMMAND_TIMEOUT, "the pre_stop hook"
            )
            if not asked.exists():  # the restart ended before its hook: its own failure
                raise AssertionError(f"no pre_stop hook ran: {restarting.result()}")
            try:
                wait_until(
                    engine_holds_a_young_stream, YOUNG_WAIT, "a young stream in the engine", 0.01
                )
            except AssertionError as missed:
                print(f"\n{missed}; clients: {streams.outcomes()}")
                young.clear()
            finally:
                (box.root / GO.lstrip("/")).touch()
                let_go = time.time()
            said, costs = restarting.result(timeout=COMMAND_TIMEOUT)
        served = streams.count("ok")
        wait_until(lambda: streams.count("ok") >= served + 3, 60, "streams after the restart")
    return said, costs, streams, (young[0] if young else None), let_go


def under_way_at_the_stop(
    streams: Streams, young: float | None, stop: float, costs: dict[str, Any]
) -> bool:
    """The premise of a drain test: the young stream the restart was let go for was still
    under way when the stop was asked for, and vkvagent's look just before it counted at
    least one request in flight. An attempt that misses it is tried again only after
    ``nothing_cut_off`` held for it: a retry never hides a stream cut short."""
    counted = costs["in_flight"] is not None and costs["in_flight"] >= 1
    return counted and any(s.started == young and s.ended > stop for s in streams.streams)


def nothing_cut_off(
    streams: Streams, young: float | None, costs: dict[str, Any], said: str
) -> None:
    """What every drained attempt must show, its premise met or not: vkvagent counted nothing
    cut off, and the young stream, if there was one, finished whole."""
    assert costs["aborted"] == 0, said
    if young is not None:
        held = [s.outcome for s in streams.streams if s.started == young]
        assert held == ["ok"], streams.outcomes()


def test_a_drained_restart_lets_the_streams_in_flight_finish(vllm_box: Sandbox) -> None:
    """The stop comes while vLLM's engine provably holds a stream with most of its answer
    ahead: a ``pre_stop`` hook holds the restart until the test lets it go, when the engine
    holds a young stream. Left to chance, the stop can come in the instant the clients send
    their next requests, taken by the API server but not yet by the engine, which vLLM's drain
    does not wait for (docs/operations.md, Draining): that is what the product cannot promise,
    and this test does not ask it.

    The longest answers (500 tokens) stream for about 1.4 s here, and the one let go for began
    at most 0.3 s before, so the stop must follow the release within about a second. On a
    loaded host the stop can come later than that, after the young
    stream ended (vkvagent's scrape then finds the engine between requests, or at another
    stream): then the premise was missed, not the promise, and the restart is tried again, up
    to ATTEMPTS times in all."""
    vllm_box.run("mkdir", "-p", "/var/lib/lb")
    configure(vllm_box, *HELD)
    for attempt in range(1, ATTEMPTS + 1):
        said, costs, streams, young, let_go = restart_when_the_engine_holds_a_young_stream(
            vllm_box, clients=3
        )
        stop = stop_requested(vllm_box)
        begun = [(s.outcome, round(stop - s.started, 2)) for s in streams.spanning(stop)]
        print(
            f"\nreal vLLM {VERSION}, a restart drained by its --shutdown-timeout under 3 "
            f"streaming clients (attempt {attempt}, the stop {stop - let_go:.2f} s after the "
            f"release): {json.dumps(costs)}; clients: {streams.outcomes()}; in flight at the "
            f"stop (outcome, seconds under way): {begun}"
        )
        nothing_cut_off(streams, young, costs, said)
        if under_way_at_the_stop(streams, young, stop, costs):
            break
    assert costs["drain_mode"] == "vllm", said
    assert costs["in_flight"] is not None and costs["in_flight"] >= 1, said
    assert costs["aborted"] == 0, said
    assert costs["drain_seconds"] is not None and 0 < costs["drain_seconds"] <= DRAIN
    assert costs["down_seconds"] > costs["drain_seconds"]
    assert re.search(r"drained by vLLM in [0-9.]+ s, 0 of [1-9][0-9]* in flight cut off", said)
    # The stream the engine held when the stop was asked for finished whole (without the
    # drain it is cut: a later test); those sent after the stop were turned away.
    held = [s for s in streams.streams if s.started == young]
    assert [(s.outcome, s.ended > stop) for s in held] == [("ok", True)], begun


def test_with_a_pre_stop_hook_that_stops_the_clients_no_request_fails(vllm_box: Sandbox) -> None:
    env_file = "/var/lib/lb/env"
    vllm_box.run("mkdir", "-p", "/var/lib/lb")
    # Out of rotation, then a second for the requests already routed here to arrive (a
    # balancer's deregistration delay) before vLLM stops admitting.
    pre_stop = [
        "/bin/sh", "-c",
        f'echo "$VKVAGENT_HOOK $VKVAGENT_UNIT $VKVAGENT_CAUSE $VKVAGENT_ACTION" > {env_file}; '
        f"touch {MARK}; sleep 1; echo out of rotation",
    ]  # fmt: skip
    post_ready = ["/bin/rm", "-f", MARK]
    configure(
        vllm_box, f"pre_stop = {json.dumps(pre_stop)}", f"post_ready = {json.dumps(post_ready)}"
    )
    marker = vllm_box.root / MARK.lstrip("/")
    with Streams(vllm_box, clients=3, paused=marker.exists) as streams:
        wait_until(lambda: streams.count("ok") >= 6, 60, "streams before the restart")
        said, costs = restart(vllm_box)
        served = streams.count("ok")
        wait_until(lambda: streams.count("ok") >= served + 3, 60, "streams after the restart")
    print(f"\nwith pre_stop and post_ready: {json.dumps(costs)}; clients: {streams.outcomes()}")
    assert set(streams.outcomes()) == {"ok"}, streams.outcomes()
    assert not marker.exists()  # post_ready put the host back
    action = actions(vllm_box)[-1]
    hooks = {hook["name"]: hook for hook in action.detail["hooks"]}
    assert hooks["pre_stop"]["status"] == 0 and hooks["post_ready"]["status"] == 0
    assert hooks["pre_stop"]["output"] == "out of rotation\n"
    said_env = (vllm_box.root / env_file.lstrip("/")).read_text()
    assert said_env == f"pre_stop vllm.service manual {action.id}\n"
    assert costs["aborted"] == 0, said


def test_without_the_drain_the_requests_cut_off_are_counted(vllm_box: Sandbox) -> None:
    """``--no-drain`` kills a vLLM that would drain. The requests in flight fail, and the
    ledger counts those vLLM's engine held: its gauges miss a response the API server is
    still streaming after the engine finished it (a second or two on this 2-core host), so
    the client's count is the truth the figures are printed against.

    The premise is a request in flight at the kill. Once in CI the four clients were all
    between requests (connections refused around the stop, vkvagent counting 0 in flight,
    consistently): then nothing could be cut off, and the restart is tried again, up to
    ATTEMPTS times in all, each attempt's count checked first."""
    configure(vllm_box)
    before = unit(vllm_box)
    for attempt in range(1, ATTEMPTS + 1):
        with Streams(vllm_box, clients=4) as streams:
            wait_until(lambda s=streams: s.count("ok") >= 8, 60, "streams before the restart")
            said, costs = restart(vllm_box, "--no-drain")
            served = streams.count("ok")
            after_restart = served + 3
            wait_until(
                lambda s=streams, n=after_restart: s.count("ok") >= n,
                60,
                "streams after the restart",
            )
        spanning = streams.spanning(stop_requested(vllm_box))
        # systemd's SIGKILL may come seconds after the ledger's restart step began on this
        # 2-core host (once, in CI, every stream begun before that moment had finished by
        # then): what the kill broke is counted from the step on.
        failed = streams.broken_since(stop_requested(vllm_box))
        print(
            f"\n--no-drain under 4 streaming clients (attempt {attempt}): {json.dumps(costs)}; "
            f"clients: {streams.outcomes()}; in flight at the stop: "
            f"{[s.outcome for s in spanning]}"
        )
        assert costs["drain_mode"] == "none"
        assert costs["aborted"] == costs["in_flight"] is not None, said
        assert re.search(r"not drained, [0-9]+ of [0-9]+ in flight cut off", said), said
        if failed or costs["in_flight"]:
            break
    assert failed, f"no request in flight failed: {[s.outcome for s in spanning]}"
    after = unit(vllm_box)
    assert after.invocation_id != before.invocation_id
    assert (after.active_state, after.n_restarts) == ("active", 0)


def test_a_failing_pre_stop_leaves_vllm_untouched(vllm_box: Sandbox) -> None:
    configure(vllm_box, 'pre_stop = ["/bin/sh", "-c", "echo the balancer said no; exit 3"]')
    before = unit(vllm_box)
    dropin = (vllm_box.root / DROPIN).read_text()
    done = vkvagent(vllm_box, "restart", "--reason", "test", timeout=COMMAND_TIMEOUT)
    assert done.returncode == 1, output(done)
    assert "pre_stop /bin/sh exited with status 3: the balancer said no" in done.stderr
    after = unit(vllm_box)
    assert (after.invocation_id, after.main_pid) == (before.invocation_id, before.main_pid)
    assert (vllm_box.root / DROPIN).read_text() == dropin
    action = actions(vllm_box)[-1]
    assert action.outcome == "aborted"
    assert [s.step for s in action.steps] == ["preflight", "preflight", "pre_stop", "pre_stop"]
    assert "costs" not in action.detail
    status, _ = vllm_box.http_get(8000, "/health")
    assert status == 200
    assert "Traceback" not in done.stderr
