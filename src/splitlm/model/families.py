"""The model families we run: one row each, what sets the family apart from Llama.

`ModelConfig.from_hf` reads the row of a config's `model_type`; nothing else asks which family a
model is (the transformer, the edge and the cloud read the traits the row sets on `ModelConfig`).
A Llama-like family is one more row here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """A family's traits (defaults: Llama's) and where its Hugging Face config differs."""

    scaled_embedding: bool = False  # embeddings are multiplied by sqrt(hidden_size)
    norm_offset: bool = False  # RMSNorm scales by (1 + w), not w
    qk_norm: bool = False  # an RMSNorm on each head's queries and keys
    sandwich_norms: bool = False  # a norm before and after each of attention and MLP
    qkv_bias: bool = False  # biases on the q, k and v projections (o without)
    wire_dtype: str = "fp16"  # the default activation codec: "bf16" where activations exceed fp16's range
    rope_per_layer_type: bool = False  # HF: RoPE settings per layer type, the sliding layers with their own base
    window_switch: str | None = None  # HF: the key that must be true for `sliding_window` to apply
    gguf_arch: str | None = None  # GGUF `general.architecture` we de-quantise into this family


FAMILIES: dict[str, Family] = {  # HF `model_type` -> its row
    "llama": Family(gguf_arch="llama"),  # Llama 1-3, SmolLM
    "mistral": Family(),  # sliding windows on every layer, from `sliding_window` alone
    "qwen2": Family(qkv_bias=True, window_switch="use_sliding_window", gguf_arch="qwen2"),
    "gemma3_text": Family(
        scaled_embedding=True,
        norm_offset=True,
        qk_norm=True,
        sandwich_norms=True,
        wire_dtype="bf16",
        rope_per_layer_type=True,
        gguf_arch="gemma3",
    ),
}

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
SUPPORTED_GGUF_ARCHS = tuple(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)
