"""A family is a row of traits: `ModelConfig.from_hf` reads it, and nothing outside `model/` asks
which family a model is."""

import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from splitlm import SplitLMError
from splitlm.model import families
from splitlm.model.config import ModelConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "splitlm"

LLAMA = dict(
    model_type="llama",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    eos_token_id=2,
    bos_token_id=1,
)


def test_llama_has_no_family_traits():
    cfg = ModelConfig.from_hf(LLAMA)
    assert (cfg.embed_scale, cfg.norm_offset, cfg.qk_norm, cfg.sandwich_norms, cfg.qkv_bias, cfg.wire_dtype) == (
        1.0,
        False,
        False,
        False,
        False,
        "fp16",
    )
    assert cfg.layer_types == [] and cfg.sliding_window is None and cfg.rope_local_theta is None


def test_gemma3_traits_come_from_its_row():
    cfg = ModelConfig.from_hf(
        {
            **LLAMA,
            "model_type": "gemma3_text",
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        }
    )
    assert cfg.embed_scale == 64**0.5 and cfg.norm_offset and cfg.qk_norm and cfg.sandwich_norms
    assert cfg.wire_dtype == "bf16" and cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
    assert [cfg.layer_window(i) for i in range(4)] == [8, None, 8, None]


def test_qwen2_window_needs_its_switch():
    qwen = {**LLAMA, "model_type": "qwen2", "sliding_window": 10}
    assert ModelConfig.from_hf(qwen).qkv_bias
    assert ModelConfig.from_hf(qwen).sliding_window is None
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).sliding_window == 10


def test_a_llama_like_family_is_one_row(monkeypatch):
    monkeypatch.setitem(families.FAMILIES, "newlm", families.Family())
    cfg = ModelConfig.from_hf({**LLAMA, "model_type": "newlm"})
    assert asdict(cfg) == asdict(replace(ModelConfig.from_hf(LLAMA), model_type="newlm"))
    with pytest.raises(SplitLMError, match="unsupported model architecture 'gpt2'"):
        ModelConfig.from_hf({**LLAMA, "model_type": "gpt2"})


def test_the_gguf_architectures_are_the_rows():
    assert families.SUPPORTED_GGUF_ARCHS == ("llama", "qwen2", "gemma3")


def test_no_code_outside_model_asks_for_the_family():
    """`cfg.gemma`, `model_type == ...` and the like live in `model/` alone; a bundled model's name
    (`gemma3-270m`) in a list of names is fine."""
    asks = re.compile(r"\.gemma\b|\bgemma\s*=|model_type\s*(==|!=|in\b)|is_gemma", re.IGNORECASE)
    found = [
        f"{p.relative_to(SRC)}:{i}: {line.strip()}"
        for p in sorted(SRC.rglob("*.py"))
        if "model" not in p.relative_to(SRC).parts[:1]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if asks.search(line)
    ]
    assert found == []
