"""Split a model into an edge shard and a cloud shard, and load each one.

`DIR/edge/`:  config, tokenizer, embedding, layers [0, K), layers [L-M, L), final norm, LM head.
`DIR/cloud/`: config and layers [K, L-M) only. Both carry `manifest.json` with the split's
fingerprint, which the edge and the cloud compare in the handshake.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from splitlm import SplitLMError
from splitlm.model.config import ModelConfig
from splitlm.model.llama import LayerStack, RMSNorm, embed, softcap
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
    topology: str = "tail-local"
    fingerprint: str = ""
    format: str = SHARD_FORMAT

    def compute_fingerprint(self) -> str:
        key = {k: getattr(self, k) for k in ("model_hash", "num_layers", "head", "tail", "dtype", "topology")}
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


def split_model(model: str, head: int = 2, tail: int = 2, out: str | Path = "split", dtype: str = "fp32") -> Path:
    """Write `out/edge` and `out/cloud`; return `out`."""
    if dtype not in DTYPES:
        raise SplitLMError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    model_dir = resolve_model(model)
    hf = read_hf_config(model_dir)
    cfg = ModelConfig.from_hf(hf)
    check_split(cfg.num_layers, head, tail)
    log(f"splitlm: splitting {model_dir.name}: edge layers [0,{head}) + [{cfg.num_layers - tail},{cfg.num_layers}),"
        f" cloud layers [{head},{cfg.num_layers - tail})")
    state = load_state(model_dir, DTYPES[dtype])
    base = Manifest("edge", file_sha256(safetensors_files(model_dir))[:32], cfg.num_layers, head, tail, dtype)
    base.fingerprint = base.compute_fingerprint()

    lo, hi = base.cloud_layers
    def layer_of(name: str) -> int | None:
        return int(name.split(".")[2]) if name.startswith("model.layers.") else None

    cloud = {k: v for k, v in state.items() if (i := layer_of(k)) is not None and lo <= i < hi}
    edge = {k: v for k, v in state.items() if k not in cloud}
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
    """What stays on the user's machine: embedding, head layers, tail layers, final norm, LM head."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.head = LayerStack(cfg, 0, manifest.head)
        self.tail = LayerStack(cfg, cfg.num_layers - manifest.tail, cfg.num_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def embed_and_head(self, ids, positions, new_mask=None, cache=None) -> torch.Tensor:
        return self.head(embed(self.embed_tokens, ids, self.cfg), positions, new_mask, cache)  # [B, T, D]

    def tail_and_logits(self, h, positions, new_mask=None, cache=None, rows=None) -> torch.Tensor:
        h = self.tail(h, positions, new_mask, cache)
        if rows is not None:
            h = h[:, rows]  # the LM head only where logits are needed
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return softcap(F.linear(self.norm(h), w), self.cfg.final_logit_softcapping)  # [B, T or len(rows), V]


class CloudModel(nn.Module):
    """What the cloud runs: the middle layers [K, L-M)."""

    def __init__(self, cfg: ModelConfig, manifest: Manifest):
        super().__init__()
        self.cfg, self.manifest = cfg, manifest
        self.middle = LayerStack(cfg, *manifest.cloud_layers)

    def forward(self, h, positions, new_mask=None, cache=None) -> torch.Tensor:
        return self.middle(h, positions, new_mask, cache)


def _read_shard(shard_dir: str | Path, role: str):
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        raise SplitLMError(f"shard directory not found: {shard_dir}")
    manifest = Manifest.read(shard_dir, role)
    cfg = ModelConfig.from_hf(read_hf_config(shard_dir))
    state = load_file(shard_dir / "weights.safetensors")
    return cfg, manifest, state


def load_edge(shard_dir: str | Path) -> EdgeModel:
    cfg, manifest, state = _read_shard(shard_dir, "edge")
    model = EdgeModel(cfg, manifest).to(DTYPES[manifest.dtype])
    model.head.load_global_state(state)
    model.tail.load_global_state(state)
    model.embed_tokens.weight.data.copy_(state["model.embed_tokens.weight"])
    model.norm.weight.data.copy_(state["model.norm.weight"])
    if model.lm_head is not None:
        model.lm_head.weight.data.copy_(state["lm_head.weight"])
    return model.eval()


def load_cloud(shard_dir: str | Path) -> CloudModel:
    cfg, manifest, state = _read_shard(shard_dir, "cloud")
    model = CloudModel(cfg, manifest).to(DTYPES[manifest.dtype])
    model.middle.load_global_state(state)
    return model.eval()
