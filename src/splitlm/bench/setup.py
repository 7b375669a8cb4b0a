"""What a `splitlm bench` run is set up from: its configuration (`BenchConfig`), and the prompts, modes,
model and split it resolves to (`prepare` -> `BenchSetup`), the draft head trained first where a mode
needs one (`ensure_head`)."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from splitlm import SplitLMError
from splitlm.bench.modes import MODES, BenchContext, Mode
from splitlm.bench.prompts import Prompt
from splitlm.result_files import default_results_dir

log = logging.getLogger(__name__)

DEFAULT_MODES = "local-hf,split-seq,auto"
HEAD_MODES = {"auto", "auto-zerocost", "head", "auto+json"}  # the modes that draft with the trained head
DEFAULT_OUT = default_results_dir()


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
            raise SplitLMError(
                f"--edge {edge_dir}: its cloud shard must be the sibling directory "
                f"{edge_dir.parent / 'cloud'} of the same split"
            )
        if manifest.model_hash != file_sha256(safetensors_files(model_dir))[:32]:
            raise SplitLMError(
                f"--edge {edge_dir} was split from another model than --model {config.model} (the reference)"
            )
        return edge_dir.parent, manifest
    tail = config.tail if config.tail is not None else (0 if config.topology == "split-head" else 2)
    split_dir = cached_split(config.model, config.head, tail, config.topology, config.d_end)
    return split_dir, Manifest.read(split_dir / "edge", "edge")


def ensure_head(config: BenchConfig, model_dir: Path, edge_dir: Path, manifest, modes: list[str]) -> None:
    """Train the draft head once (`splitlm train-head`, cached for the model) when a mode drafts with it
    and neither the edge shard nor this machine has one; --no-train-head runs those modes without it."""
    import torch

    from splitlm.decoding.head import fitting_head
    from splitlm.decoding.train_head import train_head

    if not HEAD_MODES & set(modes) or fitting_head(edge_dir, manifest.model_hash, manifest.cloud_layers) is not None:
        return
    if not config.train_head:
        if "head" in modes:
            raise SplitLMError("mode head needs a trained draft head: run `splitlm train-head` or drop --no-train-head")
        log.info("[bench] no draft head for this model (--no-train-head): auto drafts without it")
        return
    log.info(
        "[bench] no draft head for this model yet: training it once (`splitlm train-head`; 15-40 minutes on "
        "2 cores, kept for every later split of this model; --no-train-head skips this)"
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        report = train_head(str(model_dir), edge_dir, log=lambda msg: log.info("[bench] %s", msg), out=config.out)
    finally:
        torch.set_num_threads(threads)
    log.info(
        f"[bench] draft head trained in {report['seconds']:.0f} s; held-out acceptance by depth "
        + " · ".join(f"{c:.2f}" for c in report["heldout"]["conditional"])
    )


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
        ctx = BenchContext(
            self.model_dir, self.edge_dir, url, wire_dtype or c.wire_dtype, c.vocab, device=c.device, dtype=c.dtype
        )
        ctx.schemas = {tuple(p.ids): p.schema for p in self.prompts if p.schema}  # what the `+json` modes match
        return ctx


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
    return (
        f"{len(setup.prompts)} prompts x {len(setup.modes)} modes x {len(setup.rtts)} RTT(s), up to "
        f"{c.max_new_tokens} tokens; model {re.sub(r'-[0-9a-f]{16}$', '', setup.model_dir.name)}, {c.topology} "
        f"split k={c.head} m={c.tail or 0}{f' d={c.d_end}' if c.d_end else ''}, vocab {c.vocab},"
        f" wire {c.wire_dtype}, edge {c.device}/{c.dtype},"
        f" cloud {c.cloud_device or c.device}/{c.cloud_dtype or c.dtype};"
        " edge and cloud pinned to 1 torch thread each"
    )
