"""Split a model into an edge shard and a cloud shard, and load each one.

Topology `tail-local` (default):
`DIR/edge/`:  config, tokenizer, embedding, layers [0, K), layers [L-M, L), final norm, LM head.
`DIR/cloud/`: config and layers [K, L-M) only.
Topology `split-head` (`splitlm.model.splithead`): the edge keeps the embedding, layers [0, K)
and the LM head's first D columns; the cloud holds layers [K, L), the final norm and the other
columns. Both shards carry `manifest.json` with the split's fingerprint, which the edge and the
cloud compare in the handshake, and their weights as bounded safetensors files with an index
(`splitlm.model.weights`), stored in the checkpoint's dtype unless `--dtype` casts them; the
manifest's `dtype` is that stored dtype. Loading builds the modules on `meta` and assigns the
stored tensors (`splitlm.model.materialise`), cast once to the run-time dtype on the device.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.device import DTYPE_NAMES, DTYPES
from splitlm.model.greedy_head import GreedyHead
from splitlm.model.llama import LayerStack, embed, final_norm, softcap
from splitlm.model.loading import (
    cache_lock,
    cache_root,
    file_sha256,
    read_hf_config,
    resolve_model,
    safetensors_files,
)
from splitlm.model.materialise import assign_weights
from splitlm.model.splithead import check_d_end, split_head_pieces
from splitlm.model.weights import (
    DEFAULT_MAX_FILE_MB,
    Piece,
    TensorSpec,
    Weights,
    checkpoint_weights,
    shard_weights,
    write_weights,
)
from splitlm.progress import bar

log = logging.getLogger(__name__)

SHARD_FORMAT = "splitlm-shard/2"  # /1: one weights.safetensors; /2: an index and bounded files
READABLE_FORMATS = ("splitlm-shard/1", SHARD_FORMAT)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "generation_config.json",
)


@dataclass
class Manifest:
    role: str  # "edge" or "cloud"
    model_hash: str
    num_layers: int
    head: int  # K: layers [0, K) on the edge
    tail: int  # M: layers [L-M, L) on the edge
    dtype: str
    topology: str = "tail-local"  # or "split-head"
    fingerprint: str = ""
    format: str = SHARD_FORMAT
    d_end: int = 0  # split-head: the edge holds the LM head's columns [0, d_end)

    def compute_fingerprint(self) -> str:
        key = {k: getattr(self, k) for k in ("model_hash", "num_layers", "head", "tail", "dtype", "topology")}
        if self.topology == "split-head":
            key["d_end"] = self.d_end
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]

    @property
    def cloud_layers(self) -> tuple[int, int]:
        return self.head, self.num_layers - self.tail

    @classmethod
    def read(cls, shard_dir: Path, role: str) -> Manifest:
        path = Path(shard_dir) / "manifest.json"
        if not path.is_file():
            raise SplitLMError(f"{shard_dir}: not a splitlm shard (no manifest.json); create one with `splitlm split`")
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise SplitLMError(f"{path}: not a valid shard manifest ({e}); split the model again") from None
        if data.get("format") not in READABLE_FORMATS:
            raise SplitLMError(f"{shard_dir}: unknown shard format {data.get('format')!r}")
        try:
            m = cls(**data)
        except TypeError as e:
            raise SplitLMError(f"{path}: not a valid shard manifest ({e}); split the model again") from None
        if m.role != role:
            raise SplitLMError(f"{shard_dir} is the {m.role} shard, expected the {role} shard")
        return m


def check_split(num_layers: int, head: int, tail: int) -> None:
    if head < 1 or tail < 0:
        raise SplitLMError(f"--head must be >= 1 and --tail >= 0 (got head={head}, tail={tail})")
    if head + tail >= num_layers:
        raise SplitLMError(f"head + tail = {head + tail} leaves no layer for the cloud (the model has {num_layers})")


TOPOLOGIES = ("tail-local", "split-head")


def stored_dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise SplitLMError(
            f"the checkpoint stores {str(dtype).removeprefix('torch.')}; choose --dtype {', '.join(DTYPES)}"
        )
    return DTYPE_NAMES[dtype]


def layer_of(name: str) -> int | None:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def split_pieces(cfg: ModelConfig, weights: Weights, manifest: Manifest) -> dict[str, dict[str, Piece]]:
    """role -> {shard tensor name: the checkpoint tensor (or columns of it) it is}."""
    lo, hi = manifest.cloud_layers
    cloud = {k: Piece(k) for k in weights.tensors if (i := layer_of(k)) is not None and lo <= i < hi}
    edge = {k: Piece(k) for k in weights.tensors if k not in cloud}
    if manifest.topology == "split-head":
        edge, cloud = split_head_pieces(cfg, edge, cloud, manifest.d_end)
    return {"edge": edge, "cloud": cloud}


def check_split_args(dtype: str, topology: str, tail: int, d_end: int | None, max_file_mb: float) -> None:
    if dtype != "auto" and dtype not in DTYPES:
        raise SplitLMError(f"unknown dtype {dtype!r} (choose from auto, {', '.join(DTYPES)})")
    if topology not in TOPOLOGIES:
        raise SplitLMError(f"unknown topology {topology!r} (choose from {', '.join(TOPOLOGIES)})")
    if topology == "split-head" and tail:
        raise SplitLMError("the split-head topology keeps no tail layers on the edge: use --tail 0 (or omit it)")
    if topology == "tail-local" and d_end is not None:
        raise SplitLMError("--d-end only applies to --topology split-head")
    if not max_file_mb > 0:
        raise SplitLMError(f"--max-file-mb must be positive, got {max_file_mb}")


def split_model(
    model: str,
    head: int = 2,
    tail: int = 2,
    out: str | Path = "split",
    dtype: str = "auto",
    topology: str = "tail-local",
    d_end: int | None = None,
    max_file_mb: float = DEFAULT_MAX_FILE_MB,
) -> Path:
    """Write `out/edge` and `out/cloud`; return `out`.

    dtype: `auto` keeps the checkpoint's own dtype; fp32, bf16 or fp16 cast the floating tensors.
    topology `split-head`: `tail` must be 0; `d_end` = the LM-head columns the edge keeps
    (default: half the hidden size). Each shard's weights are files of at most `max_file_mb`
    MiB; tensors are read and written one at a time, so memory tracks the largest tensor."""
    check_split_args(dtype, topology, tail, d_end, max_file_mb)
    model_dir = resolve_model(model)
    hf = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf)
    check_split(cfg.num_layers, head, tail)
    weights = checkpoint_weights(model_dir)
    stored = weights.dominant_dtype() if dtype == "auto" else DTYPES[dtype]
    if topology == "split-head":
        d_end = check_d_end(cfg, d_end)
        log.info(
            f"splitlm: splitting {model_dir.name} (split-head): edge layers [0,{head}) + LM-head columns [0,{d_end}),"
            f" cloud layers [{head},{cfg.num_layers}) + final norm + LM-head columns [{d_end},{cfg.hidden_size})"
        )
    else:
        log.info(
            f"splitlm: splitting {model_dir.name}: edge layers [0,{head}) + [{cfg.num_layers - tail},{cfg.num_layers}),"
            f" cloud layers [{head},{cfg.num_layers - tail})"
        )
    base = Manifest(
        "edge",
        file_sha256(safetensors_files(model_dir))[:32],
        cfg.num_layers,
        head,
        tail,
        stored_dtype_name(stored),
        topology=topology,
        d_end=d_end or 0,
    )
    base.fingerprint = base.compute_fingerprint()
    pieces = split_pieces(cfg, weights, base)
    specs = {
        role: {name: p.spec(weights.tensors[p.source], stored) for name, p in role_pieces.items()}
        for role, role_pieces in pieces.items()
    }
    total = sum(s.nbytes for role_specs in specs.values() for s in role_specs.values())
    out = Path(out)
    with progress_bar(total, f"splitting {model_dir.name}") as bar:
        for role in ("edge", "cloud"):
            d = out / role
            if d.exists():
                shutil.rmtree(d)
            d.mkdir(parents=True)
            (d / "config.json").write_text(json.dumps(hf, indent=2))
            write_weights(d, specs[role], producer(weights, pieces[role], specs[role]), max_file_mb, done=bar.update)
            (d / "manifest.json").write_text(json.dumps(asdict(Manifest(**{**asdict(base), "role": role})), indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / "edge" / name)
    return out


def producer(weights: Weights, pieces: dict[str, Piece], specs: dict[str, TensorSpec]):
    """name -> the shard's tensor, read from its checkpoint file alone (the map goes with the tensor)."""

    def produce(name: str) -> torch.Tensor:
        piece = pieces[name]
        t = weights.read(piece.source)
        if piece.cols is not None:
            t = t[..., piece.cols[0] : piece.cols[1]]
        return t.to(specs[name].dtype).contiguous()

    return produce


def progress_bar(total: int, desc: str):
    """A byte-counting progress bar on stderr (`splitlm.progress`: a terminal only, never under --quiet)."""
    return bar(total, desc, unit_bytes=True)


class EdgeModel(nn.Module):
    """What stays on the user's machine: embedding, head layers, tail layers, final norm, LM head.

    In the split-head topology there are no tail layers and no final norm, and the LM head is
    only its first `d_end` columns (`end_weight`)."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.split_head = manifest.topology == "split-head"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = LayerStack(cfg, 0, manifest.head)
        self.tail = LayerStack(cfg, cfg.num_layers - manifest.tail, cfg.num_layers)
        self.norm = None if self.split_head else final_norm(cfg)
        head_in = manifest.d_end if self.split_head else cfg.hidden_size
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(head_in, cfg.vocab_size, bias=False)
        self._greedy: GreedyHead | None = None  # `greedy_head()`, built on first use

    @property
    def end_weight(self) -> torch.Tensor:
        """Split-head: the edge's LM-head columns W[:, :d_end], [V, d_end]."""
        return self.embed_tokens.weight[:, : self.manifest.d_end] if self.lm_head is None else self.lm_head.weight

    def embed_and_head(self, ids, positions, new_mask=None, cache=None) -> torch.Tensor:
        return self.head(embed(self.embed_tokens, ids, self.cfg), positions, new_mask, cache)  # [B, T, D]

    def tail_and_logits(self, h, positions, new_mask=None, cache=None, rows=None) -> torch.Tensor:
        h = self.tail(h, positions, new_mask, cache)
        if rows is not None:
            h = h[:, rows]  # the LM head only where logits are needed
        return softcap(
            F.linear(self.norm(h), self.head_weight), self.cfg.final_logit_softcapping
        )  # [B, T or len(rows), V]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, D]

    def lm_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] from final-normed hidden states [R, D] (through the greedy head's product: several
        rows use its blocked copy)."""
        if normed.dim() != 2 or torch.is_grad_enabled():  # the greedy head holds a detached weight
            return softcap(F.linear(normed, self.head_weight), self.cfg.final_logit_softcapping)
        return self.greedy_head().logits(normed)

    def tail_normed(self, h, positions, new_mask=None, cache=None, rows=None) -> torch.Tensor:
        """The final-normed hidden states the LM head reads, [B, T or len(rows), D]."""
        h = self.tail(h, positions, new_mask, cache)
        return self.norm(h if rows is None else h[:, rows])

    def greedy_head(self) -> GreedyHead:
        """The screened LM head, built on first use (after the weights are loaded). Environment
        variable SPLITLM_SCREENED_HEAD: 0 = never screen (saves the bf16 copy of W), 1 = always,
        unset = where a bf16 product is measured to be faster."""
        if self._greedy is None:
            choice = os.environ.get("SPLITLM_SCREENED_HEAD", "").strip()
            if choice not in ("", "0", "1"):
                raise SplitLMError(f"SPLITLM_SCREENED_HEAD must be 0 or 1, not {choice!r}")
            screen = None if choice == "" else choice == "1"
            self._greedy = GreedyHead(self.head_weight.detach(), self.cfg.final_logit_softcapping, screen)
        return self._greedy

    def forget_greedy_head(self) -> None:
        """Drop the screened LM head (after the LM head's weights changed): the next use rebuilds it."""
        self._greedy = None


class CloudModel(nn.Module):
    """What the cloud runs: the middle layers [K, L-M); in the split-head topology layers [K, L),
    the final norm and the LM head's columns W[:, d_end:] (`splitlm.model.splithead.cloud_head`)."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.middle = LayerStack(cfg, *manifest.cloud_layers)
        self.split_head = manifest.topology == "split-head"
        if self.split_head:
            self.norm = final_norm(cfg)
            self.lm_head = nn.Linear(cfg.hidden_size - manifest.d_end, cfg.vocab_size, bias=False)

    def forward(self, h, positions, new_mask=None, cache=None) -> torch.Tensor:
        return self.middle(h, positions, new_mask, cache)


def _read_shard(shard_dir: str | Path, role: str) -> tuple[ModelConfig, Manifest, Weights]:
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        raise SplitLMError(f"shard directory not found: {shard_dir}")
    manifest = Manifest.read(shard_dir, role)
    cfg = ModelConfig.from_hf(read_hf_config(shard_dir))
    return cfg, manifest, shard_weights(shard_dir)


def load_edge(shard_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> EdgeModel:
    """The edge shard on `device`, its weights as `dtype` (None: the dtype the shard stores)."""
    cfg, manifest, weights = _read_shard(shard_dir, "edge")
    with torch.device("meta"):
        model = EdgeModel(cfg, manifest)
    return assign_weights(model, weights, device, dtype or DTYPES[manifest.dtype]).eval()


def load_cloud(
    shard_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> CloudModel:
    """The cloud shard on `device`, its weights as `dtype` (None: the dtype the shard stores)."""
    cfg, manifest, weights = _read_shard(shard_dir, "cloud")
    with torch.device("meta"):
        model = CloudModel(cfg, manifest)
    return assign_weights(model, weights, device, dtype or DTYPES[manifest.dtype]).eval()


def cached_split(
    model: str, head: int = 2, tail: int = 2, topology: str = "tail-local", d_end: int | None = None
) -> Path:
    """A split of `model` made once under `$SPLITLM_CACHE/splits/` (what bench, demo and audit reuse)."""
    name = model.replace("/", "_").strip("_.") or "model"
    kind = f"-m{tail}" if topology == "tail-local" else f"-splithead-d{d_end or 'half'}"
    out = cache_root() / "splits" / f"{name}-k{head}{kind}-fp32"
    done = out / "complete"  # written last: a split cut short (or still being written) is never taken
    if not done.is_file():
        with cache_lock(out):
            if not done.is_file():
                split_model(model, head, tail, out, topology=topology, d_end=d_end)
                done.touch()
    return out
