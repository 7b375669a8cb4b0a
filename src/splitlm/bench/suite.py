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

import argparse
import contextlib
import logging
import os
import platform
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitlm import SplitLMError, __version__
from splitlm.cloud.local import cloud_process, health
from splitlm.progress import bar, track

log = logging.getLogger(__name__)

SCHEMA = "splitlm.bench/1"
DEFAULT_MODES = "local-hf,split-seq,auto"
HEAD_MODES = {"auto", "auto-zerocost", "head"}  # the modes that draft with the trained head


def default_results_dir() -> Path:
    """Where bench and loadtest write by default, outside any source tree: $SPLITLM_RESULTS, else
    $XDG_DATA_HOME/splitlm/results, else ~/.local/share/splitlm/results."""
    if env := os.environ.get("SPLITLM_RESULTS"):
        return Path(env)
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "splitlm" / "results"


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
    draft: str | None = None  # --draft (self, self-raw or a model path): mode draft's (default self), pipelined's
    codecs: list[str] = field(default_factory=list)  # codec study: bytes/token and agreement per wire codec
    device: str = "auto"  # the edge's device and compute dtype (this process)
    dtype: str = "auto"
    cloud_device: str | None = None  # the cloud's (None: as the edge's)
    cloud_dtype: str | None = None
    train_head: bool = True  # train the draft head once if modes need it and this model has none

    @property
    def sweep(self) -> bool:
        return len(self.rtts_ms) > 1


def progress(msg: str) -> None:
    """A status line (logging: shown unless --quiet; bars carry the per-run progress)."""
    log.info("[bench] %s", msg)


def parse_rtt_list(text: str) -> list[float]:
    """'20,40,80' -> [20.0, 40.0, 80.0]; raise SplitLMError on anything else."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SplitLMError(f"bad --sweep {text!r}: expected RTTs in ms separated by commas, e.g. 20,40,80") from None
    if len(set(values)) < 2 or any(not v >= 0 for v in values):
        raise SplitLMError(f"bad --sweep {text!r}: need at least two different RTTs >= 0 ms")
    return sorted(set(values))


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
        progress("no draft head for this model (--no-train-head): auto drafts without it")
        return
    progress("no draft head for this model yet: training it once (`splitlm train-head`; 15-40 minutes on "
             "2 cores, kept for every later split of this model; --no-train-head skips this)")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        report = train_head(str(model_dir), edge_dir, log=progress)
    finally:
        torch.set_num_threads(threads)
    progress(f"draft head trained in {report['seconds']:.0f} s; held-out acceptance by depth "
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

    cpu = ""
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
        "cpu_count": os.cpu_count(), "load_avg_at_end": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
        "transformers": transformers.__version__, "splitlm": __version__,
        "threads": {"edge_and_local": 1, "cloud": 1, "wan_emulator": "thread of the bench process"},
        "model": {"name": re.sub(r"-[0-9a-f]{16}$", "", model_dir.name),  # drop the cache's hash suffix
                  "path": str(model_dir), "layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                  "vocab_size": cfg.vocab_size, "weights_dtype": "fp32"},
        "split": {"head": config.head, "tail": config.tail or 0,
                  "cloud_layers": [config.head, cfg.num_layers - (config.tail or 0)]},
    }


def run_bench(config: BenchConfig) -> dict:
    """Run the benchmark; returns the results document (see docs/benchmarks.md for its fields)."""
    from splitlm.bench.metrics import aggregate, fit_sweep, prompt_row
    from splitlm.bench.modes import MODES, BenchContext, teacher_forced_agreement
    from splitlm.bench.prompts import default_prompts_path, load_prompts, load_tokenizer, tokenize
    from splitlm.model.device import dtype_name

    prompts_path = Path(config.prompts) if config.prompts else default_prompts_path()
    prompts = load_prompts(prompts_path)[: config.limit]
    modes = [MODES[m] for m in config.modes]
    network = any(m.network for m in modes) or bool(config.codecs)

    import torch

    from splitlm.model.loading import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model(config.model)
    split_dir, manifest = resolve_split(config, model_dir) if network else (None, None)
    if manifest is not None:  # the split decides: a pre-split edge's own K, M and topology
        config.head, config.tail, config.topology = manifest.head, manifest.tail, manifest.topology
        config.d_end = manifest.d_end or None
    if network and config.topology == "tail-local":
        ensure_head(config, model_dir, split_dir / "edge", manifest, [m.name for m in modes])
    tok = load_tokenizer(model_dir)
    tokenize(prompts, tok)
    started = time.time()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    rtts = config.rtts_ms if network else config.rtts_ms[:1]
    progress(f"{len(prompts)} prompts x {len(modes)} modes x {len(rtts)} RTT(s), up to {config.max_new_tokens} tokens;"
             f" model {re.sub(r'-[0-9a-f]{16}$', '', model_dir.name)}, {config.topology} split k={config.head}"
             f" m={config.tail or 0}{f' d={config.d_end}' if config.d_end else ''}, vocab {config.vocab},"
             f" wire {config.wire_dtype}, edge {config.device}/{config.dtype},"
             f" cloud {config.cloud_device or config.device}/{config.cloud_dtype or config.dtype};"
             " edge and cloud pinned to 1 torch thread each")

    edge_dir = split_dir / "edge" if split_dir else Path()
    rows: list[dict] = []
    memory: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        cloud = (config.cloud_device or config.device, config.cloud_dtype or config.dtype)
        port = stack.enter_context(cloud_process(split_dir / "cloud", *cloud)) if network else None
        contexts: dict[float, BenchContext] = {}  # one edge per RTT, each behind its own emulator
        for rtt in rtts:
            url = stack.enter_context(link(port, rtt, config)) if network else None
            contexts[rtt] = BenchContext(model_dir, edge_dir, url, config.wire_dtype, config.vocab,  # HF model shared
                                         device=config.device, dtype=config.dtype)
            contexts[rtt].draft = config.draft
            stack.callback(contexts[rtt].close)
        first = contexts[rtts[0]]
        # The reference: the full transformers model's greedy continuation (local-hf's own code path).
        progress("reference: greedy continuations of the full transformers model")
        reference = {p.id: MODES["local-hf"].run(first, p.ids, config.max_new_tokens).token_ids for p in prompts}
        agreement = {p.id: (len(reference[p.id]),) * 2 for p in prompts}  # local modes are the reference
        split_agreement: dict[str, tuple[int, int]] = {}
        if network:
            progress("agreement: teacher-forced reference continuations through the split model")
            split_agreement = {p.id: teacher_forced_agreement(first, p.ids, reference[p.id]) for p in prompts}
        codec_results = []
        if config.codecs:
            from splitlm.bench.codecs import codec_rows

            def make_context(codec: str) -> BenchContext:
                return BenchContext(model_dir, edge_dir, f"ws://127.0.0.1:{port}", codec, config.vocab,
                                    device=config.device, dtype=config.dtype)

            progress(f"codec study ({', '.join(config.codecs)}): direct to the cloud, no emulated delay")
            codec_results = codec_rows(make_context, prompts, reference, config.codecs, config.max_new_tokens,
                                       progress)
        for ctx in contexts.values():
            for m in modes:  # warm-up (connects, first calls), not counted
                m.run(ctx, prompts[0].ids, WARMUP_TOKENS)
        # Interleaved: prompt 1 in every RTT and mode, then prompt 2, ...: machine noise hits all alike.
        shown = bar(len(prompts) * len(contexts) * len(modes), "bench", unit="run")
        for i, p in enumerate(prompts, 1):
            for rtt, ctx in contexts.items():
                for m in modes:
                    run = m.run(ctx, p.ids, config.max_new_tokens)
                    row = prompt_row(m.name, rtt, p, run, reference[p.id],
                                     split_agreement[p.id] if m.network else agreement[p.id],
                                     tok.decode(run.token_ids, skip_special_tokens=True))
                    rows.append(row)
                    shown.update()
                    log.debug(f"rtt {rtt:g} ms  {m.name:<10} {i:>2}/{len(prompts)} {p.id:<26} "
                             f"{row['new_tokens']:>3} tok  {row['tok_s'] or 0:6.1f} tok/s  "
                             f"TTFT {row['ttft_s'] * 1000:5.0f} ms{'' if row['exact_match'] else '  (differs)'}")
        shown.close()
        if config.memory:
            from splitlm.bench.memory import probe_memory

            longest = max(prompts, key=lambda p: len(p.ids))
            for m in track(modes, "memory probe", unit="mode"):
                progress(f"memory: {m.name} alone in a fresh process ({longest.id}, {config.max_new_tokens} tokens)")
                memory[m.name] = probe_memory(m.name, model_dir, edge_dir, f"ws://127.0.0.1:{port}" if port else None,
                                              config.wire_dtype, longest.ids, config.max_new_tokens,
                                              vocab=config.vocab, device=config.device, dtype=config.dtype)
        split = split_fields(manifest, config, first.edge) if network else {}
        devices = {"edge": {"device": str(first.edge.device), "dtype": dtype_name(first.edge.dtype)}} if network else {}
        if port is not None:
            cloud_health = health(port)
            devices["cloud"] = {"device": cloud_health.get("device"), "dtype": cloud_health.get("dtype")}

    results = aggregate(rows, memory)
    for r in [*results, *rows]:  # local modes run the full model: no topology, no downlink
        r.update(split if MODES[r["mode"]].network else {"topology": None, "vocab": None})
    env = environment(model_dir, config)
    env["split"].update({"topology": config.topology, "d_end": config.d_end, "vocab": config.vocab})
    env["compute"] = devices  # where each side ran and in which precision (the reference: CPU, fp32)
    if manifest is not None:
        env["model"]["weights_dtype"] = manifest.dtype  # as stored in the shards
    env["load_avg_at_start"] = load_at_start  # other work on the machine skews absolute figures; ratios hold better
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "config": {**asdict(config), "prompts": str(prompts_path), "sweep": config.sweep},
        "environment": env,
        "prompts": [{"id": p.id, "category": p.category, "chat": p.chat, "prompt_tokens": len(p.ids)} for p in prompts],
        "memory": memory,
        "results": results,
        "step_model": fit_sweep(results) if config.sweep else {},
        "codecs": codec_results,
        "runs": rows,
    }


def write_results(doc: dict, out: str | Path, plots: bool = True) -> list[Path]:
    """Write `bench-<stamp>.json`, `.md`, the plots, and `results.json`; returns the paths written."""
    from splitlm.bench.report import markdown_report, stamped_base, suffixed, write_json, write_plots

    base = stamped_base(out, "bench", doc["created"])
    paths = [write_json(suffixed(base, ".json"), doc), suffixed(base, ".md")]
    report = markdown_report(doc)
    if plots:
        pngs = write_plots(doc, base)
        paths += pngs
        report += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in pngs) + "\n"
    paths[1].write_text(report)
    shutil.copyfile(paths[0], base.parent / "results.json")
    return paths


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rtt-ms", type=float, default=80.0, help="emulated round-trip time (default 80; 0 = no emulator)")
    p.add_argument("--sweep", default=None, metavar="R1,R2,...",
                   help="run at each of these RTTs (ms) instead and fit t_step = α·RTT + β per mode")
    from splitlm.bench.modes import ALIASES, MODES

    known = "; ".join(f"{m.name}: {m.help}" for m in MODES.values())
    aliases = ", ".join(f"{a}={n}" for a, n in ALIASES.items())
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated modes (default {DEFAULT_MODES}). {known}. Aliases: {aliases}")
    p.add_argument("--prompts", default="", help="prompt file (default benchmarks/prompts.json)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--model", default="default", help="HF model directory, .gguf file, or built-in name")
    p.add_argument("--head", type=int, default=2, help="edge head layers K (default 2)")
    p.add_argument("--tail", type=int, default=None, help="edge tail layers M (default 2; split-head: 0)")
    p.add_argument("--edge", default="", metavar="DIR",
                   help="benchmark this pre-split edge shard (its cloud shard is DIR/../cloud) instead of splitting "
                        "--model here; its topology, K, M and D come from its manifest")
    p.add_argument("--topology", default="tail-local", choices=["tail-local", "split-head"],
                   help="when splitting here: the topology (default tail-local)")
    p.add_argument("--d-end", type=int, default=None, metavar="D",
                   help="split-head: LM-head columns kept on the edge (default half the hidden size)")
    p.add_argument("--vocab", default="all", metavar="{all,en,zh,FILE}",
                   help="the edge's vocabulary subset (default all); split-head clouds compute logits for it only")
    from splitlm.transport.codecs import WIRE_DTYPES

    p.add_argument("--wire-dtype", default="auto", choices=["auto", *WIRE_DTYPES],
                   help="activation codec of the modes (default auto: fp16, bf16 for Gemma)")
    p.add_argument("--draft", default=None, metavar="self|self-raw|PATH",
                   help="the draft model of mode `draft` (default self: the edge's layers with the trained adapter); "
                        "given, mode `pipelined` drafts with it too (else with auto's drafters)")
    p.add_argument("--codecs", default="", metavar="C1,C2,...",
                   help=f"also run the codec study for these codecs ({','.join(WIRE_DTYPES)}, or 'all'): bytes per "
                        "token and agreement with the full model's greedy tokens")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="± uniform jitter per direction (ms)")
    p.add_argument("--mbps", type=float, default=None, help="bandwidth cap per direction (Mbit/s)")
    from splitlm.model.device import add_device_arguments

    add_device_arguments(p, what="the edge's (and, unless --cloud-device says otherwise, the cloud's) layers")
    add_device_arguments(p, "cloud", what="the cloud's layers")
    p.add_argument("--pass-cost", default=None, metavar="SHAPE",
                   help="instead of the WAN bench: time the cloud's middle layers of a model shape (random weights "
                        "made on --cloud-device) per pass of T new tokens; shapes: smollm2-135m, tinyllama-1.1b, "
                        "llama3-8b, qwen2-small")
    p.add_argument("--pass-tokens", default="1,8,32,64,128", metavar="T1,T2,...",
                   help="--pass-cost: new tokens per pass (default 1,8,32,64,128)")
    p.add_argument("--pass-context", type=int, default=512, help="--pass-cost: cached entries before each pass (512)")
    p.add_argument("--pass-dtypes", default="", metavar="D1,D2",
                   help="--pass-cost: compute dtypes to time (default: --cloud-dtype, else --dtype)")
    from splitlm.bench.prefill import add_prefill_arguments

    add_prefill_arguments(p)
    p.add_argument("--edge-profiles", action="store_true",
                   help="instead of the WAN bench: the edge's peak memory, compute per step and agreement in each "
                        "profile (torch fp32, torch bf16, onnx fp32, onnx int8) on the held-out prompts "
                        "(--limit, default 8; --max-new-tokens; --threads)")
    p.add_argument("--threads", type=int, default=None, help="--edge-profiles: threads per profile (default 2)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-mode peak-memory probes")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-train-head", action="store_true",
                   help="run auto without the draft head when none is trained for the model (else it is trained "
                        "once, about 10 minutes, before the modes that use it)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from splitlm.bench.modes import parse_modes

    if args.rtt_ms < 0 or args.jitter_ms < 0 or (args.mbps is not None and args.mbps <= 0):
        raise SplitLMError("--rtt-ms and --jitter-ms must be >= 0 and --mbps > 0")
    if args.max_new_tokens < 1 or (args.limit is not None and args.limit < 1):
        raise SplitLMError("--max-new-tokens and --limit must be at least 1")
    if args.head < 1 or (args.tail is not None and args.tail < 0):
        raise SplitLMError("--head must be >= 1 and --tail >= 0")
    if args.edge and (args.topology != "tail-local" or args.d_end is not None or args.tail is not None):
        raise SplitLMError("--edge benchmarks an existing split: its topology, --tail and --d-end come from it")
    if args.topology == "split-head" and args.tail:
        raise SplitLMError("the split-head topology keeps no tail layers on the edge: drop --tail")
    if args.d_end is not None and args.topology != "split-head":
        raise SplitLMError("--d-end only applies to --topology split-head")
    return BenchConfig(
        rtts_ms=parse_rtt_list(args.sweep) if args.sweep else [args.rtt_ms], modes=parse_modes(args.modes),
        prompts=args.prompts, max_new_tokens=args.max_new_tokens, out=args.out, model=args.model,
        head=args.head, tail=args.tail, wire_dtype=args.wire_dtype, edge=args.edge, topology=args.topology,
        d_end=args.d_end, vocab=args.vocab, jitter_ms=args.jitter_ms, mbps=args.mbps,
        limit=args.limit, memory=not args.no_memory, plots=not args.no_plots, train_head=not args.no_train_head,
        codecs=parse_codecs(args.codecs), draft=args.draft,
        device=args.device, dtype=args.dtype, cloud_device=args.cloud_device, cloud_dtype=args.cloud_dtype)


def parse_codecs(text: str) -> list[str]:
    from splitlm.transport.codecs import WIRE_DTYPES

    codecs = list(WIRE_DTYPES) if text.strip() == "all" else [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in codecs if c not in WIRE_DTYPES]
    if bad:
        raise SplitLMError(f"unknown codec(s) {', '.join(bad)} in --codecs (choose from {', '.join(WIRE_DTYPES)}, all)")
    return codecs


def pass_cost_main(args: argparse.Namespace) -> int:
    from splitlm.bench.passcost import markdown, pass_cost_doc
    from splitlm.bench.report import stamped_base, suffixed, write_json
    from splitlm.model.device import resolve_device, resolve_dtype

    try:
        tokens = [int(t) for t in args.pass_tokens.split(",") if t.strip()]
    except ValueError:
        raise SplitLMError(f"--pass-tokens {args.pass_tokens!r}: expected integers such as 1,8,32") from None
    if not tokens or min(tokens) < 1 or args.pass_context < 0:
        raise SplitLMError("--pass-tokens must be integers >= 1 and --pass-context >= 0")
    device = resolve_device(args.cloud_device or args.device)
    names = [d.strip() for d in args.pass_dtypes.split(",") if d.strip()] or [args.cloud_dtype or args.dtype]
    dtypes = [resolve_dtype(d, device) for d in names]
    doc = pass_cost_doc(args.pass_cost, device, dtypes, tokens, args.pass_context, reps=10, progress=progress)
    path = write_json(suffixed(stamped_base(args.out, f"pass-cost-{args.pass_cost}-{device.type}", doc["created"]),
                               ".json"), doc)
    print(markdown(doc))
    progress(f"wrote {path}")
    return 0


def bench_main(args: argparse.Namespace) -> int:
    from splitlm.bench.prompts import default_prompts_path, load_prompts
    from splitlm.bench.report import markdown_report

    if args.pass_cost:
        return pass_cost_main(args)
    if args.prefill:
        from splitlm.bench.prefill import prefill_main

        return prefill_main(args, str(DEFAULT_OUT))
    config = config_from_args(args)
    if args.edge_profiles:
        from splitlm.bench.edge_profiles import edge_profiles_main
        from splitlm.model.loading import resolve_model

        if config.topology != "tail-local":
            raise SplitLMError("--edge-profiles needs the tail-local topology (the ONNX edge has a tail)")
        return edge_profiles_main(args, config, progress, resolve_split(config, resolve_model(config.model))[0])
    load_prompts(config.prompts or default_prompts_path())  # fail fast, before loading any model
    if config.vocab not in ("all", "en", "zh") and not Path(config.vocab).is_file():
        raise SplitLMError(f"--vocab {config.vocab!r}: not all, en, zh or an allow-list file")
    doc = run_bench(config)
    paths = write_results(doc, config.out, plots=config.plots)
    print(markdown_report(doc))
    progress("wrote " + ", ".join(str(p) for p in paths))
    return 0
