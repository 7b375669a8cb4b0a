"""Split a model into an edge shard and a cloud shard, and load each one.

Topology `tail-local` (default):
`DIR/edge/`:  config, tokenizer, embedding, layers [0, K), layers [L-M, L), final norm, LM head.
`DIR/cloud/`: config and layers [K, L-M) only.
Topology `split-head` (`splitlm.model.splithead`): the edge keeps the embedding, layers [0, K)
and the LM head's first D columns; the cloud holds layers [K, L), the final norm and the other
columns. Both shards carry `manifest.json` with the split's fingerprint, which the edge and the
cloud compare in the handshake.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.greedy_head import GreedyHead
from splitlm.model.llama import LayerStack, RMSNorm, embed, rope_inv_freq, softcap
from splitlm.model.loading import (
    file_sha256,
    load_state,
    log,
    read_hf_config,
    resolve_model,
    safetensors_files,
)

SHARD_FORMAT = "splitlm-shard/1"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "generation_config.json")


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
        data = json.loads(path.read_text())
        if data.get("format") != SHARD_FORMAT:
            raise SplitLMError(f"{shard_dir}: unknown shard format {data.get('format')!r}")
        m = cls(**data)
        if m.role != role:
            raise SplitLMError(f"{shard_dir} is the {m.role} shard, expected the {role} shard")
        return m


def check_split(num_layers: int, head: int, tail: int) -> None:
    if head < 1 or tail < 0:
        raise SplitLMError(f"--head must be >= 1 and --tail >= 0 (got head={head}, tail={tail})")
    if head + tail >= num_layers:
        raise SplitLMError(f"head + tail = {head + tail} leaves no layer for the cloud (the model has {num_layers})")


TOPOLOGIES = ("tail-local", "split-head")


def split_model(model: str, head: int = 2, tail: int = 2, out: str | Path = "split", dtype: str = "fp32",
                topology: str = "tail-local", d_end: int | None = None) -> Path:
    """Write `out/edge` and `out/cloud`; return `out`.

    topology `split-head`: `tail` must be 0; `d_end` = the LM-head columns the edge keeps
    (default: half the hidden size)."""
    from splitlm.model.splithead import check_d_end, split_head_state

    if dtype not in DTYPES:
        raise SplitLMError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if topology not in TOPOLOGIES:
        raise SplitLMError(f"unknown topology {topology!r} (choose from {', '.join(TOPOLOGIES)})")
    if topology == "split-head" and tail:
        raise SplitLMError("the split-head topology keeps no tail layers on the edge: use --tail 0 (or omit it)")
    if topology == "tail-local" and d_end is not None:
        raise SplitLMError("--d-end only applies to --topology split-head")
    model_dir = resolve_model(model)
    hf = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf)
    check_split(cfg.num_layers, head, tail)
    if topology == "split-head":
        d_end = check_d_end(cfg, d_end)
        log(f"splitlm: splitting {model_dir.name} (split-head): edge layers [0,{head}) + LM-head columns [0,{d_end}),"
            f" cloud layers [{head},{cfg.num_layers}) + final norm + LM-head columns [{d_end},{cfg.hidden_size})")
    else:
        log(f"splitlm: splitting {model_dir.name}: edge layers [0,{head}) + [{cfg.num_layers - tail},{cfg.num_layers}),"
            f" cloud layers [{head},{cfg.num_layers - tail})")
    state = load_state(model_dir, DTYPES[dtype])
    base = Manifest("edge", file_sha256(safetensors_files(model_dir))[:32], cfg.num_layers, head, tail, dtype,
                    topology=topology, d_end=d_end or 0)
    base.fingerprint = base.compute_fingerprint()

    lo, hi = base.cloud_layers
    def layer_of(name: str) -> int | None:
        return int(name.split(".")[2]) if name.startswith("model.layers.") else None

    cloud = {k: v for k, v in state.items() if (i := layer_of(k)) is not None and lo <= i < hi}
    edge = {k: v for k, v in state.items() if k not in cloud}
    if topology == "split-head":
        edge, cloud = split_head_state(cfg, edge, cloud, d_end)
    out = Path(out)
    for role, tensors in (("edge", edge), ("cloud", cloud)):
        d = out / role
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(hf, indent=2))
        save_file({k: v.contiguous() for k, v in tensors.items()}, d / "weights.safetensors")
        (d / "manifest.json").write_text(json.dumps(asdict(Manifest(**{**asdict(base), "role": role})), indent=2))
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / "edge" / name)
    return out


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
        self.norm = None if self.split_head else RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        head_in = manifest.d_end if self.split_head else cfg.hidden_size
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(head_in, cfg.vocab_size, bias=False)

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
        return softcap(F.linear(self.norm(h), self.head_weight), self.cfg.final_logit_softcapping)  # [B, T or len(rows), V]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # [V, D]

    def tail_and_argmax(self, h, positions, new_mask=None, cache=None, rows=None,
                        allowed: torch.Tensor | None = None) -> torch.Tensor:
        """The greedy token of each row, [T or len(rows)] (batch of one): `tail_and_logits(...)[0].argmax(-1)`
        over the `allowed` ids, through the screened LM head (`splitlm.model.greedy_head`)."""
        h = self.tail(h, positions, new_mask, cache)
        if rows is not None:
            h = h[:, rows]
        return self.greedy_head().argmax(self.norm(h)[0], allowed)

    def greedy_head(self) -> GreedyHead:
        """The screened LM head, built on first use (after the weights are loaded). Environment
        variable SPLITLM_SCREENED_HEAD: 0 = never screen (saves the bf16 copy of W), 1 = always,
        unset = where a bf16 product is measured to be faster."""
        if getattr(self, "_greedy", None) is None:
            choice = os.environ.get("SPLITLM_SCREENED_HEAD", "").strip()
            if choice not in ("", "0", "1"):
                raise SplitLMError(f"SPLITLM_SCREENED_HEAD must be 0 or 1, not {choice!r}")
            screen = None if choice == "" else choice == "1"
            self._greedy = GreedyHead(self.head_weight.detach(), self.cfg.final_logit_softcapping, screen)
        return self._greedy


class CloudModel(nn.Module):
    """What the cloud runs: the middle layers [K, L-M); in the split-head topology layers [K, L),
    the final norm and the LM head's columns W[:, d_end:] (`splitlm.model.splithead.cloud_head`)."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.middle = LayerStack(cfg, *manifest.cloud_layers)
        self.split_head = manifest.topology == "split-head"
        if self.split_head:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
            self.lm_head = nn.Linear(cfg.hidden_size - manifest.d_end, cfg.vocab_size, bias=False)

    def forward(self, h, positions, new_mask=None, cache=None) -> torch.Tensor:
        return self.middle(h, positions, new_mask, cache)


def keep_rope_fp32(model: nn.Module) -> nn.Module:
    """RoPE's inverse frequencies stay fp32 whatever the compute dtype (as in transformers)."""
    for stack in model.modules():
        if isinstance(stack, LayerStack):
            device = stack.inv_freq.device
            stack.inv_freq = rope_inv_freq(stack.cfg).to(device)
            stack.inv_freq_local = rope_inv_freq(stack.cfg, local=True).to(device)
    return model


def _read_shard(shard_dir: str | Path, role: str):
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        raise SplitLMError(f"shard directory not found: {shard_dir}")
    manifest = Manifest.read(shard_dir, role)
    cfg = ModelConfig.from_hf(read_hf_config(shard_dir))
    state = load_file(shard_dir / "weights.safetensors")
    return cfg, manifest, state


def load_edge(shard_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> EdgeModel:
    cfg, manifest, state = _read_shard(shard_dir, "edge")
    model = EdgeModel(cfg, manifest).to(DTYPES[manifest.dtype])
    model.head.load_global_state(state)
    model.tail.load_global_state(state)
    model.embed_tokens.weight.data.copy_(state["model.embed_tokens.weight"])
    if model.norm is not None:
        model.norm.weight.data.copy_(state["model.norm.weight"])
    if model.lm_head is not None:
        model.lm_head.weight.data.copy_(state["lm_head.weight"])
    return keep_rope_fp32(model.to(device=device, dtype=dtype)).eval()


def load_cloud(shard_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> CloudModel:
    cfg, manifest, state = _read_shard(shard_dir, "cloud")
    model = CloudModel(cfg, manifest).to(DTYPES[manifest.dtype])
    model.middle.load_global_state(state)
    if model.split_head:
        model.norm.weight.data.copy_(state["model.norm.weight"])
        model.lm_head.weight.data.copy_(state["lm_head.weight"])
    return keep_rope_fp32(model.to(device=device, dtype=dtype)).eval()
