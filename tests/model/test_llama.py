import pytest
import torch

from conftest import BUNDLED_PROMPTS, hf_greedy, make_tiny_llama
from splitlm.model.llama import causal_mask
from splitlm.model.loading import load_model


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def our_greedy(model, ids, n):
    cache = model.stack.new_cache()
    with torch.no_grad():
        logits = model(torch.tensor([ids]), torch.arange(len(ids)), None, cache)
        out = []
        for _ in range(n):
            token = int(logits[0, -1].argmax())
            out.append(token)
            if token in model.cfg.eos_token_ids:
                break
            logits = model(torch.tensor([[token]]), torch.tensor([cache.length]), None, cache)
    return out


TINY_VARIANTS = {
    "tied-gqa": {},
    "untied-mha": {"tie_word_embeddings": False, "num_key_value_heads": 4},
    "llama3-rope": {
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
    },
    "mistral-no-window": {"model_type": "mistral"},
}


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_tiny_logits_and_greedy_match_transformers(tmp_path, variant):
    overrides = dict(TINY_VARIANTS[variant])
    if overrides.pop("model_type", None) == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(1)
        cfg = MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=None,
            eos_token_id=2,
        )
        MistralForCausalLM(cfg).save_pretrained(tmp_path)
    else:
        make_tiny_llama(tmp_path, seed=3, **overrides)
    ours, _ = load_model(tmp_path)
    ref = hf_model(tmp_path)
    ids = torch.randint(3, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids, torch.arange(ids.shape[1]))
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    prompt = ids[0, :7].tolist()
    assert our_greedy(ours, prompt, 40) == hf_greedy(ref, prompt, 40)


def test_mask_among_new_tokens_is_respected(tiny_llama):
    """Two sibling candidates that cannot see each other get the logits each would get alone."""
    model, _ = load_model(tiny_llama)
    prefix = [5, 6, 7]
    with torch.no_grad():
        cache = model.stack.new_cache()
        model(torch.tensor([prefix]), torch.arange(3), None, cache)
        mask = torch.eye(2, dtype=torch.bool)  # siblings at the same position, invisible to each other
        both = model(torch.tensor([[10, 11]]), torch.tensor([3, 3]), mask, cache)[0]
        for j, tok in enumerate([10, 11]):
            alone = model(torch.tensor([prefix + [tok]]), torch.arange(4), causal_mask(4))[0, -1]
            torch.testing.assert_close(both[j], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_bundled_full_model_matches_transformers(bundled_dir, bundled_hf):
    hf, tok = bundled_hf
    ours, _ = load_model("default")
    for prompt in BUNDLED_PROMPTS:
        ids = tok(prompt).input_ids
        with torch.no_grad():
            expected = hf(torch.tensor([ids])).logits
            got = ours(torch.tensor([ids]), torch.arange(len(ids)))
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-4)
        assert our_greedy(ours, ids, 32) == hf_greedy(hf, ids, 32)
