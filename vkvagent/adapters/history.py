"""The sample history: every Sample the daemon takes, kept on disk in SQLite for some days.

One process writes (the daemon) while others read (``vkvagent status``, replay): the database
runs in WAL mode, so readers see every committed sample without blocking the writer, and each
connection waits out a busy lock instead of failing at once.

A sample is written every few seconds for days, so rows are kept small: histogram bucket
bounds and cache configs are stored once in their own tables and referenced by id, tuples are
compact JSON (NULL when empty), and histogram counts are JSON arrays whose whole numbers carry
no ``.0``. NaN is not stored (SQLite turns it into NULL); the parsers never produce it.

``PRAGMA user_version`` holds the schema version: ``_MIGRATIONS[n]`` takes a database from
version n to n + 1, inside one transaction. A database newer than this code is refused and
left untouched.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, TypeVar, cast
from urllib.parse import quote

from vkvagent.adapters.probe import ProbeResult
from vkvagent.engine.samples import GpuReading, Histogram, Sample, UnitFacts, VllmMetrics
from vkvagent.errors import NeedsOperator, VkvagentError

FILE_NAME = "history.sqlite3"

_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (  # 1: the first schema
        "CREATE TABLE histogram_layouts (id INTEGER PRIMARY KEY, bounds TEXT NOT NULL UNIQUE)",
        "CREATE TABLE cache_configs (id INTEGER PRIMARY KEY, json TEXT NOT NULL UNIQUE)",
        """CREATE TABLE samples (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            mono REAL NOT NULL,
            vllm_error TEXT,
            gpu_error TEXT,
            flavor TEXT,  -- NULL when the sample has no vLLM metrics
            version TEXT,
            models TEXT,
            engines INTEGER,
            kv_cache_usage REAL,
            kv_cache_usage_max REAL,
            num_requests_running REAL,
            num_requests_waiting REAL,
            num_preemptions_total REAL,
            generation_tokens_total REAL,
            prompt_tokens_total REAL,
            request_success_total REAL,
            prefix_cache_queries_total REAL,
            prefix_cache_hits_total REAL,
            prefix_cache_unit TEXT,
            prefix_cache_hit_rate REAL,
            engine_steps_total REAL,
            process_start_time REAL,
            time_to_first_token_layout INTEGER REFERENCES histogram_layouts (id),
            time_to_first_token TEXT,  -- JSON array of cumulative counts
            time_to_first_token_sum REAL,
            inter_token_latency_layout INTEGER REFERENCES histogram_layouts (id),
            inter_token_latency TEXT,
            inter_token_latency_sum REAL,
            cache_config INTEGER REFERENCES cache_configs (id),
            warnings TEXT
        )""",
        "CREATE INDEX samples_time ON samples (time)",
        """CREATE TABLE gpu_samples (
            sample_id INTEGER NOT NULL REFERENCES samples (id),
            position INTEGER NOT NULL,  -- order within the sample's readings
            gpu_index INTEGER NOT NULL,
            uuid TEXT NOT NULL,
            name TEXT NOT NULL,
            memory_used_bytes INTEGER,
            memory_total_bytes INTEGER,
            utilization_percent REAL,
            temperature_c REAL,
            power_w REAL,
            power_limit_w REAL,
            sm_clock_mhz REAL,
            sm_clock_max_mhz REAL,
            clock_event_reasons TEXT,
            ecc_uncorrected_volatile INTEGER,
            xid_errors TEXT,
            PRIMARY KEY (sample_id, position)
        ) WITHOUT ROWID""",
    ),
    (  # 2: the vLLM unit as systemd saw it (restart detection, memory growth)
        "ALTER TABLE samples ADD COLUMN unit_active_state TEXT",
        "ALTER TABLE samples ADD COLUMN unit_sub_state TEXT",
        "ALTER TABLE samples ADD COLUMN unit_invocation_id TEXT",
        "ALTER TABLE samples ADD COLUMN unit_main_pid INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_memory_bytes INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_n_restarts INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_error TEXT",
    ),
    (  # 3: the active probe; hung (silent) scrapes; the unit's anonymous memory and start
        """CREATE TABLE probes (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            mono REAL NOT NULL,
            outcome TEXT NOT NULL,
            latency REAL NOT NULL,
            detail TEXT
        )""",
        "CREATE INDEX probes_time ON probes (time)",
        "ALTER TABLE samples ADD COLUMN vllm_silent INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_memory_anon_bytes INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_active_since REAL",
    ),
    (  # 4: the unit's MemoryMax, the limit a memory leak is timed against
        "ALTER TABLE samples ADD COLUMN unit_memory_max_bytes INTEGER",
    ),
    (  # 5: the API's answers and its 5xx, for the availability objective ([slo])
        "ALTER TABLE samples ADD COLUMN http_requests_total REAL",
        "ALTER TABLE samples ADD COLUMN http_5xx_total REAL",
    ),
    (  # 6: what keeps vLLM up: its Restart=, whether it is wanted, how it last exited
        "ALTER TABLE samples ADD COLUMN unit_restart_policy TEXT",
        "ALTER TABLE samples ADD COLUMN unit_wanted INTEGER",
        "ALTER TABLE samples ADD COLUMN unit_last_exit TEXT",
    ),
)

# VllmMetrics fields stored as they are, tuples stored as JSON, and histograms.
_VLLM_PLAIN = (
    "flavor", "version", "engines", "kv_cache_usage", "kv_cache_usage_max",
    "num_requests_running", "num_requests_waiting", "num_preemptions_total",
    "generation_tokens_total", "prompt_tokens_total", "request_success_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_unit",
    "prefix_cache_hit_rate", "engine_steps_total", "process_start_time",
    "http_requests_total", "http_5xx_total",
)  # fmt: skip
_VLLM_TUPLES = ("models", "warnings")
_HISTOGRAMS = ("time_to_first_token", "inter_token_latency")
_VLLM_COLUMNS = (
    *_VLLM_PLAIN, *_VLLM_TUPLES,
    *(column for h in _HISTOGRAMS for column in (h + "_layout", h, h + "_sum")),
    "cache_config",
)  # fmt: skip
_UNIT_FIELDS = (
    "active_state", "sub_state", "invocation_id", "main_pid", "memory_bytes", "n_restarts",
    "memory_anon_bytes", "active_since", "memory_max_bytes", "restart_policy", "wanted",
    "last_exit",
)  # fmt: skip
_UNIT_COLUMNS = (*("unit_" + name for name in _UNIT_FIELDS), "unit_error")
_SAMPLE_COLUMNS = (
    "time", "mono", "vllm_error", "vllm_silent", "gpu_error", *_VLLM_COLUMNS, *_UNIT_COLUMNS,
)  # fmt: skip
_GPU_PLAIN = (
    "uuid", "name", "memory_used_bytes", "memory_total_bytes", "utilization_percent",
    "temperature_c", "power_w", "power_limit_w", "sm_clock_mhz", "sm_clock_max_mhz",
    "ecc_uncorrected_volatile",
)  # fmt: skip
_GPU_TUPLES = ("clock_event_reasons", "xid_errors")
_GPU_COLUMNS = ("gpu_index", *_GPU_PLAIN, *_GPU_TUPLES)

_INSERT_SAMPLE = (
    f"INSERT INTO samples ({', '.join(_SAMPLE_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _SAMPLE_COLUMNS)})"
)
_INSERT_GPU = (
    f"INSERT INTO gpu_samples (sample_id, position, {', '.join(_GPU_COLUMNS)}) "
    f"VALUES (:sample_id, :position, {', '.join(':' + c for c in _GPU_COLUMNS)})"
)
# {inner} selects the wanted samples; each comes back once per GPU reading (or once, if none).
_SELECT = (
    f"SELECT s.id, {', '.join('s.' + c for c in _SAMPLE_COLUMNS)}, "
    f"{', '.join('g.' + c for c in _GPU_COLUMNS)} "
    "FROM ({inner}) AS s LEFT JOIN gpu_samples AS g ON g.sample_id = s.id "
    "ORDER BY s.time, s.id, g.position"
)

_T = TypeVar("_T")


class HistoryError(VkvagentError):
    """The history cannot be opened, read or written; the message is one line naming the file."""


class NewerHistoryError(HistoryError, NeedsOperator):
    """The history's schema is newer than this code's: a downgrade. It is left untouched."""


class History:
    """The sample store in ``state_dir``. The daemon opens it writable (creating and migrating
    it); other processes open it with ``readonly=True``, which never creates or changes it."""

    def __init__(
        self, state_dir: str | Path, *, readonly: bool = False, busy_timeout: float = 5.0
    ) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.readonly = readonly
        # Values stored once: text -> id for writing, id -> value for reading.
        self._layout_ids: dict[str, int] = {}
        self._config_ids: dict[str, int] = {}
        self._layouts: dict[int, tuple[float, ...]] = {}
        self._configs: dict[int, Mapping[str, str]] = {}
        self._db: sqlite3.Connection | None = None
        with self._errors("cannot open"):
            self._db = self._connect(busy_timeout)
            try:
                self._prepare()
            except BaseException:
                self.close()
                raise

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def append(self, sample: Sample) -> int:
        """Store one sample, all of it or nothing; returns its row id."""
        with self._write("cannot append") as db:
            row = {
                "time": sample.time,
                "mono": sample.mono,
                "vllm_error": sample.vllm_error,
                "vllm_silent": sample.vllm_silent,
                "gpu_error": sample.gpu_error,
                **self._vllm_row(db, sample.vllm),
                **_unit_row(sample),
            }
            sample_id = cast(int, db.execute(_INSERT_SAMPLE, row).lastrowid)
            db.executemany(
                _INSERT_GPU,
                [_gpu_row(gpu, sample_id, position) for position, gpu in enumerate(sample.gpus)],
            )
        return sample_id

    def append_probe(self, probe: ProbeResult) -> None:
        """Store one finished probe."""
        with self._write("cannot append") as db:
            db.execute(
                "INSERT INTO probes (time, mono, outcome, latency, detail) VALUES (?, ?, ?, ?, ?)",
                (probe.time, probe.sent, probe.outcome, probe.latency, probe.detail or None),
            )

    def probes(self, since: float = -math.inf, until: float = math.inf) -> list[ProbeResult]:
        """The probes sent from ``since`` to ``until`` (inclusive), oldest first."""
        db = self._connection()
        with self._errors("cannot read"):
            rows = db.execute(
                "SELECT mono, time, outcome, latency, detail FROM probes "
                "WHERE time >= ? AND time <= ? ORDER BY time, id",
                (since, until),
            ).fetchall()
        return [ProbeResult(m, t, o, lat, d or "") for m, t, o, lat, d in rows]

    def samples(
        self, since: float = -math.inf, until: float = math.inf, limit: int | None = None
    ) -> list[Sample]:
        """The samples taken from ``since`` to ``until`` (inclusive), oldest first; with
        ``limit``, only the oldest ``limit`` of them."""
        inner = "SELECT * FROM samples WHERE time >= ? AND time <= ? ORDER BY time, id LIMIT ?"
        return self._read(inner, (since, until, -1 if limit is None else limit))

    def latest(self) -> Sample | None:
        found = self._read("SELECT * FROM samples ORDER BY time DESC, id DESC LIMIT 1", ())
        return found[0] if found else None

    def prune(self, now: float, retention_days: float) -> int:
        """Delete the samples taken before ``now - retention_days``; returns how many."""
        cutoff = (now - retention_days * 86400.0,)
        with self._write("cannot prune") as db:
            db.execute(
                "DELETE FROM gpu_samples WHERE sample_id IN "
                "(SELECT id FROM samples WHERE time < ?)",
                cutoff,
            )
            deleted = db.execute("DELETE FROM samples WHERE time < ?", cutoff).rowcount
            db.execute("DELETE FROM probes WHERE time < ?", cutoff)
        return deleted

    # -- opening ----------------------------------------------------------------------------

    def _connect(self, busy_timeout: float) -> sqlite3.Connection:
        if self.readonly:
            try:
                found = self.path.is_file()
            except OSError as exc:  # a directory this user may not enter
                raise HistoryError(f"{self.path}: cannot read: {exc.strerror}") from None
            if not found:
                raise HistoryError(f"{self.path}: no history database (has the daemon run?)")
            return sqlite3.connect(
                f"file:{quote(str(self.path))}?mode=ro",
                uri=True,
                timeout=busy_timeout,
                isolation_level=None,
            )
        try:
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryError(f"{self.path.parent}: cannot create: {exc.strerror}") from None
        try:
            # Owner and group only, whatever the umask (the -wal and -shm files follow it).
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640))
        except OSError as exc:
            raise HistoryError(f"{self.path}: cannot open: {exc.strerror}") from None
        # The daemon opens it in one thread and writes from its scheduler's, one at a time.
        return sqlite3.connect(
            str(self.path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )

    def _prepare(self) -> None:
        """Check the schema version, then (writable only) switch to WAL and migrate. Nothing
        is written before the version is known to be one this code understands."""
        db, latest = self._connection(), len(_MIGRATIONS)
        version = _user_version(db)
        if version > latest:
            raise NewerHistoryError(
                f"{self.path}: history database schema {version} is newer than this vkvagent "
                f"supports ({latest})"
            )
        if self.readonly:
            if version < latest:
                raise HistoryError(
                    f"{self.path}: history database schema {version} is older than this "
                    f"vkvagent reads ({latest}); the daemon upgrades it when it starts"
                )
            return
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = NORMAL")
        # The daemon only appends: 512 KiB of page cache, not SQLite's 2 MiB default (RSS).
        db.execute("PRAGMA cache_size = -512")
        if version < latest:
            with self._write("cannot migrate"):
                # Read again under the write lock: another process may have migrated it since.
                for number in range(_user_version(db), latest):
                    for statement in _MIGRATIONS[number]:
                        db.execute(statement)
                    db.execute(f"PRAGMA user_version = {number + 1}")

    # -- writing ----------------------------------------------------------------------------

    def _vllm_row(self, db: sqlite3.Connection, m: VllmMetrics | None) -> dict[str, Any]:
        if m is None:
            return dict.fromkeys(_VLLM_COLUMNS)
        row: dict[str, Any] = {name: getattr(m, name) for name in _VLLM_PLAIN}
        row.update((name, _pack(getattr(m, name))) for name in _VLLM_TUPLES)
        for name in _HISTOGRAMS:
            histogram: Histogram | None = getattr(m, name)
            if histogram is None:
                row.update(dict.fromkeys((name + "_layout", name, name + "_sum")))
                continue
            bounds = _floats_text(histogram.bounds)
            row[name + "_layout"] = self._intern(
                db, "histogram_layouts", "bounds", bounds, self._layout_ids
            )
            row[name] = _floats_text(histogram.cumulative)
            row[name + "_sum"] = histogram.sum
        config = json.dumps(dict(m.cache_config), sort_keys=True, **_COMPACT)
        row["cache_config"] = self._intern(db, "cache_configs", "json", config, self._config_ids)
        return row

    def _intern(
        self, db: sqlite3.Connection, table: str, column: str, text: str, ids: dict[str, int]
    ) -> int:
        """The id of ``text`` in a table of values stored once, adding it if it is new."""
        if text not in ids:
            db.execute(f"INSERT OR IGNORE INTO {table} ({column}) VALUES (?)", (text,))
            query = f"SELECT id FROM {table} WHERE {column} = ?"
            ids[text] = db.execute(query, (text,)).fetchone()[0]
        return ids[text]

    # -- reading ----------------------------------------------------------------------------

    def _read(self, inner: str, params: tuple[Any, ...]) -> list[Sample]:
        db = self._connection()
        width = len(_SAMPLE_COLUMNS)
        heads: dict[int, dict[str, Any]] = {}
        gpus: dict[int, list[GpuReading]] = {}
        with self._errors("cannot read"):
            for row in db.execute(_SELECT.format(inner=inner), params).fetchall():
                sample_id = row[0]
                if sample_id not in heads:
                    heads[sample_id] = dict(zip(_SAMPLE_COLUMNS, row[1 : width + 1]))
                    gpus[sample_id] = []
                if row[width + 1] is not None:
                    gpus[sample_id].append(_gpu(dict(zip(_GPU_COLUMNS, row[width + 1 :]))))
            return [
                Sample(
                    time=head["time"],
                    mono=head["mono"],
                    vllm=None if head["flavor"] is None else self._vllm(db, head),
                    vllm_error=head["vllm_error"],
                    gpus=tuple(gpus[sample_id]),
                    gpu_error=head["gpu_error"],
                    unit=_unit(head),
                    unit_error=head["unit_error"],
                    vllm_silent=bool(head["vllm_silent"]),
                )
                for sample_id, head in heads.items()
            ]

    def _vllm(self, db: sqlite3.Connection, row: dict[str, Any]) -> VllmMetrics:
        values: dict[str, Any] = {name: row[name] for name in _VLLM_PLAIN}
        values.update((name, _unpack(row[name])) for name in _VLLM_TUPLES)
        for name in _HISTOGRAMS:
            layout = row[name + "_layout"]
            values[name] = None if layout is None else Histogram(
                bounds=_lookup(db, "histogram_layouts", "bounds", layout, self._layouts, _floats),
                cumulative=_floats(row[name]),
                sum=row[name + "_sum"],
            )  # fmt: skip
        values["cache_config"] = _lookup(
            db, "cache_configs", "json", row["cache_config"], self._configs, _mapping
        )
        return VllmMetrics(**values)

    # -- transactions and errors ------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise HistoryError(f"{self.path}: the history is closed")
        return self._db

    @contextmanager
    def _write(self, doing: str) -> Iterator[sqlite3.Connection]:
        """One transaction: committed whole, or rolled back whole (the id caches with it)."""
        db = self._connection()
        with self._errors(doing):
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
                db.execute("COMMIT")
            except BaseException:
                self._layout_ids.clear()
                self._config_ids.clear()
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        try:
            yield
        except (sqlite3.Error, OverflowError) as exc:  # OverflowError: int beyond 64 bits
            reason = (str(exc) or type(exc).__name__).splitlines()[0]
            raise HistoryError(f"{self.path}: {doing}: {reason}") from None


_COMPACT: dict[str, Any] = {"separators": (",", ":"), "ensure_ascii": False}


def _user_version(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def _lookup(
    db: sqlite3.Connection,
    table: str,
    column: str,
    row_id: int,
    cache: dict[int, _T],
    decode: Callable[[str], _T],
) -> _T:
    """A value stored once, by id; the whole (small) table is loaded when one is missing."""
    if row_id not in cache:
        for found_id, text in db.execute(f"SELECT id, {column} FROM {table}"):
            cache[found_id] = decode(text)
    return cache[row_id]


def _unit_row(sample: Sample) -> dict[str, Any]:
    facts = sample.unit
    row = {"unit_" + name: None if facts is None else getattr(facts, name) for name in _UNIT_FIELDS}
    row["unit_error"] = sample.unit_error
    return row


def _unit(row: dict[str, Any]) -> UnitFacts | None:
    if row["unit_active_state"] is None:
        return None
    facts = {name: row["unit_" + name] for name in _UNIT_FIELDS}
    # Columns added after a row was written read as their field's default.
    facts["restart_policy"] = facts["restart_policy"] or ""
    facts["last_exit"] = facts["last_exit"] or ""
    facts["wanted"] = None if facts["wanted"] is None else bool(facts["wanted"])
    return UnitFacts(**facts)


def _gpu_row(gpu: GpuReading, sample_id: int, position: int) -> dict[str, Any]:
    row: dict[str, Any] = {"sample_id": sample_id, "position": position, "gpu_index": gpu.index}
    row.update((name, getattr(gpu, name)) for name in _GPU_PLAIN)
    row.update((name, _pack(getattr(gpu, name))) for name in _GPU_TUPLES)
    return row


def _gpu(row: dict[str, Any]) -> GpuReading:
    values = {name: row[name] for name in _GPU_PLAIN}
    values.update((name, _unpack(row[name])) for name in _GPU_TUPLES)
    return GpuReading(index=row["gpu_index"], **values)


def _pack(values: tuple[Any, ...]) -> str | None:
    return json.dumps(values, **_COMPACT) if values else None


def _unpack(text: str | None) -> tuple[Any, ...]:
    return tuple(json.loads(text)) if text is not None else ()


def _floats_text(values: tuple[float, ...]) -> str:
    """Floats as a JSON array. JSON has no Infinity, so non-finite values (the +Inf bound)
    are written as strings that ``float()`` reads back; whole numbers lose their ``.0``."""
    out: list[int | float | str] = []
    for value in map(float, values):
        if not math.isfinite(value):
            out.append(str(value))
        elif value.is_integer() and abs(value) < 2.0**53:
            out.append(int(value))
        else:
            out.append(value)
    return json.dumps(out, separators=(",", ":"))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(map(float, json.loads(text)))


def _mapping(text: str) -> Mapping[str, str]:
    return MappingProxyType(json.loads(text))
