"""`splitlm bench`: run a prompt set through decoding modes behind an emulated WAN and report.

    splitlm bench --rtt-ms 80                          # local-hf and split-seq, all prompts
    splitlm bench --sweep 20,40,80,120,200 --limit 4   # + the step-time model t = α·RTT + β

Set-up: the cloud shard is served by a `splitlm serve-cloud --threads 1` subprocess; the
edge (and the full `transformers` model used as reference and by `local-hf`) runs in this
process with `torch.set_num_threads(1)`; the WAN emulator is a thread of this process (an
asyncio proxy, idle while compute runs). Pinning keeps the two compute sides from stealing
each other's cores. Every RTT gets its own emulator and edge connection, all open at once; each
mode first decodes a few warm-up tokens there (not counted); then prompts are interleaved across
RTTs and modes (prompt 1 everywhere, then prompt 2, ...), so that machine noise hits all alike.
Results: `OUT/bench-<timestamp>.json` (+ `.md` and `-*.png`), and `OUT/results.json` (a copy
of the latest run's JSON).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitlm import SplitLMError, __version__
from splitlm.bench.modes import MODES, BenchContext, Mode
from splitlm.bench.prompts import Prompt
from splitlm.cloud.local import cloud_process, health
from splitlm.progress import bar, track
from splitlm.result_files import cpu_model, default_results_dir, time_stamp, write_result

log = logging.getLogger(__name__)

SCHEMA = "splitlm.bench/1"
DEFAULT_MODES = "local-hf,split-seq,auto"
HEAD_MODES = {"auto", "auto-zerocost", "head", "auto+json"}  # the modes that draft with the trained head


DEFAULT_OUT = default_results_dir()
WARMUP_TOKENS = 4


@dataclass
class BenchConfig:
    rtts_ms: list[float] = field(default_factory=lambda: [80.0])  # one RTT, or the sweep
    modes: list[str] = field(default_factory=lambda: DEFAULT_MODES.split(","))
    prompts: str = ""  # prompt file; "" = benchmarks/prompts.json
    max_new_tokens: int = 64
    out: str = str(DEFAULT_OUT)
    model: str = "default"
    head: int = 2
    tail: int | None = None  # None: 2 for tail-local, 0 for split-head
    wire_dtype: str = "auto"
    edge: str = ""  # a pre-split edge shard (its cloud shard is the sibling `cloud/`); "" = split `model` here
    topology: str = "tail-local"  # when splitting here: tail-local or split-head
    d_end: int | None = None  # split-head: LM-head columns on the edge (None = half the hidden size)
    vocab: str = "all"  # the edge's vocabulary subset: all, en, zh or an allow-list file
    jitter_ms: float = 0.0
    mbps: float | None = None
    limit: int | None = None
    memory: bool = True
    plots: bool = True
    codecs: list[str] = field(default_factory=list)  # codec study: bytes/token and agreement per wire codec
    device: str = "auto"  # the edge's device and compute dtype (this process)
    dtype: str = "auto"
    cloud_device: str | None = None  # the cloud's (None: as the edge's)
    cloud_dtype: str | None = None
    train_head: bool = True  # train the draft head once if modes need it and this model has none
    categories: list[str] | None = None  # Spec-Bench: these categories only
    per_category: int | None = None  # Spec-Bench: this many questions per category (`specbench.select`)
    mode_questions: dict[str, int] = field(default_factory=dict)  # Spec-Bench: a mode on fewer of those

    @property
    def sweep(self) -> bool:
        return len(self.rtts_ms) > 1


@contextlib.contextmanager
def link(port: int, rtt_ms: float, config: BenchConfig) -> Iterator[str]:
    """The URL of the cloud behind an emulated WAN (or the cloud itself at RTT 0 with no jitter/cap)."""
    if rtt_ms == 0 and not config.jitter_ms and config.mbps is None:
        yield f"ws://127.0.0.1:{port}"
        return
    from splitlm.bench.wan import WanConfig, WanEmulator

    wan_config = WanConfig(rtt_ms=rtt_ms, jitter_ms=config.jitter_ms, mbps=config.mbps, seed=0)
    with WanEmulator(upstream=("127.0.0.1", port), config=wan_config) as wan:
        yield wan.url_for("ws")


def resolve_split(config: BenchConfig, model_dir: Path):
    """(split directory, edge manifest) of the run: `--edge DIR`'s split, or one made (and cached) here."""
    from splitlm.model.loading import file_sha256, safetensors_files
    from splitlm.model.shards import Manifest, cached_split

    if config.edge:
        edge_dir = Path(config.edge)
        if not edge_dir.is_dir():
            raise SplitLMError(f"--edge {edge_dir}: no such directory")
        manifest = Manifest.read(edge_dir, "edge")
        cloud = Manifest.read(edge_dir.parent / "cloud", "cloud") if (edge_dir.parent / "cloud").is_dir() else None
        if cloud is None or cloud.fingerprint != manifest.fingerprint:
            raise SplitLMError(f"--edge {edge_dir}: its cloud shard must be the sibling directory "
                               f"{edge_dir.parent / 'cloud'} of the same split")
        if manifest.model_hash != file_sha256(safetensors_files(model_dir))[:32]:
            raise SplitLMError(f"--edge {edge_dir} was split from another model than --model {config.model} "
                               "(the reference)")
        return edge_dir.parent, manifest
    tail = config.tail if config.tail is not None else (0 if config.topology == "split-head" else 2)
    split_dir = cached_split(config.model, config.head, tail, config.topology, config.d_end)
    return split_dir, Manifest.read(split_dir / "edge", "edge")


def ensure_head(config: BenchConfig, model_dir: Path, edge_dir: Path, manifest, modes: list[str]) -> None:
    """Train the draft head once (`splitlm train-head`, cached for the model) when a mode drafts with it
    and neither the edge shard nor this machine has one; --no-train-head runs those modes without it."""
    import torch

    from splitlm.decoding.head import find_head
    from splitlm.decoding.train_head import train_head

    if not HEAD_MODES & set(modes) or find_head(edge_dir, manifest.model_hash) is not None:
        return
    if not config.train_head:
        if "head" in modes:
            raise SplitLMError("mode head needs a trained draft head: run `splitlm train-head` or drop --no-train-head")
        log.info("[bench] no draft head for this model (--no-train-head): auto drafts without it")
        return
    log.info("[bench] no draft head for this model yet: training it once (`splitlm train-head`; 15-40 minutes on "
             "2 cores, kept for every later split of this model; --no-train-head skips this)")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        report = train_head(str(model_dir), edge_dir, log=lambda msg: log.info("[bench] %s", msg), out=config.out)
    finally:
        torch.set_num_threads(threads)
    log.info(f"[bench] draft head trained in {report['seconds']:.0f} s; held-out acceptance by depth "
             + " · ".join(f"{c:.2f}" for c in report["heldout"]["conditional"]))


def split_fields(manifest, config: BenchConfig, edge) -> dict:
    """What each result row says about the split: topology, vocabulary subset, and the downlink a
    cloud returning full logits would need (computed, not measured: V values of the wire codec per token)."""
    from splitlm.transport.codecs import wire_nbytes

    return {"topology": manifest.topology, "d_end": manifest.d_end or None, "vocab": config.vocab,
            "vocab_size": edge.vocab.size,
            "full_logits_bytes_per_token": wire_nbytes(edge.wire_dtype, [1, edge.cfg.vocab_size])}


def environment(model_dir: Path, config: BenchConfig) -> dict:
    import torch
    import transformers

    from splitlm.model.config import ModelConfig
    from splitlm.model.loading import read_hf_config

    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu_model(),
        "cpu_count": os.cpu_count(), "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
        "transformers": transformers.__version__, "splitlm": __version__,
        "threads": {"edge_and_local": 1, "cloud": 1, "wan_emulator": "thread of the bench process"},
        "model": {"name": re.sub(r"-[0-9a-f]{16}$", "", model_dir.name),  # drop the cache's hash suffix
                  "path": str(model_dir), "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "weights_dtype": "fp32"},
        "split": {"head": config.head, "tail": config.tail or 0,
                  "cloud_layers": [config.head, cfg.num_layers - (config.tail or 0)]},
    }




@dataclass
class BenchSetup:
    """What the steps of one run share: its prompts and modes, the model, and the split of the network modes."""

    config: BenchConfig
    prompts_path: Path
    prompts: list[Prompt]  # tokenized
    modes: list[Mode]
    network: bool  # a mode (or the codec study) runs through the cloud
    model_dir: Path
    split_dir: Path | None
    manifest: object | None  # the edge shard's Manifest (None without network modes)
    tokenizer: object

    @property
    def rtts(self) -> list[float]:
        return self.config.rtts_ms if self.network else self.config.rtts_ms[:1]

    @property
    def edge_dir(self) -> Path:
        return self.split_dir / "edge" if self.split_dir else Path()

    def context(self, url: str | None, wire_dtype: str | None = None) -> BenchContext:
        """A bench context of the run's edge reaching `url` (with `wire_dtype`, else the configured codec)."""
        c = self.config
        ctx = BenchContext(self.model_dir, self.edge_dir, url, wire_dtype or c.wire_dtype, c.vocab,
                           device=c.device, dtype=c.dtype)
        ctx.schemas = {tuple(p.ids): p.schema for p in self.prompts if p.schema}  # what the `+json` modes match
        return ctx


@dataclass
class Reference:
    """The full transformers model's greedy continuation of each prompt (local-hf's own code path), and
    each prompt's (hits, positions) of teacher-forced agreement with it: local modes and the split model."""

    token_ids: dict[str, list[int]]
    local: dict[str, tuple[int, int]]
    split: dict[str, tuple[int, int]]

    def agreement(self, mode: Mode, prompt_id: str) -> tuple[int, int]:
        return self.split[prompt_id] if mode.network else self.local[prompt_id]


@dataclass
class Measured:
    """What a run measured, before aggregation."""

    rows: list[dict] = field(default_factory=list)  # one per prompt, RTT and mode
    memory: dict[str, dict] = field(default_factory=dict)  # per mode
    codecs: list[dict] = field(default_factory=list)
    split: dict = field(default_factory=dict)  # split_fields (network runs)
    devices: dict = field(default_factory=dict)  # where each side ran and in which precision


def prepare(config: BenchConfig) -> BenchSetup:
    """Load and tokenize the prompts, resolve the model and (for network modes) the split; train the
    draft head first if a mode needs one (`ensure_head`). The split decides K, M and the topology."""
    import torch

    from splitlm.bench.prompts import default_prompts_path, load_tokenizer, tokenize
    from splitlm.bench.specbench import load_prompt_set
    from splitlm.model.loading import resolve_model

    prompts_path = Path(config.prompts) if config.prompts else default_prompts_path()
    prompts = load_prompt_set(prompts_path, config.categories, config.per_category, config.mode_questions)
    prompts = prompts[: config.limit]
    modes = [MODES[m] for m in config.modes]
    network = any(m.network for m in modes) or bool(config.codecs)
    torch.set_num_threads(1)
    model_dir = resolve_model(config.model)
    split_dir, manifest = resolve_split(config, model_dir) if network else (None, None)
    if manifest is not None:  # the split decides: a pre-split edge's own K, M and topology
        config.head, config.tail, config.topology = manifest.head, manifest.tail, manifest.topology
        config.d_end = manifest.d_end or None
    if network and config.topology == "tail-local":
        ensure_head(config, model_dir, split_dir / "edge", manifest, [m.name for m in modes])
    tokenizer = load_tokenizer(model_dir)
    tokenize(prompts, tokenizer)
    return BenchSetup(config, prompts_path, prompts, modes, network, model_dir, split_dir, manifest, tokenizer)


def describe(setup: BenchSetup) -> str:
    """The run's plan, one status line."""
    c = setup.config
    return (f"{len(setup.prompts)} prompts x {len(setup.modes)} modes x {len(setup.rtts)} RTT(s), up to "
            f"{c.max_new_tokens} tokens; model {re.sub(r'-[0-9a-f]{16}$', '', setup.model_dir.name)}, {c.topology} "
            f"split k={c.head} m={c.tail or 0}{f' d={c.d_end}' if c.d_end else ''}, vocab {c.vocab},"
            f" wire {c.wire_dtype}, edge {c.device}/{c.dtype},"
            f" cloud {c.cloud_device or c.device}/{c.cloud_dtype or c.dtype};"
            " edge and cloud pinned to 1 torch thread each")


def open_contexts(stack: contextlib.ExitStack, setup: BenchSetup) -> tuple[int | None, dict[float, BenchContext]]:
    """(the cloud's port, one edge per RTT, each behind its own emulator), all closed with `stack`."""
    config = setup.config
    port = None
    if setup.network:
        cloud = (config.cloud_device or config.device, config.cloud_dtype or config.dtype)
        port = stack.enter_context(cloud_process(setup.split_dir / "cloud", *cloud))
    contexts: dict[float, BenchContext] = {}
    for rtt in setup.rtts:
        url = stack.enter_context(link(port, rtt, config)) if setup.network else None
        contexts[rtt] = setup.context(url)  # the transformers model is shared
        stack.callback(contexts[rtt].close)
    return port, contexts


def reference_runs(setup: BenchSetup, ctx: BenchContext) -> Reference:
    """The reference continuations, and (network runs) their teacher-forced agreement through the split."""
    from splitlm.bench.modes import teacher_forced_agreement

    prompts, max_new = setup.prompts, setup.config.max_new_tokens
    from splitlm.bench.specbench import fill_follow_up

    log.info("[bench] reference: greedy continuations of the full transformers model")
    token_ids: dict[str, list[int]] = {}
    for p in prompts:  # a later turn follows the reference's answer to the turn before (Spec-Bench's MT-bench)
        fill_follow_up(p, prompts, token_ids, setup.tokenizer)
        token_ids[p.id] = MODES["local-hf"].run(ctx, p.ids, max_new).token_ids
    local = {p.id: (len(token_ids[p.id]),) * 2 for p in prompts}  # local modes are the reference
    split: dict[str, tuple[int, int]] = {}
    if setup.network:
        log.info("[bench] agreement: teacher-forced reference continuations through the split model")
        split = {p.id: teacher_forced_agreement(ctx, p.ids, token_ids[p.id]) for p in prompts}
    return Reference(token_ids, local, split)


def codec_study(setup: BenchSetup, port: int | None, reference: Reference) -> list[dict]:
    """`--codecs`: bytes per token and agreement per wire codec, straight to the cloud (no emulated delay)."""
    config = setup.config
    if not config.codecs:
        return []
    from splitlm.bench.codecs import codec_rows

    log.info(f"[bench] codec study ({', '.join(config.codecs)}): direct to the cloud, no emulated delay")
    return codec_rows(lambda codec: setup.context(f"ws://127.0.0.1:{port}", codec), setup.prompts,
                      reference.token_ids, config.codecs, config.max_new_tokens)


def measure_runs(setup: BenchSetup, contexts: dict[float, BenchContext], reference: Reference) -> list[dict]:
    """Warm up every mode at every RTT (not counted), then run the prompts interleaved: prompt 1 in every
    RTT and mode, then prompt 2, ...: machine noise hits all alike. One row per run."""
    from splitlm.bench.metrics import prompt_row

    prompts, max_new = setup.prompts, setup.config.max_new_tokens
    for ctx in contexts.values():
        for m in setup.modes:  # warm-up (connects, first calls), not counted
            m.run(ctx, prompts[0].ids, WARMUP_TOKENS)
    rows: list[dict] = []
    shown = bar(sum(m.name not in p.skip_modes for p in prompts for m in setup.modes) * len(contexts), "bench",
                unit="run")
    for i, p in enumerate(prompts, 1):
        for rtt, ctx in contexts.items():
            for m in (m for m in setup.modes if m.name not in p.skip_modes):
                run = m.run(ctx, p.ids, max_new)
                row = prompt_row(m.name, rtt, p, run, reference.token_ids[p.id], reference.agreement(m, p.id),
                                 setup.tokenizer.decode(run.token_ids, skip_special_tokens=True))
                rows.append(row)
                shown.update()
                log.debug(f"rtt {rtt:g} ms  {m.name:<10} {i:>2}/{len(prompts)} {p.id:<26} "
                          f"{row['new_tokens']:>3} tok  {row['tok_s'] or 0:6.1f} tok/s  "
                          f"TTFT {row['ttft_s'] * 1000:5.0f} ms{'' if row['exact_match'] else '  (differs)'}")
    shown.close()
    return rows


def memory_probes(setup: BenchSetup, port: int | None) -> dict[str, dict]:
    """Each mode alone in a fresh process decoding the longest prompt: its peak memory (unless --no-memory)."""
    config = setup.config
    if not config.memory:
        return {}
    from splitlm.bench.memory import probe_memory

    longest = max(setup.prompts, key=lambda p: len(p.ids))
    memory = {}
    for m in track(setup.modes, "memory probe", unit="mode"):
        log.info(f"[bench] memory: {m.name} alone in a fresh process ({longest.id}, {config.max_new_tokens} tokens)")
        memory[m.name] = probe_memory(m.name, setup.model_dir, setup.edge_dir,
                                      f"ws://127.0.0.1:{port}" if port else None, config.wire_dtype, longest.ids,
                                      config.max_new_tokens, vocab=config.vocab, device=config.device,
                                      dtype=config.dtype)
    return memory


def where_run(setup: BenchSetup, ctx: BenchContext, port: int | None) -> dict:
    """The edge's and the cloud's device and compute dtype (network runs; the reference: CPU, fp32)."""
    from splitlm.model.device import dtype_name

    if not setup.network:
        return {}
    devices = {"edge": {"device": str(ctx.edge.device), "dtype": dtype_name(ctx.edge.dtype)}}
    if port is not None:
        cloud_health = health(port)
        devices["cloud"] = {"device": cloud_health.get("device"), "dtype": cloud_health.get("dtype")}
    return devices


def results_doc(setup: BenchSetup, measured: Measured, started: float, load_at_start: list[float]) -> dict:
    """The results document (see docs/benchmarks.md for its fields)."""
    from splitlm.bench.metrics import aggregate, fit_sweep

    config = setup.config
    results = aggregate(measured.rows, measured.memory)
    for r in [*results, *measured.rows]:  # local modes run the full model: no topology, no downlink
        r.update(measured.split if MODES[r["mode"]].network else {"topology": None, "vocab": None})
    env = environment(setup.model_dir, config)
    env["split"].update({"topology": config.topology, "d_end": config.d_end, "vocab": config.vocab})
    env["compute"] = measured.devices
    if setup.manifest is not None:
        env["model"]["weights_dtype"] = setup.manifest.dtype  # as stored in the shards
    env["load_avg_at_start"] = load_at_start  # other work on the machine skews absolute figures; ratios hold better
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "config": {**asdict(config), "prompts": str(setup.prompts_path), "sweep": config.sweep},
        "environment": env,
        "prompts": [{"id": p.id, "category": p.category, "chat": p.chat, "prompt_tokens": len(p.ids),
                     **({"follows": p.follows} if p.follows else {}),
                     **({"skip_modes": sorted(p.skip_modes)} if p.skip_modes else {})} for p in setup.prompts],
        "memory": measured.memory,
        "results": results,
        "step_model": fit_sweep(results) if config.sweep else {},
        "codecs": measured.codecs,
        "runs": measured.rows,
    }


def run_bench(config: BenchConfig) -> dict:
    """Run the benchmark; returns the results document (see docs/benchmarks.md for its fields)."""
    from splitlm.bench import specbench
    from splitlm.bench.structured import structured_summary

    setup = prepare(config)
    started = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    log.info("[bench] %s", describe(setup))
    measured = Measured()
    with contextlib.ExitStack() as stack:
        port, contexts = open_contexts(stack, setup)
        first = contexts[setup.rtts[0]]
        reference = reference_runs(setup, first)
        measured.codecs = codec_study(setup, port, reference)
        measured.rows = measure_runs(setup, contexts, reference)
        measured.memory = memory_probes(setup, port)
        measured.split = split_fields(setup.manifest, config, first.edge) if setup.network else {}
        measured.devices = where_run(setup, first, port)
    doc = results_doc(setup, measured, started, load_at_start)
    if specbench.is_spec_bench(setup.prompts_path):  # per category next to the published figures
        doc["spec_bench"] = specbench.summary(doc)
    doc["structured"] = structured_summary(doc)  # the `+json` modes against their unconstrained twins
    return doc


def write_results(doc: dict, out: str | Path, plots: bool = True) -> list[Path]:
    """Write `bench-<stamp>.json`, `.md`, the plots, and `results.json`; returns the run's paths."""
    from splitlm.bench.report import markdown_report, write_plots

    def report(pngs: list[Path]) -> str:
        text = markdown_report(doc)
        if plots:
            text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
        return text

    return write_result(out, "bench", doc, stamp=time_stamp(doc["created"]), markdown=report,
                        plots=(lambda base: write_plots(doc, base)) if plots else None, latest="results.json").paths
