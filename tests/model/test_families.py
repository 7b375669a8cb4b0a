"""Mistral (sliding window), Qwen2 (q/k/v biases, per-layer sliding windows) and Gemma 3 (scaled
embedding, sandwich norms, q/k norms, local/global RoPE and windows) against transformers,
whole and split over a real loopback WebSocket, with and without speculative decoding."""

import random

import pytest
import torch

from conftest import hf_greedy
from splitlm.cloud.server import BackgroundServer
from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.modes import SpecConfig, make_drafter
from splitlm.decoding.request import DecodeRequest, Speculation
from splitlm.decoding.speculative import SpecStats
from splitlm.edge import Edge, EdgeConfig
from splitlm.model.loading import load_model
from splitlm.model.shards import split_model

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    eos_token_id=2,
    bos_token_id=1,
)

FAMILIES = {
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 10, "max_window_layers": 3},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 9,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        },
    ),
}


def make_family(path, family, seed=0):
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**TINY, **extra)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            else:
                p.add_(0.1 * torch.randn_like(p))  # biases and norms away from their trivial init
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, make_family(path, request.param)


def prompts(n=3, length=10):
    rng = random.Random(7)
    return [[rng.randrange(3, 96) for _ in range(length + 3 * i)] for i in range(n)]


def test_logits_match_transformers(family):
    name, path, ref = family
    ours, _ = load_model(path)
    if "sliding" in name:
        assert any(w is not None for w in ours.stack.windows)
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, torch.arange(80)), ref(ids).logits, atol=2e-4, rtol=1e-4)


def test_split_greedy_is_token_identical(family, tmp_path):
    _, path, ref = family
    split = split_model(str(path), head=2, tail=2, out=tmp_path / "split")
    with (
        BackgroundServer(split / "cloud") as server,
        Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge,
    ):
        for ids in prompts():
            expected = hf_greedy(ref, ids, 64)
            assert edge.generate(ids, max_new_tokens=64).token_ids == expected
            assert edge.generate(ids, max_new_tokens=64, spec="auto").token_ids == expected


@pytest.mark.parametrize("mode", ["ngram", "lookahead"])
def test_speculative_matches_sequential_with_windows(family, mode):
    _, path, _ = family
    model, _ = load_model(path)
    for ids in prompts(2, 20):
        outs = []
        for drafter in (Drafter(), make_drafter(SpecConfig(mode))):
            out = []
            for new in decode(
                LocalSession(model),
                DecodeRequest(ids, 48, set(), speculation=Speculation(drafter, StepBudget(fixed_nodes=8), SpecStats())),
            ):
                out.extend(new)
            outs.append(out)
        assert outs[0] == outs[1]


@pytest.mark.slow
def test_gemma3_270m_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from splitlm.model.loading import resolve_model

    model_dir = resolve_model("gemma3-270m")  # assembled and de-quantised once (about a minute)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ours, _ = load_model(model_dir)
    texts = ["The three primary colours are", "def fibonacci(n):\n    ", "Once upon a time, in a village by the sea,"]
    with torch.no_grad():
        ids = torch.tensor([tok(texts[0]).input_ids])
        torch.testing.assert_close(ours(ids, torch.arange(ids.shape[1])), ref(ids).logits, atol=2e-3, rtol=1e-4)
    split = split_model(str(model_dir), head=2, tail=2, out=tmp_path / "split")
    with (
        BackgroundServer(split / "cloud") as server,
        Edge(split / "edge", server.url, EdgeConfig(wire_dtype="fp32")) as edge,
    ):
        for text in texts:
            result = edge.generate(text, max_new_tokens=64)
            assert result.token_ids == hf_greedy(ref, tok(text).input_ids, 64), text
