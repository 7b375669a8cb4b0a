"""The cloud's capacity curve: `splitlm loadtest --virtual-edges` (virtual edges, `splitlm.bench.virtual`).

    splitlm loadtest --virtual-edges --sessions 1,2,4,8,16,32,64 --rtt-ms 80 --json
    splitlm loadtest --virtual-edges --shape tinyllama-1.1b --cloud-dtype bf16 --sessions 1,4,16,64

1. The trace: real edges (`--spec auto`, greedy, fp32 wire, every prompt of `benchmarks/prompts.json`
   alone, behind the WAN emulator at `--rtt-ms`) recorded once and cached under
   `$SPLITLM_CACHE/traces/` (`splitlm.bench.trace`); `--trace FILE` replays a saved one instead.
   With `--shape` the target is a random-weight checkpoint of a real model's shape
   (`splitlm.model.synthetic`), and the trace is the bundled model's: the step structure of real
   text (trees, acceptance), replayed at the target's hidden size.
2. Two clouds started here as `serve-cloud --threads 1` subprocesses on the same shard, device and
   dtype: `--max-batch B` (batched) and `--max-batch 1`, each behind its own WAN emulator.
3. For each N of `--sessions`, batched then unbatched: N virtual edges replay the trace for
   `--warmup-s` (not counted), then `--seconds` are measured: accepted tokens/s (the tokens the
   recorded edges produced per reply, summed over replies that came in the window), step latency
   (a FORWARD's send to its RESULT, the emulated RTT included), the cloud's passes, rows and
   sessions per pass and queue time (its `/metrics`, differenced over the window), its RSS and KV
   bytes (at the window's end), errors, and CPU seconds of this process (the generator and the
   WAN emulator) and of the cloud (`psutil`), whence `client_cpu_share`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from splitlm import SplitLMError
from splitlm.bench.setup import DEFAULT_OUT

if TYPE_CHECKING:  # torch, psutil and websockets load when a curve runs, not when the CLI parses
    from splitlm.bench.cloud_probe import CloudProbe, Snapshot
    from splitlm.bench.trace import Trace
    from splitlm.bench.virtual import Target

log = logging.getLogger(__name__)

SIDES = ("batched", "unbatched")


@dataclass
class CapacityConfig:
    sessions: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    rtt_ms: float = 80.0
    seconds: float = 20.0  # measured per point
    warmup_s: float = 8.0  # per point, before the measurement
    max_batch: int = 16  # the batched cloud's --max-batch (serve-cloud's default)
    spec: str = "auto"  # the recorded edges' mode
    max_new_tokens: int = 64  # per recorded generation
    edge: str = ""  # the target's edge shard (its sibling cloud/ is served); "" = split --model here
    model: str = "default"
    shape: str = ""  # a synthetic shape (`splitlm.model.synthetic.SHAPES`) as the target instead
    head: int = 2
    tail: int | None = None
    trace: str = ""  # a saved trace to replay ("" = record, or take the cached one)
    trace_edge: str = ""  # the edge shard whose trace is recorded ("" = the target's; the bundled model's with --shape)
    cloud_device: str = "cpu"
    cloud_dtype: str = "fp32"
    prefill_chunk: int = 64
    prompts: str = ""
    out: str = str(DEFAULT_OUT)
    json: bool = False


@dataclass
class Shards:
    edge: Path  # the target's edge shard (fingerprint, hidden size, split layer)
    cloud: Path  # what the clouds serve
    trace_edge: Path | None = None  # whose steps are recorded (None: a saved trace is replayed)
    trace_cloud: Path | None = None


def synthetic_checkpoint(config: CapacityConfig) -> str:
    """The random-weight checkpoint of `--shape` (made once, on the clouds' GPU where they run on one)."""
    from splitlm.model.synthetic import SHAPES, synthetic_model

    if config.shape not in SHAPES:
        raise SplitLMError(f"unknown --shape {config.shape!r} (choose from {', '.join(SHAPES)})")
    device = config.cloud_device if config.cloud_device.startswith("cuda") else "cpu"
    return str(synthetic_model(SHAPES[config.shape], device=device))


def resolve_shards(config: CapacityConfig) -> Shards:
    """The target's shards and, unless `--trace` names a saved trace, the recorded edge's."""
    from splitlm.bench.loadtest import LoadConfig, shard_dirs

    if config.shape and config.edge:
        raise SplitLMError(
            "--shape makes the target from a random checkpoint: name the edge whose steps are "
            "replayed with --trace-edge, not --edge"
        )
    model = synthetic_checkpoint(config) if config.shape else config.model
    shards = Shards(*shard_dirs(LoadConfig(edge=config.edge, model=model, head=config.head, tail=config.tail)))
    if config.trace:
        return shards
    if config.trace_edge:
        shards.trace_edge, shards.trace_cloud = shard_dirs(LoadConfig(edge=config.trace_edge))
    elif config.shape:  # the bundled model's steps
        shards.trace_edge, shards.trace_cloud = shard_dirs(LoadConfig(head=config.head, tail=config.tail))
    else:
        shards.trace_edge, shards.trace_cloud = shards.edge, shards.cloud
    return shards


def prompt_ids(edge_dir: Path, prompts_path: str, vocab_size: int) -> list[tuple[str, list[int]]]:
    """(id, token ids) of every prompt, tokenized as the edge does; without a tokenizer (test
    models) eight prompts of ids."""
    from splitlm.bench.prompts import default_prompts_path, load_prompts, tokenize
    from splitlm.edge.text import load_tokenizer

    tokenizer = load_tokenizer(edge_dir)
    if tokenizer is None:
        return [(f"ids-{i}", [(7 * i + 3 * j) % (vocab_size - 3) + 3 for j in range(3 + i % 5)]) for i in range(8)]
    prompts = load_prompts(prompts_path or default_prompts_path())
    tokenize(prompts, tokenizer)
    return [(p.id, p.ids) for p in prompts]


def model_facts(edge_dir: Path) -> tuple[str, int, int, int]:
    """(fingerprint, hidden size, vocabulary size, the cloud's first layer) of an edge shard."""
    from splitlm.model.config import ModelConfig
    from splitlm.model.shards import Manifest

    manifest = Manifest.read(edge_dir, "edge")
    cfg = ModelConfig.from_hf(json.loads((edge_dir / "config.json").read_text()))
    return manifest.fingerprint, cfg.hidden_size, cfg.vocab_size, manifest.head


@contextlib.contextmanager
def behind_wan(port: int, rtt_ms: float):
    """The URL of the cloud on `port`, behind a WAN emulator at `rtt_ms` (none at 0)."""
    if rtt_ms <= 0:
        yield f"ws://127.0.0.1:{port}"
        return
    from splitlm.bench.wan import WanConfig, WanEmulator

    with WanEmulator(upstream=("127.0.0.1", port), config=WanConfig(rtt_ms, seed=0)) as wan:
        yield wan.url_for("ws")


@contextlib.contextmanager
def wan_process(port: int, rtt_ms: float):
    """A WAN emulator subprocess (`splitlm wan`'s) in front of the cloud on `port`: its CPU is the
    network's, not the generator's. Yields (its URL, its pid)."""
    import socket
    import subprocess
    import sys

    from splitlm.cloud.local import free_port, stop

    listen = free_port()
    # `splitlm wan`'s machinery without the CLI's imports (torch): the emulator alone, started in a blink
    code = (
        "import asyncio, sys; from splitlm.bench.wan import WanConfig, run_wan; "
        "asyncio.run(run_wan(sys.argv[1], sys.argv[2], WanConfig(float(sys.argv[3]), seed=0)))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, f"127.0.0.1:{listen}", f"127.0.0.1:{port}", str(rtt_ms)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", listen), timeout=1):
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SplitLMError("the WAN emulator (splitlm wan) did not start")
            time.sleep(0.1)
        yield f"ws://127.0.0.1:{listen}", proc.pid
    finally:
        stop(proc)


def obtain_trace(config: CapacityConfig, shards: Shards) -> tuple[Trace, str]:
    """The trace to replay and where it is kept: `--trace`, the cached one, or one recorded now."""
    from splitlm.bench.trace import (
        Trace,
        cached_trace_path,
        prompts_digest,
        record_trace,
        spec_label,
        trace_key,
    )
    from splitlm.cloud.local import cloud_process
    from splitlm.edge import Edge, EdgeConfig
    from splitlm.edge.runtime import as_spec

    if config.trace:
        return Trace.load(config.trace), config.trace
    fingerprint, _, vocab, _ = model_facts(shards.trace_edge)
    spec = as_spec(config.spec)
    prompts = prompt_ids(shards.trace_edge, config.prompts, vocab)
    path = cached_trace_path(
        trace_key(fingerprint, spec_label(spec), prompts_digest(prompts), config.rtt_ms, config.max_new_tokens, "fp32")
    )
    if path.is_file():
        log.info("[capacity] replaying the cached trace %s", path)
        return Trace.load(path), str(path)
    log.info(
        "[capacity] recording the step trace of %d prompts at %g ms (once; cached in %s)",
        len(prompts),
        config.rtt_ms,
        path,
    )
    with (
        cloud_process(shards.trace_cloud, "cpu", "fp32", ["--prefill-chunk", str(config.prefill_chunk)]) as port,
        behind_wan(port, config.rtt_ms) as url,
        Edge(shards.trace_edge, url, EdgeConfig(wire_dtype="fp32", device="cpu", dtype="fp32")) as edge,
    ):
        trace = record_trace(edge, prompts, spec, config.max_new_tokens, config.rtt_ms)
    trace.save(path)
    return trace, str(path)


def cloud_args(config: CapacityConfig, side: str) -> list[str]:
    n = max(config.sessions) + 2  # every virtual edge has the same client key
    return [
        "--max-batch",
        str(config.max_batch if side == "batched" else 1),
        "--prefill-chunk",
        str(config.prefill_chunk),
        "--max-sessions-per-client",
        str(n),
        "--max-sessions",
        str(max(64, n)),
    ]


@dataclass
class Cloud:
    """One cloud of the curve: its probe, the URL the virtual edges use (its WAN emulator's) and that
    emulator's process id (None: no emulator)."""

    side: str
    probe: CloudProbe
    url: str
    args: list[str]
    wan_pid: int | None = None

    def wan_cpu_s(self) -> float:
        from splitlm.bench.cloud_probe import process_cpu_seconds

        return process_cpu_seconds(self.wan_pid) if self.wan_pid else 0.0


@dataclass
class Window:
    """The measured window of one point: its bounds and the CPU seconds spent in it."""

    before: Snapshot
    after: Snapshot
    client_cpu_s: float = 0.0  # this process: the virtual edges
    wan_cpu_s: float = 0.0  # the WAN emulator's process

    @property
    def seconds(self) -> float:
        return self.after.at - self.before.at

    @property
    def cloud_cpu_s(self) -> float:
        return self.after.cpu_s - self.before.cpu_s


@dataclass
class Replay:
    """Virtual edges running against one cloud until `stop` is set; `stuck`: those that did not end."""

    edges: list
    stop: threading.Event
    stuck: int = 0


@contextlib.contextmanager
def replaying(cloud: Cloud, target: Target, trace: Trace, n: int):
    """N virtual edges replaying `trace` against `cloud` while the block runs; stopped and joined after it."""
    from splitlm.bench.virtual import Target, join_edges, start_edges

    stop = threading.Event()
    replay = Replay(
        start_edges(Target(cloud.url, target.fingerprint, target.hidden_size, target.split), trace, n, stop), stop
    )
    try:
        yield replay
    finally:
        stop.set()
        replay.stuck = join_edges(replay.edges)


def warm(cloud: Cloud, target: Target, trace: Trace, n: int, seconds: float) -> None:
    """N virtual edges against `cloud` for `seconds`, nothing measured: a fresh cloud's first passes
    (a GPU's kernel selection, its allocator) stay out of the first point."""
    with replaying(cloud, target, trace, n) as replay:
        replay.stop.wait(seconds)
    log.info(f"[capacity] {cloud.side} cloud warmed by {n} sessions for {seconds:g} s")


def run_point(cloud: Cloud, target: Target, trace: Trace, n: int, config: CapacityConfig) -> dict:
    """N virtual edges against one cloud: warm-up, then the measured window."""
    from splitlm.bench.capacity_report import point_figures
    from splitlm.bench.cloud_probe import own_cpu_seconds

    with replaying(cloud, target, trace, n) as replay:
        replay.stop.wait(config.warmup_s)
        cpu0, wan0, before = own_cpu_seconds(), cloud.wan_cpu_s(), cloud.probe.snapshot()
        replay.stop.wait(config.seconds)
        window = Window(before, cloud.probe.snapshot())
        window.client_cpu_s, window.wan_cpu_s = own_cpu_seconds() - cpu0, cloud.wan_cpu_s() - wan0
    result = point_figures(replay.edges, window)
    result["stuck_edges"] = replay.stuck
    log.info(
        f"[capacity] {n:>3} sessions {cloud.side:>9}: {result['aggregate_tok_s']} tok/s, step p50 "
        f"{result['step_latency_ms']['p50']} ms p99 {result['step_latency_ms']['p99']} ms, "
        f"{result['rows_per_pass']} rows / pass, pass ms begin/layers/finish "
        f"{'/'.join(str(v) for v in result['pass_phase_ms_mean'].values())}, errors {result['errors']}, "
        f"client CPU {result['client_cpu_share']}"
    )
    return result


@contextlib.contextmanager
def started_clouds(config: CapacityConfig, shards: Shards):
    """The batched and the `--max-batch 1` cloud, each behind its WAN emulator."""
    from splitlm.bench.cloud_probe import CloudProbe
    from splitlm.cloud.local import cloud_process

    with contextlib.ExitStack() as stack:
        clouds = []
        for side in SIDES:
            args = cloud_args(config, side)
            port = stack.enter_context(
                cloud_process(shards.cloud, config.cloud_device, config.cloud_dtype, args, timeout_s=600.0)
            )
            url, wan_pid = f"ws://127.0.0.1:{port}", None
            if config.rtt_ms > 0:
                url, wan_pid = stack.enter_context(wan_process(port, config.rtt_ms))
            clouds.append(Cloud(side, CloudProbe.for_port(port), url, args, wan_pid))
        yield clouds


def run_cpu(clouds: list[Cloud]) -> tuple[float, float, float]:
    """CPU seconds so far of (this process, the clouds, their WAN emulators)."""
    from splitlm.bench.cloud_probe import own_cpu_seconds

    return (own_cpu_seconds(), sum(c.probe.snapshot().cpu_s for c in clouds), sum(c.wan_cpu_s() for c in clouds))


def check(config: CapacityConfig) -> None:
    if not config.sessions or min(config.sessions) < 1:
        raise SplitLMError("--sessions: one or more counts, each at least 1")
    if config.seconds <= 0 or config.warmup_s < 0 or config.max_batch < 1:
        raise SplitLMError("--seconds must be > 0, --warmup-s >= 0 and --max-batch >= 1")


def run_capacity(config: CapacityConfig) -> dict:
    """The whole curve; returns its result document."""
    import torch

    from splitlm.bench.capacity_report import curve_doc
    from splitlm.bench.virtual import Target

    check(config)
    shards = resolve_shards(config)
    trace, trace_path = obtain_trace(config, shards)
    fingerprint, hidden, _, split = model_facts(shards.edge)
    target = Target("", fingerprint, hidden, split)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.time()
    try:
        with started_clouds(config, shards) as clouds:
            for cloud in clouds:
                warm(cloud, target, trace, max(config.sessions), config.warmup_s)
            cpu0 = run_cpu(clouds)
            curve = [
                {"sessions": n, **{c.side: run_point(c, target, trace, n, config) for c in clouds}}
                for n in config.sessions
            ]
            cpu = tuple(b - a for a, b in zip(cpu0, run_cpu(clouds), strict=True))
            args = {c.side: c.args for c in clouds}
    finally:
        torch.set_num_threads(threads)
    return curve_doc(config, started, trace, trace_path, shards, curve, cpu, args)
