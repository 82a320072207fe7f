"""The timeline replay runs over: recorded series made into one sample per timestamp
(dcgm-exporter's as GPU readings, holes as samples without vLLM, labels written back as the
exposition format wants)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import parse_labels

from vkvagent.adapters import query_range
from vkvagent.tools import timeline


def series(name: str, points: list[tuple[float, float]], **labels: str) -> query_range.Series:
    return query_range.Series(name, labels, [t for t, _v in points], [v for _t, v in points])


def test_dcgm_series_become_gpu_readings() -> None:
    gpu = {"gpu": "3", "UUID": "GPU-abc", "modelName": "NVIDIA H100 80GB HBM3"}
    vllm = [series("vllm:num_requests_running", [(t, 1.0) for t in (10, 20, 30)], model_name="m")]
    dcgm = [
        series("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", [(10, 0), (20, 0x48), (30, 0)], **gpu),
        series("DCGM_FI_DEV_SM_CLOCK", [(10, 1980), (20, 1400), (30, 1980)], **gpu),
        series("DCGM_FI_DEV_GPU_TEMP", [(10, 60), (20, 88), (30, 61)], **gpu),
        series("DCGM_FI_DEV_FB_USED", [(10, 1024), (20, 1024), (30, 1024)], **gpu),
        series("DCGM_FI_DEV_FB_FREE", [(10, 512), (20, 512), (30, 512)], **gpu),
        series("DCGM_FI_DEV_XID_ERRORS", [(10, 0), (20, 79), (30, 79)], **gpu),
        series("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", [(10, 0), (20, 0), (30, 2)], **gpu),
    ]
    line = timeline.timeline(vllm + dcgm)
    readings = [sample.gpus for sample, _memory in line.samples()]
    assert [len(r) for r in readings] == [1, 1, 1]
    calm, hot, after = (r[0] for r in readings)
    assert (hot.index, hot.uuid, hot.name) == (3, "GPU-abc", "NVIDIA H100 80GB HBM3")
    assert hot.clock_event_reasons == ("hw_slowdown", "hw_thermal_slowdown")
    assert hot.throttled_by == ("hw_slowdown", "hw_thermal_slowdown")
    assert (hot.sm_clock_mhz, hot.sm_clock_max_mhz, hot.temperature_c) == (1400, 1980, 88)
    assert (hot.memory_used_bytes, hot.memory_total_bytes) == (1 << 30, 1536 << 20)
    # The XID gauge holds the last code: an XID is reported when it changes, once.
    assert (calm.xid_errors, hot.xid_errors, after.xid_errors) == ((), (79,), ())
    assert after.ecc_uncorrected_volatile == 2 and calm.clock_event_reasons == ()


def test_gpus_of_several_hosts_are_refused() -> None:
    vllm = [series("vllm:num_requests_running", [(10, 1.0), (20, 1.0)])]
    temps = [series("DCGM_FI_DEV_GPU_TEMP", [(10, 50)], gpu="0", Hostname=h) for h in "ab"]
    with pytest.raises(query_range.ReplayError, match=r"^GPU series from 2 hosts \(a, b\): keep "):
        timeline.timeline(vllm + temps)


def test_holes_in_the_data_become_samples_without_vllm() -> None:
    vllm = [series("vllm:num_requests_running", [(t, 1.0) for t in (0, 10, 20, 60, 70)])]
    line = timeline.timeline(vllm)
    assert line.step == 10 and line.times == [0, 10, 20, 30, 40, 50, 60, 70]
    errors = [sample.vllm_error for sample, _memory in line.samples()]
    assert errors[3:6] == ["no vLLM series at this time (target down, or not scraped)"] * 3
    assert errors[:3] == [None] * 3 and errors[6:] == [None] * 2


def test_the_api_answers_are_vllms_own_and_known_from_its_first_page() -> None:
    """http_requests_total is a common name: only vLLM's target's series are read. The live
    page declares it from vLLM's start, so before the first POST it reads none (0), as live."""
    vllm = [series("vllm:num_requests_running", [(t, 1.0) for t in (10, 20, 30)], instance="a:1")]
    post = {"handler": "/v1/completions", "method": "POST"}
    http = [
        series("http_requests_total", [(30, 5.0)], status="2xx", instance="a:1", **post),
        series("http_requests_total", [(30, 1.0)], status="5xx", instance="a:1", **post),
        series("http_requests_total", [(t, t) for t in (10, 20, 30)], status="5xx",
               instance="b:1", **post),  # another program on another port
    ]  # fmt: skip

    def read(line: timeline.Timeline) -> list[tuple[float | None, float | None]]:
        samples = [sample.vllm for sample, _memory in line.samples()]
        return [(m.http_requests_total, m.http_5xx_total) for m in samples if m is not None]

    assert read(timeline.timeline(vllm + http)) == [(0.0, 0.0), (0.0, 0.0), (6.0, 1.0)]
    assert read(timeline.timeline(vllm + http[2:])) == [(None, None)] * 3  # none of vLLM's


def test_labels_are_escaped_as_the_exposition_format_wants() -> None:
    labels = {"model_name": 'a"b\\c\nd', "instance": "x:1", "job": "j", "engine": "0"}
    line = timeline._line("vllm:num_requests_running", labels)
    assert line == 'vllm:num_requests_running{engine="0",model_name="a\\"b\\\\c\\nd"}'
    assert parse_labels(line[line.index("{") + 1 : -1]) == {"engine": "0", "model_name": labels[
        "model_name"]}  # fmt: skip
