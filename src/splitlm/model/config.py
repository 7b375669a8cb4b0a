"""Model configuration: the subset of a Hugging Face config that our transformer needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from splitlm import SplitLMError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gemma3_text")


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
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding-window layers
    gemma: bool = False  # Gemma 3: scaled embedding, (1 + w) norms around attention and MLP, q/k norms
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (default head_dim)
    final_logit_softcapping: float | None = None
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
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise SplitLMError(
                f"unsupported model architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        gemma = model_type == "gemma3_text"
        # transformers 5 keeps rope settings in `rope_parameters` (Gemma 3: one dict per layer type),
        # 4.x in `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`).
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        local_theta = None
        if gemma:
            local = rope.pop("sliding_attention", None)
            rope = dict(rope.pop("full_attention", rope))
            local_theta = float(local["rope_theta"] if local else hf.get("rope_local_base_freq", 10000.0))
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise SplitLMError(f"unsupported RoPE scaling {rope_type!r}")
        if hf.get("attn_logit_softcapping"):
            raise SplitLMError("attention logit soft-capping is not supported")
        heads = hf["num_attention_heads"]
        window = hf.get("sliding_window")
        if model_type == "qwen2" and not hf.get("use_sliding_window", False):
            window = None
        layer_types = list(hf.get("layer_types") or [])
        if window and not layer_types:  # Mistral: every layer slides
            layer_types = ["sliding_attention"] * hf["num_hidden_layers"]
        eos = hf.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling={**rope, "rope_type": rope_type} if rope_type != "default" else None,
            rope_local_theta=local_theta,
            gemma=gemma,
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            attention_bias=hf.get("attention_bias", False),
            qkv_bias=model_type == "qwen2",
            sliding_window=window,
            layer_types=layer_types,
            mlp_bias=hf.get("mlp_bias", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of a layer (keys at most window-1 positions back), None for full attention."""
        sliding = self.layer_types and self.layer_types[layer] == "sliding_attention"
        return self.sliding_window if sliding and self.sliding_window else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
