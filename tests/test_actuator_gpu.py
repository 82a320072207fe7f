"""The restart path refuses to restart onto a faulty GPU (no systemd needed to see that)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkvagent.actuator import Actuator, ActuatorError
from vkvagent.dropin import DropinFile
from vkvagent.gpu import GpuReader, RecordedBackend
from vkvagent.ledger import Ledger
from vkvagent.systemd import Systemd
from vkvagent.vllm import VllmClient


def actuator(tmp_path: Path, recording: dict[str, object]) -> Actuator:
    return Actuator(
        unit="vllm.service",
        systemd=Systemd("unix:path=/nonexistent"),  # never reached: the GPU check comes first
        ledger=Ledger(tmp_path),
        dropin=DropinFile("vllm.service", tmp_path / "units", tmp_path / "kept"),
        probe=VllmClient("http://127.0.0.1:9"),
        state_dir=tmp_path,
        gpus=GpuReader(open=lambda: RecordedBackend(recording)),
    )


def test_uncorrectable_ecc_or_an_xid_refuses_the_restart(tmp_path: Path) -> None:
    faulty = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    with pytest.raises(ActuatorError, match=r"GPU 1 \(GPU-0b9e.*\) reports XID \[79, 48\], 2 unc"):
        actuator(tmp_path, faulty)._check_gpus()


def test_healthy_gpus_pass(tmp_path: Path) -> None:
    healthy = json.loads((FIXTURES / "gpu" / "h100x2-throttled.json").read_text())
    healthy["xid_events"] = []
    for device in healthy["devices"]:
        device["ecc_uncorrected_volatile"] = 0
    actuator(tmp_path, healthy)._check_gpus()  # no exception: nothing to refuse
