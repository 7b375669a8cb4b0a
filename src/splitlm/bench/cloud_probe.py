"""What a bench reads off a running cloud subprocess: its `/metrics` (the Prometheus text, parsed with
`prometheus_client`'s parser) and, through `psutil`, its CPU time and resident memory.

    probe = CloudProbe.for_port(port)        # the `serve-cloud` child of this process on that port
    a = probe.snapshot(); ...; b = probe.snapshot()
    b.delta(a, "splitlm_cloud_pass_seconds_count")      # passes between the two
"""

from __future__ import annotations

import logging
import time
import urllib.request
from dataclasses import dataclass, field

import psutil
from prometheus_client.parser import text_string_to_metric_families

from splitlm import SplitLMError

log = logging.getLogger(__name__)

# The cloud's series a capacity run reads (`splitlm.cloud.metrics`)
PASSES = "splitlm_cloud_pass_seconds_count"
PASS_SECONDS = "splitlm_cloud_pass_seconds_sum"
PASS_ROWS = "splitlm_cloud_batch_rows_sum"
PASS_PHASES = {phase: f"splitlm_cloud_pass_{phase}_seconds_total" for phase in ("begin", "layers", "finish")}
PASS_SESSIONS = "splitlm_cloud_batch_size_sum"
FORWARDS = "splitlm_cloud_round_trips_total"
QUEUE_SECONDS = "splitlm_cloud_queue_seconds_sum"
QUEUE_COUNT = "splitlm_cloud_queue_seconds_count"
SESSIONS = "splitlm_cloud_sessions"
KV_BYTES = "splitlm_cloud_kv_reserved_bytes"
ERRORS = "splitlm_cloud_errors_total"


def scrape(port: int, timeout_s: float = 10.0) -> dict[str, float]:
    """The cloud's `/metrics` as {sample name: value}, samples with labels summed over them
    (`splitlm_cloud_errors_total` is every code's errors)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


@dataclass
class Snapshot:
    """A cloud's metrics, CPU seconds and RSS at one moment."""

    at: float  # perf_counter()
    metrics: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0  # user + system, the process and its children
    rss: int = 0  # bytes
    rss_file: int = 0  # bytes of `rss` that map files (the weights; the kernel may drop and re-read them)

    def delta(self, before: Snapshot, name: str) -> float:
        return self.metrics.get(name, 0.0) - before.metrics.get(name, 0.0)

    def value(self, name: str) -> float | None:
        return self.metrics.get(name)


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of `proc` and its live children."""
    total = 0.0
    for p in (proc, *proc.children(recursive=True)):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


class CloudProbe:
    """Reads one cloud process (`pid`) that serves on `port`."""

    def __init__(self, port: int, pid: int):
        self.port, self.proc = port, psutil.Process(pid)

    @classmethod
    def for_port(cls, port: int) -> CloudProbe:
        """The probe of the `serve-cloud --port PORT` child of this process."""
        for child in psutil.Process().children(recursive=True):
            try:
                args = child.cmdline()
            except psutil.Error:
                continue
            if "serve-cloud" in args and str(port) in args:
                return cls(port, child.pid)
        raise SplitLMError(f"no serve-cloud child process on port {port}")

    def snapshot(self) -> Snapshot:
        rss, rss_file = self.memory()
        return Snapshot(time.perf_counter(), scrape(self.port), cpu_seconds(self.proc), rss, rss_file)

    def memory(self) -> tuple[int, int]:
        """(RSS, its file-backed part) in bytes; psutil's `shared` on Linux is RssFile + RssShmem."""
        try:
            info = self.proc.memory_info()
        except psutil.Error:
            return 0, 0
        return info.rss, getattr(info, "shared", 0)


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` and its children (0 once it is gone)."""
    try:
        return cpu_seconds(psutil.Process(pid))
    except psutil.Error:
        return 0.0


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads."""
    t = psutil.Process().cpu_times()
    return t.user + t.system
