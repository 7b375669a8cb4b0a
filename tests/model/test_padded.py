"""One padded attention call per pass (`splitlm.model.padded`, the GPU's default) gives what attention per
sequence gives: the same outputs and the same caches, with tree masks, sliding windows and q/k norms."""

import copy

import pytest
import torch
from test_families import make_family

from conftest import make_tiny_llama
from splitlm.model.loading import load_model
from splitlm.model.padded import padding_pays


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def stack(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"padded-{request.param}")
    if request.param == "llama":
        make_tiny_llama(path, seed=4)
    else:
        make_family(path, "gemma3", seed=4)
    model, _ = load_model(path)
    return model.stack


def tree_mask(t: int) -> torch.Tensor:
    """A small token tree's visibility: node i sees the root, its parent's line and itself."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, t)]
    mask = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@torch.inference_mode()
def test_padded_pass_equals_attention_per_sequence(stack, device):
    if device != "cpu":
        stack = copy.deepcopy(stack).to(device)
    gen = torch.Generator().manual_seed(0)
    d = stack.cfg.hidden_size
    tol = 1e-5 if device == "cpu" else 1e-4  # the GPU's attention kernels differ with the shapes
    pasts, news = [5, 17, 30, 0], [1, 4, 7, 3]
    caches = []
    for past in pasts:
        cache = stack.new_cache()
        if past:
            stack(torch.randn(1, past, d, generator=gen).to(device), torch.arange(past, device=device), None, cache)
        caches.append(cache)
    xs = [torch.randn(1, t, d, generator=gen).to(device) for t in news]
    positions = [torch.arange(p, p + t, device=device) for p, t in zip(pasts, news, strict=True)]
    masks = [None, tree_mask(4).to(device), None, tree_mask(3).to(device)]
    outs = {}
    after = {}
    for padded in (False, True):
        stack.pad_attention = padded
        mine = copy.deepcopy(caches)
        outs[padded] = stack.forward_packed(xs, positions, masks, mine)
        mine[1].keep([0, 2])  # then a second pass on what verification kept
        outs[padded] += stack.forward_packed(
            [xs[1][:, :2], xs[0]], [positions[1][:2] + 2, positions[0] + 1], [None, None], [mine[1], mine[0]]
        )
        after[padded] = mine
    stack.pad_attention = None
    for a, b in zip(outs[False], outs[True], strict=True):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)
    for a, b in zip(after[False], after[True], strict=True):
        assert a.length == b.length
        assert torch.equal(a.positions, b.positions)
        for layer in range(a.num_layers):
            for x, y in zip(a.view(layer), b.view(layer), strict=True):
                torch.testing.assert_close(y, x, atol=tol, rtol=tol)


def test_padding_is_chosen_for_several_cached_single_row_sequences(stack):
    x = torch.zeros(1, 3, stack.cfg.hidden_size)
    parts = [stack.plan(x, torch.arange(3), None, stack.new_cache()) for _ in range(2)]
    assert stack.pads(parts, x) is False  # on a CPU, by default
    stack.pad_attention = True
    try:
        assert stack.pads(parts, x)
        assert not stack.pads(parts[:1], x)  # one sequence: nothing to pad
        assert not stack.pads(parts + [stack.plan(x, torch.arange(3), None, None)], x)  # one without a cache
    finally:
        stack.pad_attention = None


def test_padding_pays_unless_the_pad_is_most_of_the_work():
    assert padding_pays([(23, 300), (20, 310), (25, 290)])  # decoding steps alike
    assert padding_pays([(1, 50), (4, 60)])  # 2 × 4 × 60 = 480 against 290: under 4×
    assert not padding_pays([(256, 256)] + [(23, 300)] * 8)  # a prompt chunk among decoding steps
