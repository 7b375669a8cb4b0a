import pytest
import torch

from splitlm.model.kv_cache import KVCache
from splitlm.model.loading import load_model


@pytest.fixture(scope="module")
def model(tiny_llama):
    return load_model(tiny_llama)[0]


def logits_from_scratch(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]), torch.arange(len(ids)))[0]


def test_keep_after_tree_equals_recompute(model):
    prefix = [3, 4, 5, 6]
    # tree of new tokens: 0:a(pos 4) 1:b(pos 4) 2:c child of a(pos 5) 3:d child of b(pos 5) 4:e child of c(pos 6)
    tokens, parents = [20, 21, 22, 23, 24], [-1, -1, 0, 1, 2]
    mask = torch.zeros(5, 5, dtype=torch.bool)
    depth = []
    for i, p in enumerate(parents):
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    positions = torch.tensor([len(prefix) + d for d in depth])
    with torch.no_grad():
        cache = model.stack.new_cache()
        model(torch.tensor([prefix]), torch.arange(len(prefix)), None, cache)
        tree_logits = model(torch.tensor([tokens]), positions, mask, cache)[0]
        # each node's logits equal those of its root-to-node path computed from scratch
        path = [0, 2, 4]
        accepted = prefix + [tokens[i] for i in path]
        scratch = logits_from_scratch(model, accepted)
        torch.testing.assert_close(tree_logits[path], scratch[len(prefix):], atol=1e-5, rtol=1e-5)
        cache.keep(path)
        assert cache.length == len(accepted)
        nxt = model(torch.tensor([[30]]), torch.tensor([len(accepted)]), None, cache)[0, -1]
    torch.testing.assert_close(nxt, logits_from_scratch(model, accepted + [30])[-1], atol=1e-5, rtol=1e-5)


def test_crop_equals_recompute(model):
    ids = [7, 8, 9, 10, 11, 12]
    with torch.no_grad():
        cache = model.stack.new_cache()
        model(torch.tensor([ids]), torch.arange(len(ids)), None, cache)
        model(torch.tensor([[50, 51]]), torch.tensor([6, 7]), None, cache)  # rejected speculation
        cache.crop(4)
        got = model(torch.tensor([[99]]), torch.tensor([4]), None, cache)[0, -1]
    torch.testing.assert_close(got, logits_from_scratch(model, ids[:4] + [99])[-1], atol=1e-5, rtol=1e-5)


def test_cache_bounds_are_checked():
    cache = KVCache(1)
    cache.begin(3)
    cache.update(0, torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    with pytest.raises(IndexError):
        cache.keep([3])
    with pytest.raises(IndexError):
        cache.crop(4)
    cache.keep([2, 0])
    assert cache.length == 2 and cache.k[0].shape[2] == 2
