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

from splitlm import __version__
from splitlm.bench.modes import MODES, BenchContext, Mode
from splitlm.bench.setup import BenchConfig, BenchSetup, describe, prepare
from splitlm.cloud.local import cloud_process, health
from splitlm.progress import bar, track
from splitlm.result_files import cpu_model, time_stamp, write_result

log = logging.getLogger(__name__)

SCHEMA = "splitlm.bench/1"
WARMUP_TOKENS = 4


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


def split_fields(manifest, config: BenchConfig, edge) -> dict:
    """What each result row says about the split: topology, vocabulary subset, and the downlink a
    cloud returning full logits would need (computed, not measured: V values of the wire codec per token)."""
    from splitlm.transport.codecs import wire_nbytes

    return {
        "topology": manifest.topology,
        "d_end": manifest.d_end or None,
        "vocab": config.vocab,
        "vocab_size": edge.vocab.size,
        "full_logits_bytes_per_token": wire_nbytes(edge.wire_dtype, [1, edge.cfg.vocab_size]),
    }


def environment(model_dir: Path, config: BenchConfig) -> dict:
    import torch
    import transformers

    from splitlm.model.config import ModelConfig
    from splitlm.model.loading import read_hf_config

    cfg = ModelConfig.from_hf(read_hf_config(model_dir))
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "splitlm": __version__,
        "threads": {"edge_and_local": 1, "cloud": 1, "wan_emulator": "thread of the bench process"},
        "model": {
            "name": re.sub(r"-[0-9a-f]{16}$", "", model_dir.name),  # drop the cache's hash suffix
            "path": str(model_dir),
            "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size,
            "vocab_size": cfg.vocab_size,
            "weights_dtype": "fp32",
        },
        "split": {
            "head": config.head,
            "tail": config.tail or 0,
            "cloud_layers": [config.head, cfg.num_layers - (config.tail or 0)],
        },
    }


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
    return codec_rows(
        lambda codec: setup.context(f"ws://127.0.0.1:{port}", codec),
        setup.prompts,
        reference.token_ids,
        config.codecs,
        config.max_new_tokens,
    )


def measure_runs(setup: BenchSetup, contexts: dict[float, BenchContext], reference: Reference) -> list[dict]:
    """Warm up every mode at every RTT (not counted), then run the prompts interleaved: prompt 1 in every
    RTT and mode, then prompt 2, ...: machine noise hits all alike. One row per run."""
    from splitlm.bench.metrics import prompt_row

    prompts, max_new = setup.prompts, setup.config.max_new_tokens
    for ctx in contexts.values():
        for m in setup.modes:  # warm-up (connects, first calls), not counted
            m.run(ctx, prompts[0].ids, WARMUP_TOKENS)
    rows: list[dict] = []
    shown = bar(
        sum(m.name not in p.skip_modes for p in prompts for m in setup.modes) * len(contexts), "bench", unit="run"
    )
    for i, p in enumerate(prompts, 1):
        for rtt, ctx in contexts.items():
            for m in (m for m in setup.modes if m.name not in p.skip_modes):
                run = m.run(ctx, p.ids, max_new)
                row = prompt_row(
                    m.name,
                    rtt,
                    p,
                    run,
                    reference.token_ids[p.id],
                    reference.agreement(m, p.id),
                    setup.tokenizer.decode(run.token_ids, skip_special_tokens=True),
                )
                rows.append(row)
                shown.update()
                log.debug(
                    f"rtt {rtt:g} ms  {m.name:<10} {i:>2}/{len(prompts)} {p.id:<26} "
                    f"{row['new_tokens']:>3} tok  {row['tok_s'] or 0:6.1f} tok/s  "
                    f"TTFT {row['ttft_s'] * 1000:5.0f} ms{'' if row['exact_match'] else '  (differs)'}"
                )
    shown.close()
    return rows


def memory_probes(setup: BenchSetup, port: int | None) -> dict[str, dict]:
    """Each mode alone in a fresh process decoding the longest prompt: its peak memory (unless --no-memory)."""
    config = setup.config
    if not config.memory:
        return {}
    from splitlm.bench.memory import MemoryProbe, probe_memory

    longest = max(setup.prompts, key=lambda p: len(p.ids))
    memory = {}
    for m in track(setup.modes, "memory probe", unit="mode"):
        log.info(f"[bench] memory: {m.name} alone in a fresh process ({longest.id}, {config.max_new_tokens} tokens)")
        probe = MemoryProbe(
            m.name,
            str(setup.model_dir),
            str(setup.edge_dir),
            f"ws://127.0.0.1:{port}" if port else None,
            config.wire_dtype,
            list(longest.ids),
            config.max_new_tokens,
            vocab=config.vocab,
            device=config.device,
            dtype=config.dtype,
        )
        memory[m.name] = probe_memory(probe)
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
        "prompts": [
            {
                "id": p.id,
                "category": p.category,
                "chat": p.chat,
                "prompt_tokens": len(p.ids),
                **({"follows": p.follows} if p.follows else {}),
                **({"skip_modes": sorted(p.skip_modes)} if p.skip_modes else {}),
            }
            for p in setup.prompts
        ],
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

    return write_result(
        out,
        "bench",
        doc,
        stamp=time_stamp(doc["created"]),
        markdown=report,
        plots=(lambda base: write_plots(doc, base)) if plots else None,
        latest="results.json",
    ).paths
