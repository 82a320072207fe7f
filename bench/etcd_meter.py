"""What etcd spends, for the fleet benchmarks: its CPU (its /proc stat) and what its /metrics
count (the bytes its gRPC server sent: the JSON gateway is a gRPC client of it; the
database's size in use)."""

from __future__ import annotations

import os
import re
import urllib.request
from pathlib import Path

from tests.etcd import Etcd

SENT = "etcd_network_client_grpc_sent_bytes_total"
IN_USE = "etcd_mvcc_db_total_size_in_use_in_bytes"
TICKS = os.sysconf("SC_CLK_TCK")
SETTLE = 0.5  # seconds for etcd to commit its backend (every 100 ms) before it is measured


class EtcdMeter:
    """etcd's CPU seconds and its /metrics, read on demand."""

    def __init__(self, etcd: Etcd) -> None:
        assert etcd.process is not None
        self.pid, self.url, self.port = etcd.process.pid, etcd.url, etcd.port

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as answer:
            page = answer.read().decode()
        values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", page, re.MULTILINE)
        return sum(float(v) for v in values)
