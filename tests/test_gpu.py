"""GPU readings: decoding tested on a recording; one test reads a real GPU where present."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import FIXTURES
from vkvagent.adapters.gpu import (
    GpuProcess,
    GpuReader,
    NvmlBackend,
    NvmlUnavailable,
    RecordedBackend,
    _process_memory,
    decode_clock_event_reasons,
    reader_for,
    record,
)
from vkvagent.engine.gpu_faults import (
    FAULT_CLASSES,
    XIDS,
    describe_xid,
    is_fault,
    xid_class,
    xid_meaning,
)
from vkvagent.tools.cli import main

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


def test_process_lists_are_recorded_and_replayed_per_watched_gpu() -> None:
    recording = json.loads(RECORDING.read_text())
    recording["devices"][2]["processes"] = [[61000, None]]  # the driver does not say (MIG)
    replayed = record(RecordedBackend(recording))
    assert [d["processes"] for d in replayed["devices"]] == [
        [[48211, 71303168000]],
        [[48211, 524288000], [50112, 1073741824]],
        [[61000, None]],
    ]
    reader = GpuReader((1, 2), open=lambda: RecordedBackend(json.loads(json.dumps(replayed))))
    assert reader.processes() == (
        (GpuProcess(1, 48211, 524288000), GpuProcess(1, 50112, 1073741824),
         GpuProcess(2, 61000, None)),
        None,
    )  # fmt: skip


def test_a_recording_from_before_process_lists_still_reads() -> None:
    recording = json.loads(RECORDING.read_text())
    for device in recording["devices"]:
        del device["processes"]
    reader = GpuReader(open=lambda: RecordedBackend(recording))
    readings, problem = reader.read()
    assert problem is None and len(readings) == 3
    assert reader.processes() == (
        (),
        "GPU processes cannot be listed: NvmlUnsupported: not recorded",
    )
    assert record(RecordedBackend(recording))["devices"][0]["processes"] == {
        "error": "not recorded"
    }


def test_nvml_memory_not_available_reads_as_none() -> None:
    assert _process_memory(None) is None
    assert _process_memory(2**64 - 1) is None  # NVML_VALUE_NOT_AVAILABLE, where pynvml passes it
    assert _process_memory(524288000) == 524288000


def test_cli_reads_a_recording(capsys) -> None:
    assert main(["gpu", "--replay", str(RECORDING), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] is None
    assert out["gpus"][1]["throttled_by"][0] == "sw_power_cap"
    assert main(["gpu", "--replay", str(RECORDING)]) == 0
    text = capsys.readouterr().out
    assert "GPU 1 NVIDIA H100 80GB HBM3: 99 % busy" in text
    assert "throttled: sw_power_cap, hw_slowdown" in text
    assert "XID 79 (GPU has fallen off the bus; hardware), XID 48 (Double Bit ECC Error" in text


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
    # The process lists are recorded too: each a list of [pid, bytes or null].
    for device in json.loads(path.read_text())["devices"]:
        assert isinstance(device["processes"], list)
        assert all(pid > 0 and (used is None or used >= 0) for pid, used in device["processes"])


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


# -- XID classes and the reader's XID log ------------------------------------------------------


def test_xid_classes_follow_nvidias_catalogue() -> None:
    # The codes NVIDIA lists as usually the application's: a restart of vLLM fixes them.
    for code in (13, 31, 43, 45, 68, 137):
        assert xid_class(code) == "application" and not is_fault(code), code
    for code in (48, 63, 64, 74, 79, 92, 94, 95, 121, 140, 143, *range(144, 151)):
        assert xid_class(code) == "hardware" and is_fault(code), code
    for code in (8, 32, 38, 44, 109, 119, 120):
        assert xid_class(code) == "driver" and is_fault(code), code
    assert xid_meaning(79) == "GPU has fallen off the bus"
    assert describe_xid(43) == "XID 43 (GPU stopped processing; application)"
    # A code not in the table is a fault, to be safe.
    assert xid_class(999) == "unknown" and is_fault(999)
    assert describe_xid(999) == "XID 999 (not in vkvagent's XID table; unknown)"
    assert {"hardware", "driver", "unknown"} == FAULT_CLASSES
    wanted = {8, 13, 31, 32, 38, 43, 44, 45, 48, 56, 57, 58, 61, 62, 63, 64, 68, 69, 74, 79}
    wanted |= {92, 94, 95, 109, 119, 120, 121, 140, 143, *range(144, 151)}
    assert wanted <= set(XIDS)
    assert {cls for _meaning, cls in XIDS.values()} == {"hardware", "driver", "application"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LiveBackend(RecordedBackend):
    """The recorded host, with XID events the test hands in; each drained once, as NVML's
    event set does."""

    def __init__(self) -> None:
        recording = json.loads(RECORDING.read_text())
        recording["xid_events"] = []
        super().__init__(recording)
        self.pending: list[tuple[int, int]] = []

    def xid_events(self) -> list[tuple[int, int]]:
        found, self.pending = self.pending, []
        return found


def live(
    devices: tuple[int, ...] = (), fault_window: float = 3600.0, keep: int = 256
) -> tuple[LiveBackend, GpuReader, Clock]:
    backend, clock = LiveBackend(), Clock()
    reader = GpuReader(
        devices, open=lambda: backend, mono=clock, fault_window=fault_window, keep=keep
    )
    return backend, reader, clock


def test_faults_see_an_xid_the_sampler_already_read() -> None:
    backend, reader, clock = live()
    backend.pending = [(1, 79)]
    assert reader.read()[0][1].xid_errors == (79,)  # the sampler takes it
    clock.now += 60
    [fault] = reader.faults()
    assert (fault.index, fault.xid, fault.seen_at) == (1, 79, 1000.0)
    assert reader.read()[0][1].xid_errors == ()  # still reported once to the sampler


def test_faults_first_do_not_hide_the_xid_from_the_sampler() -> None:
    backend, reader, _clock = live()
    backend.pending = [(1, 79), (0, 13)]
    assert [(f.index, f.xid) for f in reader.faults()] == [(1, 79)]  # 13 is the application's
    assert backend.pending == []  # drained from NVML ...
    readings, _ = reader.read(consume_xids=False)  # ... but kept for the sampler
    assert (readings[0].xid_errors, readings[1].xid_errors) == ((13,), (79,))
    readings, _ = reader.read()
    assert (readings[0].xid_errors, readings[1].xid_errors) == ((13,), (79,))
    assert reader.read()[0][1].xid_errors == ()
    assert [f.xid for f in reader.faults()] == [79]


def test_faults_are_kept_for_the_window_and_to_a_bound() -> None:
    backend, reader, clock = live(fault_window=3600.0, keep=3)
    backend.pending = [(1, 48)]
    reader.faults()
    clock.now += 3000
    backend.pending = [(0, 999)]  # unknown: a fault
    assert [f.xid for f in reader.faults()] == [48, 999]
    assert [f.xid for f in reader.faults(within=600)] == [999]
    clock.now += 700  # 48 is past the window now
    assert [f.xid for f in reader.faults()] == [999]
    backend.pending = [(0, 79), (0, 79), (0, 79)]
    assert [f.xid for f in reader.faults()] == [79, 79, 79]  # only the last 3 kept


def test_faults_of_unwatched_gpus_do_not_count_but_unnamed_ones_do() -> None:
    backend, reader, _clock = live((0,))
    backend.pending = [(1, 79), (-1, 48)]
    assert [(f.index, f.xid) for f in reader.faults()] == [(-1, 48)]


def test_faults_survive_nvml_going_away() -> None:
    backend, clock = LiveBackend(), Clock()
    opened: list[LiveBackend] = []

    def open_once() -> LiveBackend:
        if opened:
            raise NvmlUnavailable("Driver Not Loaded")
        opened.append(backend)
        return backend

    reader = GpuReader(open=open_once, mono=clock)
    backend.pending = [(0, 79)]
    assert [f.xid for f in reader.faults()] == [79]
    reader.reset()  # e.g. the daemon reopening NVML
    assert [f.xid for f in reader.faults()] == [79]
    assert reader.unavailable == "NVML unavailable: Driver Not Loaded"
