"""Sampling: the filtered distributions, seeded determinism, and the sequential sampling loop."""

import pytest
import torch

from conftest import make_tiny_llama
from splitlm.decoding.local import LocalSession
from splitlm.decoding.loop import decode
from splitlm.decoding.request import DecodeRequest
from splitlm.decoding.sampling import Sampler, SamplingConfig, sample_token, token_distribution
from splitlm.model.loading import load_model

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_is_argmax_and_ignores_the_generator():
    cfg = SamplingConfig()
    assert cfg.greedy
    assert sample_token(LOGITS, cfg, None) == 0
    assert token_distribution(LOGITS, cfg).tolist() == [1.0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("temperature", [1e-6, 1e-300, 5e-324])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    """Logits / 1e-300 overflow float32 (inf - inf = NaN in the softmax): below vLLM's 1e-5 it is argmax."""
    cfg = SamplingConfig(temperature=temperature)
    assert cfg.greedy
    assert token_distribution(LOGITS * 40, cfg).tolist() == [1.0, 0, 0, 0, 0, 0]
    assert sample_token(LOGITS * 40, cfg, cfg.generator()) == 0
    assert not SamplingConfig(temperature=1e-4).greedy


def test_temperature_scales_the_softmax():
    probs = token_distribution(LOGITS, SamplingConfig(temperature=2.0))
    assert torch.allclose(probs, torch.softmax(LOGITS / 2.0, -1))
    sharp = token_distribution(LOGITS, SamplingConfig(temperature=0.1))
    assert sharp[0] > 0.99


def test_top_k_keeps_the_k_largest():
    probs = token_distribution(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    assert (probs[2:] == 0).all()
    assert torch.allclose(probs[:2], torch.softmax(LOGITS[:2], -1))


def test_top_p_keeps_the_smallest_set_reaching_p():
    full = torch.softmax(LOGITS, -1)  # 0.563, 0.207, 0.126, 0.076, ...
    probs = token_distribution(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    assert (probs[:2] > 0).all() and (probs[2:] == 0).all()  # 0.563 < 0.7 <= 0.563 + 0.207
    assert torch.allclose(probs[:2], full[:2] / full[:2].sum())
    only_first = token_distribution(LOGITS, SamplingConfig(temperature=1.0, top_p=0.01))
    assert only_first.tolist() == [1.0, 0, 0, 0, 0, 0]
    assert torch.isclose(probs.sum(), torch.tensor(1.0))


def test_samples_follow_the_distribution():
    cfg = SamplingConfig(temperature=1.0, seed=3)
    gen = cfg.generator()
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(LOGITS, cfg, gen) for _ in range(n)]), minlength=6)
    expected = torch.softmax(LOGITS, -1) * n
    assert (counts - expected).abs().max() < 4 * expected.sqrt().max()  # within 4 sigma


def test_same_seed_same_tokens_other_seed_other_tokens():
    def draw(seed):
        cfg = SamplingConfig(temperature=1.5, seed=seed)
        gen = cfg.generator()
        return [sample_token(LOGITS, cfg, gen) for _ in range(50)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_sampling_loop_matches_a_cacheless_reference(tmp_path):
    model = load_model(make_tiny_llama(tmp_path / "m", seed=4, vocab_size=64))[0]
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, top_k=20, seed=11)
    prompt = [5, 9, 13, 3]
    out = [t for step in decode(LocalSession(model), DecodeRequest(prompt, 12, set(), sampling=cfg)) for t in step]
    sampler = Sampler(cfg)  # the reference recomputes the whole sequence each step, no KV cache
    ref: list[int] = []
    with torch.inference_mode():
        for _ in range(12):
            ids = torch.tensor([prompt + ref])
            logits = model(ids, torch.arange(ids.shape[1]), None, model.stack.new_cache())[0, -1]
            ref.append(sampler.token(logits, prompt + ref))
    assert out == ref
    eos = {ref[3]}
    stopped = [t for step in decode(LocalSession(model), DecodeRequest(prompt, 12, eos, sampling=cfg)) for t in step]
    assert stopped == ref[: ref.index(ref[3]) + 1]
