"""Model configuration: the subset of a Hugging Face config that our transformer needs.

A family is not a flag here but the traits its row in `splitlm.model.families` sets (scaled
embedding, norm offset, q/k norms, sandwich norms, wire dtype, ...), next to the traits every
config states itself (sliding windows, logit soft-cap, tied head, RoPE bases).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from splitlm import SplitLMError
from splitlm.model.families import FAMILIES, SUPPORTED_MODEL_TYPES, Family


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    rope_local_theta: float | None = None  # the RoPE base of the sliding-window layers (Gemma 3), None = rope_theta
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(D)), rounded to the weights' dtype
    norm_offset: bool = False  # RMSNorm scales by (1 + w) in float32 (Gemma)
    qk_norm: bool = False  # RMSNorm on each head's q and k (Gemma 3)
    sandwich_norms: bool = False  # attention and MLP each between a pre- and a post-norm (Gemma 3)
    wire_dtype: str = "fp16"  # the default activation codec: "bf16" where activations exceed fp16 (Gemma)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    final_logit_softcapping: float | None = None  # logits = tanh(z / cap) * cap
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # biases on q, k, v and o projections
    qkv_bias: bool = False  # biases on q, k, v only (Qwen2)
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # per layer: "full_attention" | "sliding_attention"
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "")
        family = FAMILIES.get(model_type)
        if family is None:
            raise SplitLMError(
                f"unsupported model architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        theta, scaling, local_theta = _rope(hf, family)
        if hf.get("attn_logit_softcapping"):
            raise SplitLMError("attention logit soft-capping is not supported")
        window, layer_types = _windows(hf, family)
        heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        eos = hf.get("eos_token_id")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            embed_scale=hidden**0.5 if family.scaled_embedding else 1.0,
            norm_offset=family.norm_offset,
            qk_norm=family.qk_norm,
            sandwich_norms=family.sandwich_norms,
            wire_dtype=family.wire_dtype,
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            attention_bias=hf.get("attention_bias", False),
            qkv_bias=family.qkv_bias,
            sliding_window=window,
            layer_types=layer_types,
            mlp_bias=hf.get("mlp_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (keys at most window-1 positions back), None for full attention."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding and self.sliding_window else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope(hf: dict[str, Any], family: Family) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling, rope_local_theta). transformers 5 keeps rope settings in
    `rope_parameters` (per layer type where the family's sliding layers have their own base),
    4.x in `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = None
    if family.rope_per_layer_type:
        local = rope.pop("sliding_attention", None)
        rope = dict(rope.pop("full_attention", rope))
        local_theta = float(local["rope_theta"] if local else hf.get("rope_local_base_freq", 10000.0))
    theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "linear"):
        raise SplitLMError(f"unsupported RoPE scaling {rope_type!r}")
    scaling = {**rope, "rope_type": rope_type} if rope_type != "default" else None
    return float(theta), scaling, local_theta


def _windows(hf: dict[str, Any], family: Family) -> tuple[int | None, list[str]]:
    """(sliding_window, layer_types): the window applies where the family's switch (if any) is on;
    a window without per-layer types slides on every layer (Mistral)."""
    window = hf.get("sliding_window")
    if family.window_switch and not hf.get(family.window_switch, False):
        window = None
    layer_types = list(hf.get("layer_types") or [])
    if window and not layer_types:
        layer_types = ["sliding_attention"] * hf["num_hidden_layers"]
    return window, layer_types
