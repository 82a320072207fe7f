"""GPU readings: decoding tested on a recording; one test reads a real GPU where present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkvagent.cli import main
from vkvagent.gpu import (
    GpuReader,
    NvmlBackend,
    NvmlUnavailable,
    RecordedBackend,
    decode_clock_event_reasons,
    reader_for,
    record,
)

RECORDING = FIXTURES / "gpu" / "h100x2-throttled.json"


def replay(devices: tuple[int, ...] = ()) -> GpuReader:
    backend = RecordedBackend.load(str(RECORDING))
    return GpuReader(devices, open=lambda: backend)


def test_clock_event_reasons_decode_to_names() -> None:
    assert decode_clock_event_reasons(0) == ()
    assert decode_clock_event_reasons(0x1) == ("gpu_idle",)
    # 108 = 0x6c: sw_power_cap | hw_slowdown | sw_thermal_slowdown | hw_thermal_slowdown
    assert decode_clock_event_reasons(108) == (
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
    )
    assert decode_clock_event_reasons(0x80 | 0x1000) == (
        "hw_power_brake_slowdown",
        "unknown_0x1000",
    )


def test_a_recorded_host_reads_with_units_and_reasons() -> None:
    readings, problem = replay().read()
    assert problem is None
    healthy, hot, idle = readings
    assert healthy.index == 0 and healthy.name == "NVIDIA H100 80GB HBM3"
    assert healthy.uuid.startswith("GPU-6c3a")
    assert healthy.memory_total_bytes == 85520809984
    assert healthy.power_w == pytest.approx(612.345)
    assert healthy.power_limit_w == pytest.approx(700.0)
    assert healthy.throttled_by == () and healthy.xid_errors == ()
    assert hot.sm_clock_mhz == 1350 and hot.sm_clock_max_mhz == 1980
    assert hot.temperature_c == 91
    assert hot.throttled_by == (
        "sw_power_cap",
        "hw_slowdown",
        "sw_thermal_slowdown",
        "hw_thermal_slowdown",
    )
    assert hot.ecc_uncorrected_volatile == 2
    assert hot.xid_errors == (79, 48)
    # An idle consumer card: idle is a clock event, not throttling; no ECC at all.
    assert idle.clock_event_reasons == ("gpu_idle",) and idle.throttled_by == ()
    assert idle.ecc_uncorrected_volatile is None


def test_xid_events_are_reported_once() -> None:
    reader = replay()
    first, _ = reader.read()
    second, _ = reader.read()
    assert first[1].xid_errors == (79, 48)
    assert second[1].xid_errors == ()


def test_watching_some_devices_and_a_missing_one() -> None:
    readings, problem = replay((1,)).read()
    assert [r.index for r in readings] == [1]
    assert problem is None
    readings, problem = replay((0, 7)).read()
    assert [r.index for r in readings] == [0]
    assert problem == "GPU index [7] not present (3 GPUs)"


def test_no_driver_is_reported_once_and_not_retried_every_tick() -> None:
    opened = []

    def no_driver() -> RecordedBackend:
        opened.append(1)
        raise NvmlUnavailable("NVML Shared Library Not Found")

    reader = GpuReader(open=no_driver)
    for _ in range(3):
        assert reader.read() == ((), "NVML unavailable: NVML Shared Library Not Found")
    assert len(opened) == 1
    reader.reset()
    reader.read()
    assert len(opened) == 2


def test_the_real_nvml_on_a_host_without_a_gpu_is_unavailable_not_a_crash() -> None:
    try:
        backend = NvmlBackend()
    except NvmlUnavailable as exc:
        readings, problem = GpuReader(open=NvmlBackend).read()
        assert readings == ()
        assert problem == f"NVML unavailable: {exc}"
    else:  # a GPU host: the real-GPU test below covers it
        backend.close()


def test_a_recording_replays_to_the_same_raw_values() -> None:
    original = json.loads(RECORDING.read_text())
    assert record(RecordedBackend(original)) == original


def test_cli_reads_a_recording(capsys) -> None:
    assert main(["gpu", "--replay", str(RECORDING), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] is None
    assert out["gpus"][1]["throttled_by"][0] == "sw_power_cap"
    assert main(["gpu", "--replay", str(RECORDING)]) == 0
    text = capsys.readouterr().out
    assert "GPU 1 NVIDIA H100 80GB HBM3: 99 % busy" in text
    assert "throttled: sw_power_cap, hw_slowdown" in text and "XID [79, 48]" in text


def test_cli_refuses_a_file_that_is_not_a_recording(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["gpu", "--replay", str(bad)]) == 1
    assert capsys.readouterr().err.startswith(f"vkvagent: {bad}: not a GPU recording")


def _real_gpu() -> bool:
    try:
        NvmlBackend().close()
    except NvmlUnavailable:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not _real_gpu(), reason="no NVIDIA driver or GPU on this host")
def test_a_real_gpu(tmp_path: Path) -> None:
    readings, problem = GpuReader().read()
    assert problem is None and readings
    for r in readings:
        assert r.uuid.startswith("GPU-") and r.name
        assert r.memory_total_bytes and 0 <= (r.memory_used_bytes or 0) <= r.memory_total_bytes
        assert r.temperature_c is not None and 0 < r.temperature_c < 120
        assert r.sm_clock_max_mhz and 0 <= (r.sm_clock_mhz or 0) <= r.sm_clock_max_mhz * 1.05
        assert r.power_w is not None and r.power_w > 0
        assert not any(name.startswith("unknown") for name in r.clock_event_reasons)
    # What `vkvagent gpu --record` saves replays to the same static facts.
    path = tmp_path / "rec.json"
    assert main(["gpu", "--record", str(path)]) == 0
    replayed, _ = GpuReader(open=lambda: RecordedBackend.load(str(path))).read()
    static = [(r.uuid, r.name, r.memory_total_bytes, r.sm_clock_max_mhz) for r in readings]
    assert [(r.uuid, r.name, r.memory_total_bytes, r.sm_clock_max_mhz) for r in replayed] == static


def test_a_recording_file_kept_current_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    reader = reader_for((), str(path))
    readings, problem = reader.read()
    assert readings == () and problem is not None and "No such file" in problem
    recording = json.loads(RECORDING.read_text())
    path.write_text(json.dumps(recording))
    readings, problem = reader.read()  # the file appeared: read now, no restart needed
    assert problem is None and len(readings) == 3 and readings[1].xid_errors == (79, 48)
    assert reader.read()[0][1].xid_errors == ()  # the same file version: XIDs once
    recording["devices"][0]["temperature"] = 95
    recording["xid_events"] = []
    path.write_text(json.dumps(recording))
    os.utime(path, ns=(1, 2_000_000_000))  # a new mtime even on a coarse-grained filesystem
    assert reader.read()[0][0].temperature_c == 95
