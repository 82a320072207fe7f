"""The restart path refuses to restart onto a faulty GPU (no systemd needed to see that)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkvagent.actuation.actuator import Actuator, ActuatorError
from vkvagent.adapters.gpu import GpuReader, RecordedBackend
from vkvagent.adapters.ledger import Ledger
from vkvagent.adapters.systemd import Systemd
from vkvagent.adapters.vllm import VllmClient
from vkvagent.knowledge.dropin import DropinFile


def actuator(
    tmp_path: Path, recording: dict[str, object], reader: GpuReader | None = None
) -> Actuator:
    return Actuator(
        unit="vllm.service",
        systemd=Systemd("unix:path=/nonexistent"),  # never reached: the GPU check comes first
        ledger=Ledger(tmp_path),
        dropin=DropinFile("vllm.service", tmp_path / "units", tmp_path / "kept"),
        probe=VllmClient("http://127.0.0.1:9"),
        state_dir=tmp_path,
        gpus=reader if reader is not None else GpuReader(open=lambda: RecordedBackend(recording)),
    )


def test_uncorrectable_ecc_or_an_xid_refuses_the_restart(tmp_path: Path) -> None:
    faulty = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    with pytest.raises(
        ActuatorError,
        match=r"GPU 1 \(GPU-0b9e.*\) reports XID 79 \(GPU has fallen off the bus; hardware\), "
        r"XID 48 \(Double Bit ECC Error; hardware\), 2 uncorrectable ECC errors: a restart",
    ):
        actuator(tmp_path, faulty)._check_gpus()


def test_healthy_gpus_pass(tmp_path: Path) -> None:
    healthy = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    healthy["xid_events"] = []
    for device in healthy["devices"]:
        device["ecc_uncorrected_volatile"] = 0
    actuator(tmp_path, healthy)._check_gpus()  # no exception: nothing to refuse


def healthy_with(xid_events: list[list[int]]) -> dict[str, object]:
    recording = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    recording["xid_events"] = xid_events
    for device in recording["devices"]:
        device["ecc_uncorrected_volatile"] = 0
    return recording


def test_an_application_xid_does_not_refuse_the_restart(tmp_path: Path) -> None:
    # 13 and 43: what a restart of vLLM fixes.
    actuator(tmp_path, healthy_with([[1, 13], [1, 43], [0, 31]]))._check_gpus()


@pytest.mark.parametrize(
    ("xid", "said"),
    [
        (79, "XID 79 (GPU has fallen off the bus; hardware)"),
        (48, "XID 48 (Double Bit ECC Error; hardware)"),
        (999, "XID 999 (not in vkvagent's XID table; unknown)"),  # unknown: a fault, to be safe
    ],
)
def test_a_hardware_or_unknown_xid_refuses_the_restart(tmp_path: Path, xid: int, said: str) -> None:
    with pytest.raises(ActuatorError) as refused:
        actuator(tmp_path, healthy_with([[1, 13], [1, xid]]))._check_gpus()
    message = str(refused.value)
    assert f"GPU 1 (GPU-0b9e7d21-3c4f-4a6b-8e5d-7f1a2b3c4d5e) reports {said}: " in message
    assert "XID 13" not in message


def test_the_actuator_sees_an_xid_the_sampler_already_read_and_leaves_it_to_the_sampler(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    backend = RecordedBackend(healthy_with([[1, 79]]))
    shared = GpuReader(open=lambda: backend, mono=lambda: now[0])  # the daemon's one reader
    act = actuator(tmp_path, {}, reader=shared)
    assert shared.read()[0][1].xid_errors == (79,)  # the sampler first
    with pytest.raises(ActuatorError, match="XID 79"):
        act._check_gpus()
    assert shared.read()[0][1].xid_errors == ()  # once to the sampler, as before
    now[0] += 3601  # past the reader's fault window: no longer a reason to refuse
    act._check_gpus()


def test_the_actuator_first_does_not_hide_the_xid_from_the_sampler(tmp_path: Path) -> None:
    backend = RecordedBackend(healthy_with([[1, 48], [0, 13]]))
    shared = GpuReader(open=lambda: backend)
    with pytest.raises(ActuatorError, match="XID 48"):
        actuator(tmp_path, {}, reader=shared)._check_gpus()
    readings, _problem = shared.read()
    assert (readings[0].xid_errors, readings[1].xid_errors) == ((13,), (48,))
