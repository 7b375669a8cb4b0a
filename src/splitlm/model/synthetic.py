"""Random-weight checkpoints with real models' shapes, made in code (tests, memory and speed benches).

`synthetic_model(TINYLLAMA_1B)` returns a Hugging Face directory (config.json,
model-0000i-of-0000N.safetensors, model.safetensors.index.json) cached under
`cache_root() / "synthetic"`; it is generated tensor by tensor (never the whole model in memory),
into a temporary directory renamed when complete, so a crash leaves no half checkpoint.

The weights are seeded per tensor name, so a checkpoint depends on (spec, seed, device type)
only. Their scale makes the greedy token decisive: embeddings are N(0, 1); projections are
N(0, 1/fan_in), the residual-writing ones (o_proj, down_proj) times `RESIDUAL_GAIN`, so 22 layers
add about twice the embedding's norm to the residual stream; the LM head is the embedding with
its rows permuted (scaled by 1/sqrt(D); a tied head is the embedding itself). The greedy token is
then the image of the last token, several logit standard deviations above the next one, while
the layers move every logit by about as much as the embedding does: a wrong layer shows in the
logits, not in the argmax. Nothing here is a trained model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from splitlm.model.config import ModelConfig
from splitlm.model.device import DTYPES
from splitlm.model.weights import TensorSpec, write_weights

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1  # bump when the weights a spec yields change
RESIDUAL_GAIN = 0.5
BIAS_STD = 0.5
STALE_TMP_S = 3600.0


@dataclass(frozen=True)
class SyntheticSpec:
    name: str
    config: dict[str, Any] = field(hash=False)  # a Hugging Face config.json
    dtype: str = "bf16"
    seed: int = 0
    max_file_mb: float = 512

    @property
    def key(self) -> str:
        text = json.dumps([GENERATOR_VERSION, self.config, self.dtype, self.seed, self.max_file_mb], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def _llama(**overrides) -> dict[str, Any]:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    return {**base, **overrides}


TINYLLAMA_1B = SyntheticSpec(
    "tinyllama-1.1b",
    _llama(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    ),
)
LLAMA3_8B = SyntheticSpec(
    "llama3-8b",
    _llama(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        bos_token_id=128000,
        eos_token_id=128001,
        torch_dtype="bfloat16",
    ),
)
QWEN2_SMALL = SyntheticSpec(
    "qwen2-small",
    dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=2,
        torch_dtype="float32",
    ),
    dtype="fp32",
    max_file_mb=64,
)
SMOLLM2_135M = SyntheticSpec(
    "smollm2-135m",
    dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
    ),
    dtype="fp32",
)
SHAPES = {s.name: s for s in (SMOLLM2_135M, TINYLLAMA_1B, LLAMA3_8B, QWEN2_SMALL)}


def tensor_specs(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """The checkpoint's tensors in Hugging Face names and layer order."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    bias = cfg.qkv_bias or cfg.attention_bias
    specs = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        specs[p + "input_layernorm.weight"] = (d,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            specs[p + f"self_attn.{name}.weight"] = (rows, d)
            if bias:
                specs[p + f"self_attn.{name}.bias"] = (rows,)
        specs[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.attention_bias:
            specs[p + "self_attn.o_proj.bias"] = (d,)
        specs[p + "post_attention_layernorm.weight"] = (d,)
        specs[p + "mlp.gate_proj.weight"] = (f, d)
        specs[p + "mlp.up_proj.weight"] = (f, d)
        specs[p + "mlp.down_proj.weight"] = (d, f)
    specs["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = (cfg.vocab_size, d)
    return {name: TensorSpec(dtype, shape) for name, shape in specs.items()}


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator(device).manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def make_tensor(seed: int, name: str, spec: TensorSpec, device: torch.device) -> torch.Tensor:
    """The tensor `name` of a synthetic checkpoint, made on `device`."""
    leaf = name.rsplit(".", 2)[-2]  # q_proj, embed_tokens, input_layernorm, ...
    if name.endswith("norm.weight"):
        return torch.ones(spec.shape, dtype=spec.dtype, device=device)
    if name == "lm_head.weight":  # the embedding's rows, permuted: [V, D]
        emb = make_tensor(seed, "model.embed_tokens.weight", spec, device)
        perm = torch.randperm(spec.shape[0], generator=_generator(seed, name, device), device=device)
        return emb[perm].mul_(spec.shape[1] ** -0.5)
    t = torch.randn(spec.shape, generator=_generator(seed, name, device), dtype=spec.dtype, device=device)
    if name.endswith(".bias"):
        return t.mul_(BIAS_STD)
    if leaf == "embed_tokens":
        return t
    std = spec.shape[1] ** -0.5 * (RESIDUAL_GAIN if leaf in ("o_proj", "down_proj") else 1.0)
    return t.mul_(std)


def write_synthetic(spec: SyntheticSpec, out_dir: Path, device: str | torch.device = "cpu") -> Path:
    """Generate `spec` into `out_dir` (created), one tensor at a time on `device`."""
    device = torch.device(device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_hf(spec.config)
    specs = tensor_specs(cfg, DTYPES[spec.dtype])
    (out_dir / "config.json").write_text(json.dumps(spec.config, indent=2))
    write_weights(
        out_dir, specs, lambda name: make_tensor(spec.seed, name, specs[name], device), spec.max_file_mb, prefix="model"
    )
    return out_dir


def synthetic_model(spec: SyntheticSpec, root: Path | None = None, device: str | torch.device = "cpu") -> Path:
    """The cached checkpoint of `spec` (made here if missing) under `root` (default `cache_root()/synthetic`)."""
    from splitlm.model.loading import cache_root

    device = torch.device(device)
    root = Path(root) if root is not None else cache_root() / "synthetic"
    out = root / f"{spec.name}-{spec.key}-{device.type}"
    if out.is_dir():
        return out
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob(".tmp-*"):  # left by a crash
        if time.time() - old.stat().st_mtime > STALE_TMP_S:
            shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{spec.name}-"))
    tmp.chmod(0o755)
    try:
        t0 = time.perf_counter()
        write_synthetic(spec, tmp, device)
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.is_dir():  # not another process finishing first
                raise
        log.info("made %s in %.0f s", out, time.perf_counter() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
