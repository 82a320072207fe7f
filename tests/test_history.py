"""The sample history against real SQLite files: round trips, retention, migrations, a second
process reading while this one writes, row size, and failures that must leave no trace."""

from __future__ import annotations

import hashlib
import math
import os
import random
import sqlite3
import stat
import subprocess
import sys
import tempfile
from dataclasses import fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vkvagent.adapters import history as history_module
from vkvagent.adapters.history import FILE_NAME, History, HistoryError
from vkvagent.adapters.probe import ProbeResult
from vkvagent.engine.samples import GpuReading, Histogram, Sample, UnitFacts, VllmMetrics

REPO = Path(__file__).resolve().parents[1]
DAY = 86400.0
INF = math.inf
# vLLM V1's buckets for time_to_first_token_seconds and inter_token_latency_seconds.
TTFT_BOUNDS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0, INF)  # fmt: skip
ITL_BOUNDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0, INF)  # fmt: skip
CACHE_CONFIG = MappingProxyType({
    "block_size": "16", "cache_dtype": "auto", "calculate_kv_scales": "False",
    "enable_prefix_caching": "True", "gpu_memory_utilization": "0.9", "is_attention_free": "False",
    "num_cpu_blocks": "None", "num_gpu_blocks": "27042", "prefix_caching_hash_algo": "builtin",
    "sliding_window": "None", "swap_space": "4", "swap_space_bytes": "4294967296",
})  # fmt: skip


def histogram(bounds: tuple[float, ...], rng: random.Random, scale: int) -> Histogram:
    counts, total = [], 0
    for _bound in bounds:
        total += rng.randrange(scale)
        counts.append(float(total))
    return Histogram(bounds=bounds, cumulative=tuple(counts), sum=total * rng.uniform(0.01, 0.5))


def gpu(index: int, rng: random.Random, **changes: Any) -> GpuReading:
    reading = GpuReading(
        index=index,
        uuid=f"GPU-5f3e9a7c-1b2d-4e8f-9a0b-c1d2e3f4a5b{index}",
        name="NVIDIA H100 80GB HBM3",
        memory_used_bytes=75_000_000_000 + rng.randrange(10**9),
        memory_total_bytes=85_520_809_984,
        utilization_percent=float(rng.randrange(101)),
        temperature_c=float(rng.randrange(40, 80)),
        power_w=rng.randrange(100_000, 700_000) * 1e-3,
        power_limit_w=700.0,
        sm_clock_mhz=float(rng.choice((1755, 1980))),
        sm_clock_max_mhz=1980.0,
        clock_event_reasons=(),
        ecc_uncorrected_volatile=0,
        xid_errors=(),
    )
    return replace(reading, **changes)


def realistic_metrics(i: int, rng: random.Random) -> VllmMetrics:
    return VllmMetrics(
        flavor="v1-latest",
        models=("meta-llama/Llama-3.1-8B-Instruct",),
        engines=1,
        kv_cache_usage=rng.random(),
        kv_cache_usage_max=rng.random(),
        num_requests_running=float(rng.randrange(64)),
        num_requests_waiting=float(rng.randrange(8)),
        num_preemptions_total=float(i // 50),
        generation_tokens_total=float(40_000_000 + 9_000 * i + rng.randrange(1000)),
        prompt_tokens_total=float(90_000_000 + 20_000 * i + rng.randrange(1000)),
        request_success_total=float(150_000 + 30 * i),
        prefix_cache_queries_total=float(90_000_000 + 20_000 * i),
        prefix_cache_hits_total=float(30_000_000 + 6_000 * i),
        prefix_cache_unit="tokens",
        prefix_cache_hit_rate=None,
        engine_steps_total=float(8_000_000 + 400 * i),
        process_start_time=1_761_000_000.4729483,
        time_to_first_token=histogram(TTFT_BOUNDS, rng, 10_000),
        inter_token_latency=histogram(ITL_BOUNDS, rng, 1_000_000),
        cache_config=CACHE_CONFIG,
        version="0.11.0",
        http_requests_total=float(150_040 + 30 * i),
        http_5xx_total=float(i // 100),
    )


def realistic_sample(i: int, gpus: int = 1) -> Sample:
    """The i-th of a series of samples from a busy V1 server, ten seconds apart."""
    rng = random.Random(i)
    vllm = realistic_metrics(i, rng)
    return Sample(
        time=1_761_500_000.0 + 10.0 * i + rng.random() / 100,
        mono=83_211.5 + 10.0 * i + rng.random() / 100,
        vllm=vllm,
        gpus=tuple(gpu(n, rng) for n in range(gpus)),
    )


def sql(state_dir: Path, statement: str) -> list[Any]:
    """Runs one statement through a connection of its own, as another program would."""
    db = sqlite3.connect(state_dir / FILE_NAME, isolation_level=None)
    try:
        return db.execute(statement).fetchall()
    finally:
        db.close()


def count_rows(state_dir: Path, table: str) -> int:
    return int(sql(state_dir, f"SELECT count(*) FROM {table}")[0][0])


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- round trips -------------------------------------------------------------------------------


def test_realistic_samples_round_trip(tmp_path: Path) -> None:
    rng = random.Random(7)
    full = realistic_sample(0, gpus=1)
    down = Sample(
        time=full.time + 10,
        mono=full.mono + 10,
        vllm=None,
        vllm_error="GET http://127.0.0.1:8000/metrics: connection refused",
        gpus=(),
        gpu_error="NVML unavailable: driver not loaded",
    )
    throttled = Sample(
        time=full.time + 20,
        mono=full.mono + 20,
        vllm=replace(
            realistic_metrics(0, rng),
            models=("Qwen/Qwen2.5-Coder-32B-Instruct", "モデル-ü"),
            inter_token_latency=None,
            cache_config=MappingProxyType({}),
            version=None,
            warnings=("time_to_first_token ignored: buckets are not cumulative",),
        ),
        gpus=(
            gpu(0, rng, clock_event_reasons=("sw_power_cap", "hw_slowdown"), xid_errors=(79,)),
            gpu(
                1,
                rng,
                clock_event_reasons=("unknown_0x400",),
                xid_errors=(48, 63),
                memory_used_bytes=None,
                power_w=None,
                ecc_uncorrected_volatile=None,
            ),
        ),
    )
    samples = [full, down, throttled]
    with History(tmp_path) as store:
        ids = [store.append(sample) for sample in samples]
        assert ids == sorted(ids) and len(set(ids)) == 3
        assert store.samples() == samples
        assert store.latest() == throttled
    with History(tmp_path, readonly=True) as reader:
        read = reader.samples()
    assert read == samples
    vllm = read[0].vllm
    assert vllm is not None and isinstance(vllm.cache_config, MappingProxyType)
    assert vllm.time_to_first_token is not None
    assert vllm.time_to_first_token.bounds[-1] == INF


def optional(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


FLOATS = st.floats(allow_nan=False)  # SQLite stores NaN as NULL; no source produces NaN
TEXT = st.text(max_size=12)
INT64 = st.integers(-(2**63), 2**63 - 1)
HISTOGRAMS = st.integers(1, 6).flatmap(
    lambda n: st.builds(
        Histogram,
        bounds=st.lists(FLOATS, min_size=n, max_size=n).map(tuple),
        cumulative=st.lists(FLOATS, min_size=n, max_size=n).map(tuple),
        sum=FLOATS,
    )
)
# One strategy per field: a field added to VllmMetrics or GpuReading must be stored (a schema
# migration) and added here, or test_every_field_is_exercised fails.
VLLM_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "flavor": TEXT,
    "models": st.lists(TEXT, max_size=3).map(tuple),
    "engines": st.integers(1, 64),
    **{
        name: optional(FLOATS)
        for name in (
            "kv_cache_usage",
            "kv_cache_usage_max",
            "num_requests_running",
            "num_requests_waiting",
            "num_preemptions_total",
            "generation_tokens_total",
            "prompt_tokens_total",
            "request_success_total",
            "prefix_cache_queries_total",
            "prefix_cache_hits_total",
            "prefix_cache_hit_rate",
            "engine_steps_total",
            "process_start_time",
            "http_requests_total",
            "http_5xx_total",
        )
    },
    "prefix_cache_unit": optional(TEXT),
    "time_to_first_token": optional(HISTOGRAMS),
    "inter_token_latency": optional(HISTOGRAMS),
    "cache_config": st.dictionaries(TEXT, TEXT, max_size=3).map(MappingProxyType),
    "version": optional(TEXT),
    "warnings": st.lists(TEXT, max_size=2).map(tuple),
    "per_engine": st.just(()),  # not stored: the engine reads it live, nothing reads it back
}
GPU_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "index": st.integers(0, 255),
    "uuid": TEXT,
    "name": TEXT,
    "memory_used_bytes": optional(INT64),
    "memory_total_bytes": optional(INT64),
    **{
        name: optional(FLOATS)
        for name in (
            "utilization_percent",
            "temperature_c",
            "power_w",
            "power_limit_w",
            "sm_clock_mhz",
            "sm_clock_max_mhz",
        )
    },
    "clock_event_reasons": st.lists(TEXT, max_size=3).map(tuple),
    "ecc_uncorrected_volatile": optional(INT64),
    "xid_errors": st.lists(st.integers(0, 2**31), max_size=3).map(tuple),
}
UNIT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "active_state": TEXT,
    "sub_state": TEXT,
    "invocation_id": TEXT,
    "main_pid": st.integers(0, 2**22),
    "memory_bytes": optional(INT64),
    "n_restarts": st.integers(0, 2**31),
    "memory_anon_bytes": optional(INT64),
    "active_since": optional(st.floats(-1e12, 1e12)),
    "memory_max_bytes": optional(INT64),
    "restart_policy": st.sampled_from(["", "no", "on-failure", "always"]),
    "wanted": optional(st.booleans()),
    "last_exit": st.sampled_from(["", "exited with status 0", "killed by signal 9"]),
}
SAMPLES = st.builds(
    Sample,
    time=st.floats(-1e12, 1e12),
    mono=st.floats(allow_nan=False, allow_infinity=False),
    vllm=optional(st.builds(VllmMetrics, **VLLM_FIELDS)),
    vllm_error=optional(TEXT),
    gpus=st.lists(st.builds(GpuReading, **GPU_FIELDS), max_size=3).map(tuple),
    gpu_error=optional(TEXT),
    unit=optional(st.builds(UnitFacts, **UNIT_FIELDS)),
    unit_error=optional(TEXT),
    vllm_silent=st.booleans(),
)


def test_every_field_is_exercised() -> None:
    assert set(VLLM_FIELDS) == {f.name for f in fields(VllmMetrics)}
    assert set(GPU_FIELDS) == {f.name for f in fields(GpuReading)}
    assert set(UNIT_FIELDS) == {f.name for f in fields(UnitFacts)}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(SAMPLES, min_size=1, max_size=4))
def test_any_samples_round_trip(samples: list[Sample]) -> None:
    with tempfile.TemporaryDirectory() as state_dir, History(state_dir) as store:
        for sample in samples:
            store.append(sample)
        # Oldest first; samples taken at the same time keep the order they were appended in.
        expected = sorted(samples, key=lambda sample: sample.time)
        assert store.samples() == expected
        assert store.latest() == expected[-1]


def test_probes_are_kept_in_order_and_pruned_with_the_samples(tmp_path: Path) -> None:
    ok = ProbeResult(100.0, 1000.0, "ok", 0.04)
    hung = ProbeResult(160.0, 1060.0, "timeout", 30.0, "no data for 30 s (read timeout)")
    with History(tmp_path) as store:
        store.append_probe(hung)
        store.append_probe(ok)
        assert store.probes() == [ok, hung]
        assert store.probes(since=1050.0) == [hung]
        store.prune(1000.0 + 86400.0 + 30.0, 1.0)
        assert store.probes() == [hung]


def test_time_window_order_and_limit(tmp_path: Path) -> None:
    base = realistic_sample(0, gpus=2)
    at = {t: replace(base, time=t, mono=t + 0.5) for t in (5.0, 1.0, 3.0, 4.0)}
    second_at_3 = replace(base, time=3.0, vllm=None, vllm_error="timeout")
    with History(tmp_path) as store:
        assert store.latest() is None and store.samples() == []
        for sample in (*at.values(), second_at_3):  # appended out of time order
            store.append(sample)
        assert store.samples() == [at[1.0], at[3.0], second_at_3, at[4.0], at[5.0]]
        assert store.samples(since=3.0, until=4.0) == [at[3.0], second_at_3, at[4.0]]
        assert store.samples(since=3.0, until=3.0) == [at[3.0], second_at_3]
        assert store.samples(since=3.5, limit=1) == [at[4.0]]
        assert store.samples(limit=0) == []
        assert store.latest() == at[5.0]


# -- retention ---------------------------------------------------------------------------------


def test_prune_removes_exactly_the_old_samples_and_their_gpu_rows(tmp_path: Path) -> None:
    now = 1_761_500_000.0
    ages = (10.0, 8.5, 8.0, 7.99, 1.0, 0.0)  # days
    samples = [replace(realistic_sample(i, gpus=2), time=now - age * DAY)
               for i, age in enumerate(ages)]  # fmt: skip
    with History(tmp_path) as store:
        for sample in samples:
            store.append(sample)
        assert count_rows(tmp_path, "gpu_samples") == 12
        assert store.prune(now, retention_days=8) == 2
        assert store.samples() == samples[2:]  # exactly 8 days old is kept
        assert count_rows(tmp_path, "gpu_samples") == 8
        assert store.prune(now, retention_days=8) == 0
        assert store.prune(now + 1.5 * DAY, retention_days=8) == 2
        assert store.samples() == samples[4:]
        assert count_rows(tmp_path, "gpu_samples") == 4


# -- schema versions ---------------------------------------------------------------------------


def test_an_older_database_is_migrated_and_keeps_its_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = history_module._MIGRATIONS  # the database is made at today's schema...
    sample = realistic_sample(0, gpus=2)
    with History(tmp_path) as store:
        store.append(sample)
    with History(tmp_path, readonly=True) as reader:
        assert reader.samples() == [sample]

    # ...and the code now knows one more step than the database has.
    newer = (*current, ("CREATE TABLE notes (sample_id INTEGER, text TEXT)",))
    monkeypatch.setattr(history_module, "_MIGRATIONS", newer)
    old, new = len(current), len(newer)
    with pytest.raises(
        HistoryError, match=rf"schema {old} is older than this vkvagent reads \({new}\)"
    ):
        History(tmp_path, readonly=True)
    with History(tmp_path) as store:
        assert store.samples() == [sample]
        store.append(realistic_sample(1))
    assert sql(tmp_path, "PRAGMA user_version") == [(len(newer),)]
    assert count_rows(tmp_path, "notes") == 0
    with History(tmp_path, readonly=True) as reader:
        assert len(reader.samples()) == 2


def test_a_failing_migration_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with History(tmp_path) as store:
        store.append(realistic_sample(0))
    broken = (("CREATE TABLE notes (text TEXT)", "ALTER TABLE nowhere ADD COLUMN x"),)
    monkeypatch.setattr(history_module, "_MIGRATIONS", (*history_module._MIGRATIONS, *broken))
    with pytest.raises(HistoryError, match="cannot migrate: no such table: nowhere"):
        History(tmp_path)
    assert sql(tmp_path, "PRAGMA user_version") == [(len(history_module._MIGRATIONS) - 1,)]
    assert ("notes",) not in sql(tmp_path, "SELECT name FROM sqlite_master")


def test_a_newer_database_is_refused_and_left_untouched(tmp_path: Path) -> None:
    file = tmp_path / FILE_NAME
    sql(tmp_path, "CREATE TABLE samples (future TEXT)")
    sql(tmp_path, "PRAGMA user_version = 999")
    before = digest(file)
    expected = (
        f"schema 999 is newer than this vkvagent supports ({len(history_module._MIGRATIONS)})"
    )
    for readonly in (False, True):
        with pytest.raises(HistoryError) as caught:
            History(tmp_path, readonly=readonly)
        assert str(caught.value) == f"{file}: history database {expected}"
    assert digest(file) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [FILE_NAME]  # no -wal, no -shm


# -- opening -----------------------------------------------------------------------------------


def test_creates_its_directory_and_uses_wal(tmp_path: Path) -> None:
    state_dir = tmp_path / "var" / "vkvagent"
    umask = os.umask(0o022)
    os.umask(umask)
    with History(state_dir) as store:
        assert store.path == state_dir / FILE_NAME
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o750 & ~umask
    assert sql(state_dir, "PRAGMA journal_mode") == [("wal",)]


def test_readonly_open_of_a_missing_database_fails_clearly(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here"
    with pytest.raises(HistoryError) as caught:
        History(missing, readonly=True)
    assert str(caught.value) == f"{missing / FILE_NAME}: no history database (has the daemon run?)"
    assert not missing.exists()


def test_a_corrupt_file_is_a_history_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_bytes(b"this is not an SQLite database\n" * 200)
    for readonly in (False, True):
        with pytest.raises(HistoryError) as caught:
            History(tmp_path, readonly=readonly)
        message = str(caught.value)
        assert message.startswith(f"{tmp_path / FILE_NAME}: cannot open: ")
        assert "not a database" in message and "\n" not in message


READER = """
import sys, time
from tests.test_history import realistic_sample
from vkvagent.adapters.history import History

state_dir, wanted = sys.argv[1], int(sys.argv[2])
with History(state_dir, readonly=True) as store:
    print(len(store.samples()), flush=True)
    deadline = time.monotonic() + 60
    while len(store.samples()) < wanted and time.monotonic() < deadline:
        time.sleep(0.005)
    read = store.samples()
    print(len(read), read == [realistic_sample(i) for i in range(wanted)], flush=True)
"""


def test_another_process_reads_while_this_one_appends(tmp_path: Path) -> None:
    # A short busy timeout: in WAL mode the reader never makes the writer wait.
    with History(tmp_path, busy_timeout=0.2) as store:
        for i in range(100):
            store.append(realistic_sample(i))
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(tmp_path), "300"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert reader.stdout is not None
            assert reader.stdout.readline().strip() == "100"  # its connection is open now
            for i in range(100, 300):
                store.append(realistic_sample(i))
            out, err = reader.communicate(timeout=120)
        finally:
            reader.kill()
    assert reader.returncode == 0, err
    assert out.split() == ["300", "True"]


# -- size --------------------------------------------------------------------------------------


def test_rows_are_compact(tmp_path: Path) -> None:
    """Measured: 676 bytes a sample with one GPU, 127 more for each further GPU (SQLite 3.40).
    A busy server's histogram counts (23 and 20 buckets of 6-8 digits) take 300 bytes of the
    515-byte sample row, the time index 20, and a GPU reading 130 (its UUID and name 61).
    So 8 days at 10 s (69,120 samples) of a one-GPU server take about 47 MB."""

    def bytes_per_sample(state_dir: Path, gpus: int, rows: int = 2000) -> float:
        with History(state_dir) as store:
            for i in range(rows):
                store.append(realistic_sample(i, gpus=gpus))
        [(pages,)] = sql(state_dir, "PRAGMA page_count")
        [(page_size,)] = sql(state_dir, "PRAGMA page_size")
        return float(pages * page_size / rows)

    one, two = bytes_per_sample(tmp_path / "1", 1), bytes_per_sample(tmp_path / "2", 2)
    print(f"bytes per sample: {one:.0f} with one GPU, {two - one:.0f} more per GPU")
    assert one < 700
    assert two - one < 140


# -- failures ----------------------------------------------------------------------------------


def with_new_layout(i: int, first_bound: float, block_size: str) -> Sample:
    """A sample whose TTFT bounds and cache config the history has not seen before."""
    sample = realistic_sample(i, gpus=2)
    vllm = replace(
        realistic_metrics(i, random.Random(i)),
        time_to_first_token=Histogram((first_bound, INF), (3.0, 5.0), 7.5),
        cache_config=MappingProxyType({"block_size": block_size}),
    )
    return replace(sample, vllm=vllm)


def test_a_failed_append_leaves_nothing_behind(tmp_path: Path) -> None:
    kept = realistic_sample(0, gpus=2)
    # Its new layout and cache config are written before its second GPU row fails.
    failing = with_new_layout(1, 1.0, "32")
    with History(tmp_path) as store:
        store.append(kept)
        sql(
            tmp_path,
            "CREATE TRIGGER refuse BEFORE INSERT ON gpu_samples WHEN NEW.gpu_index = 1 "
            "BEGIN SELECT RAISE(ABORT, 'disk on fire'); END",
        )
        with pytest.raises(HistoryError, match=r"history.sqlite3: cannot append: disk on fire$"):
            store.append(failing)
        assert store.samples() == [kept]
        assert count_rows(tmp_path, "gpu_samples") == 2
        assert count_rows(tmp_path, "histogram_layouts") == 2
        assert count_rows(tmp_path, "cache_configs") == 1

        sql(tmp_path, "DROP TRIGGER refuse")
        # The ids the failed append got were rolled back, and another layout takes them now:
        # the history must not remember them as the failed sample's.
        other = with_new_layout(2, 2.0, "64")
        store.append(other)
        store.append(failing)
        assert store.samples() == [kept, failing, other]


def test_a_value_sqlite_cannot_hold_fails_the_whole_append(tmp_path: Path) -> None:
    rng = random.Random(1)
    too_big = replace(
        realistic_sample(1), gpus=(gpu(0, rng), gpu(1, rng, ecc_uncorrected_volatile=2**64))
    )
    with History(tmp_path) as store:
        store.append(realistic_sample(0))
        with pytest.raises(HistoryError, match=r"cannot append: .*too large"):
            store.append(too_big)
        assert store.samples() == [realistic_sample(0)]
    assert count_rows(tmp_path, "gpu_samples") == 1


def test_a_locked_database_is_a_history_error(tmp_path: Path) -> None:
    with History(tmp_path, busy_timeout=0.05) as store:
        store.append(realistic_sample(0))
        other = sqlite3.connect(tmp_path / FILE_NAME, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        try:
            with pytest.raises(HistoryError) as caught:
                store.append(realistic_sample(1))
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert str(caught.value) == f"{store.path}: cannot append: database is locked"
        assert store.samples() == [realistic_sample(0)]
        store.append(realistic_sample(1))  # usable again once the lock is gone
        assert len(store.samples()) == 2


def test_writes_through_a_closed_or_readonly_history_fail(tmp_path: Path) -> None:
    store = History(tmp_path)
    store.append(realistic_sample(0))
    with History(tmp_path, readonly=True) as reader:
        with pytest.raises(HistoryError, match="cannot append: attempt to write a readonly"):
            reader.append(realistic_sample(1))
        with pytest.raises(HistoryError, match="cannot prune: attempt to write a readonly"):
            reader.prune(now=2e9, retention_days=1)
    store.close()
    with pytest.raises(HistoryError, match=r"history\.sqlite3: the history is closed"):
        store.append(realistic_sample(1))
    with pytest.raises(HistoryError, match="the history is closed"):
        store.samples()
    store.close()  # closing twice is harmless
    with History(tmp_path, readonly=True) as reader:
        assert reader.samples() == [realistic_sample(0)]


def test_a_schema_1_database_gains_the_unit_columns_and_keeps_its_rows(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / FILE_NAME, isolation_level=None)
    for statement in history_module._MIGRATIONS[0]:
        db.execute(statement)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO samples (time, mono, vllm_error) VALUES (5.0, 1.0, 'down')")
    db.close()
    with History(tmp_path) as store:
        (old,) = store.samples()
        assert (old.time, old.vllm_error, old.unit, old.unit_error) == (5.0, "down", None, None)
        facts = UnitFacts("active", "running", "ab" * 16, 42, 2**30, 0)
        store.append(replace(old, time=6.0, unit=facts))
        assert store.latest() == replace(old, time=6.0, unit=facts)
    assert sql(tmp_path, "PRAGMA user_version") == [(len(history_module._MIGRATIONS),)]


def test_a_schema_4_database_gains_the_http_columns_and_keeps_its_vllm_samples(
    tmp_path: Path,
) -> None:
    """A sample stored before the availability objective reads back without the API's
    answers (unknown, not none), and the samples after it keep theirs."""
    db = sqlite3.connect(tmp_path / FILE_NAME, isolation_level=None)
    for migration in history_module._MIGRATIONS[:4]:
        for statement in migration:
            db.execute(statement)
    db.execute("PRAGMA user_version = 4")
    db.execute("INSERT INTO cache_configs (id, json) VALUES (1, '{}')")
    db.execute(
        "INSERT INTO samples (time, mono, flavor, models, engines, request_success_total, "
        """cache_config) VALUES (5.0, 1.0, 'v1-latest', '["m"]', 1, 70.0, 1)"""
    )
    db.close()
    with History(tmp_path) as store:
        (old,) = store.samples()
        assert old.vllm is not None and old.vllm.request_success_total == 70.0
        assert (old.vllm.http_requests_total, old.vllm.http_5xx_total) == (None, None)
        new = realistic_sample(250)
        assert new.vllm is not None and new.vllm.http_5xx_total == 2.0
        store.append(new)
        assert store.samples() == [old, new]
    assert sql(tmp_path, "PRAGMA user_version") == [(len(history_module._MIGRATIONS),)]


def test_a_schema_5_database_reads_its_units_restart_policy_as_unknown(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / FILE_NAME, isolation_level=None)
    for migration in history_module._MIGRATIONS[:5]:
        for statement in migration:
            db.execute(statement)
    db.execute("PRAGMA user_version = 5")
    db.execute(
        "INSERT INTO samples (time, mono, unit_active_state, unit_sub_state, unit_invocation_id, "
        "unit_main_pid, unit_n_restarts) VALUES (5.0, 1.0, 'failed', 'failed', '', 0, 0)"
    )
    db.close()
    with History(tmp_path) as store:
        (old,) = store.samples()
        assert old.unit == UnitFacts("failed", "failed", "", 0, None, 0)
        assert (old.unit.restart_policy, old.unit.wanted, old.unit.last_exit) == ("", None, "")
        facts = replace(old.unit, restart_policy="on-failure", wanted=True, last_exit="x")
        store.append(replace(old, time=6.0, unit=facts))
        assert store.latest() == replace(old, time=6.0, unit=facts)
    assert sql(tmp_path, "PRAGMA user_version") == [(6,)]
