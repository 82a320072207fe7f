"""``vkvagent scrape`` and ``vkvagent gpu``: one reading of vLLM's metrics and of the GPUs,
in words or as JSON; a saved /metrics page or an NVML recording read in their place."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from vkvagent.adapters.gpu import GpuReader, NvmlBackend, RecordedBackend, reader_for, record
from vkvagent.adapters.vllm import VllmClient
from vkvagent.engine.gpu_faults import describe_xid
from vkvagent.engine.samples import GpuReading, VllmMetrics
from vkvagent.knowledge import config
from vkvagent.knowledge.vllm_metrics import Normaliser
from vkvagent.tools.exitcodes import CommandError, ExitCode


def scrape(args: argparse.Namespace, out: TextIO) -> int:
    settings = config.load(args.config).vllm
    settings = dataclasses.replace(
        settings,
        url=args.url or settings.url,
        model=settings.model if args.model is None else args.model,
    )
    if args.file is not None:
        metrics = Normaliser(settings.model).normalise(
            _read_page(args.file, settings.max_page_bytes), settings.version or None
        )
    else:
        client = VllmClient.from_config(settings)
        metrics = client.scrape(client.version() or settings.version or None)
    if args.json:
        json.dump(metrics.to_json(), out, indent=2, sort_keys=False)
        out.write("\n")
    else:
        out.write(describe_metrics(metrics))
    return ExitCode.OK


def _read_page(path: Path, limit: int) -> str:
    try:
        if str(path) == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with path.open("rb") as handle:
                data = handle.read(limit + 1)
    except OSError as exc:
        raise CommandError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > limit:
        raise CommandError(f"{path}: page exceeds the {limit}-byte limit")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    # `$(curl ...)` and many editors drop the final newline. Over HTTP a page without one was
    # cut off (and is refused); a file is read as the whole page, with a word of caution.
    if text.strip() and not text.endswith("\n"):
        print(
            f"vkvagent: warning: {path}: the last line has no final newline; "
            "read as complete (a page cut off mid-line would be misread)",
            file=sys.stderr,
        )
        text += "\n"
    return text


def gpu(args: argparse.Namespace, out: TextIO) -> int:
    if args.record:
        try:
            backend = NvmlBackend()
            try:
                recording = record(backend)
            finally:
                backend.close()
        except Exception as exc:  # NvmlUnavailable, or an NVML error mid-way
            raise CommandError(f"cannot record: {exc}") from None
        args.record.write_text(json.dumps(recording, indent=1) + "\n", encoding="utf-8")
        print(f"recorded {len(recording['devices'])} GPU(s) to {args.record}", file=out)
        return ExitCode.OK
    if args.replay:
        try:
            replayed = RecordedBackend.load(str(args.replay))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CommandError(f"{args.replay}: not a GPU recording: {exc}") from None
        reader = GpuReader(open=lambda: replayed)
    else:
        settings = config.load(args.config).gpu
        reader = reader_for(settings.devices, settings.recording)
    readings, problem = reader.read()
    if args.json:
        json.dump({"gpus": [r.to_json() for r in readings], "error": problem}, out, indent=2)
        out.write("\n")
    elif readings:
        out.write(describe_gpus(readings))
    if problem is None:
        return ExitCode.OK
    # Some GPUs read: what is missing is a warning. None: the command failed.
    print(f"vkvagent: {'warning: ' if readings else ''}{problem}", file=sys.stderr)
    return ExitCode.OK if readings else ExitCode.FAILURE


# -- human-readable output ---------------------------------------------------------------------


def describe_metrics(m: VllmMetrics) -> str:
    def num(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:,.0f}{unit}"

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:.1f} %"

    lines = [
        f"vLLM {m.version or 'version unknown'}, metrics flavour {m.flavor}, "
        f"model {', '.join(m.models) or '-'}, {m.engines} engine(s)",
        f"  requests      running {num(m.num_requests_running)}, "
        f"waiting {num(m.num_requests_waiting)}",
        f"  KV cache      usage {pct(m.kv_cache_usage)} "
        f"(fullest engine {pct(m.kv_cache_usage_max)})",
        f"  preemptions   {num(m.num_preemptions_total)} since start",
        f"  tokens        prompt {num(m.prompt_tokens_total)}, "
        f"generated {num(m.generation_tokens_total)}, "
        f"requests finished {num(m.request_success_total)}",
    ]
    if m.prefix_cache_queries_total is not None:
        ratio = (
            (m.prefix_cache_hits_total or 0) / m.prefix_cache_queries_total
            if m.prefix_cache_queries_total
            else None
        )
        lines.append(
            f"  prefix cache  {num(m.prefix_cache_hits_total)} hits of "
            f"{num(m.prefix_cache_queries_total)} {m.prefix_cache_unit} queried "
            f"({pct(ratio)})"
        )
    elif m.prefix_cache_hit_rate is not None:
        lines.append(f"  prefix cache  hit rate {pct(m.prefix_cache_hit_rate)}")
    for label, hist in (("TTFT", m.time_to_first_token), ("ITL", m.inter_token_latency)):
        if hist is not None and hist.count:
            lines.append(
                f"  {label:<13} mean {hist.sum / hist.count * 1000:.1f} ms over "
                f"{hist.count:,.0f} since start"
            )
    if m.cache_config:
        shown = (
            "block_size",
            "gpu_memory_utilization",
            "enable_prefix_caching",
            "cache_dtype",
            "num_gpu_blocks",
        )
        lines.append(
            "  cache config  "
            + ", ".join(f"{k}={m.cache_config[k]}" for k in shown if k in m.cache_config)
        )
    return "\n".join(lines) + "\n"


def describe_gpus(readings: Sequence[GpuReading]) -> str:
    lines = []
    for r in readings:

        def show(value: float | None, unit: str) -> str:
            return "-" if value is None else f"{value:.0f}{unit}"

        memory = (
            "-"
            if r.memory_used_bytes is None or not r.memory_total_bytes
            else f"{r.memory_used_bytes / 2**30:.1f}/{r.memory_total_bytes / 2**30:.1f} GiB"
        )
        lines.append(
            f"GPU {r.index} {r.name}: {show(r.utilization_percent, ' %')} busy, mem {memory}, "
            f"{show(r.temperature_c, ' C')}, {show(r.power_w, ' W')}/"
            f"{show(r.power_limit_w, ' W')}, SM {show(r.sm_clock_mhz, '')}/"
            f"{show(r.sm_clock_max_mhz, ' MHz')}, "
            f"throttled: {', '.join(r.throttled_by) or 'no'}"
            + "".join(f", {describe_xid(xid)}" for xid in r.xid_errors)
            + (
                f", uncorrected ECC {r.ecc_uncorrected_volatile}"
                if r.ecc_uncorrected_volatile
                else ""
            )
        )
    return "\n".join(lines) + "\n"
