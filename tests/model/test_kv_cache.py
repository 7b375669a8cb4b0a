import random

import pytest
import torch

from splitlm.model.config import ModelConfig
from splitlm.model.kv_cache import KVCache
from splitlm.model.llama import Transformer
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
        torch.testing.assert_close(tree_logits[path], scratch[len(prefix) :], atol=1e-5, rtol=1e-5)
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
    k = torch.arange(6.0).view(1, 1, 3, 2)
    cache.update(0, k, -k)
    for bad in ([3], [-1], torch.tensor([0, 3])):
        with pytest.raises(IndexError):
            cache.keep(bad)
    with pytest.raises(IndexError):
        cache.crop(4)
    with pytest.raises(IndexError):
        cache.crop(-1)
    assert cache.length == 3 and cache.pending_start == 0  # nothing changed
    cache.keep([2, 0])
    keys, values = cache.view(0)
    assert cache.length == 2 and keys.shape == (1, 1, 2, 2)
    assert torch.equal(keys, k[:, :, [2, 0]]) and torch.equal(values, -k[:, :, [2, 0]])
    assert cache.positions.tolist() == [-1, -1]
    cache.begin(2)
    cache.update(0, k[:, :, :2], k[:, :, :2])
    with pytest.raises(ValueError):  # more entries than the pending block holds
        cache.keep([0, 0, 1])


def test_retain_last_moves_down_and_zeroes_what_it_drops():
    cache = KVCache(1, block=8)
    cache.begin(6, torch.arange(10, 16))
    k = torch.arange(1.0, 7.0).view(1, 1, 6, 1)
    cache.update(0, k, k)
    cache.retain_last(4)
    assert cache.view(0)[0].flatten().tolist() == [3, 4, 5, 6] and cache.positions.tolist() == [12, 13, 14, 15]
    assert cache.k_buf[0][0, 0, 4:6].abs().sum() == 0 and cache.v_buf[0][0, 0, 4:6].abs().sum() == 0
    cache.retain_last(1)  # no overlap between what moves and where it goes
    assert cache.view(0)[1].flatten().tolist() == [6] and cache.positions.tolist() == [15]
    assert cache.k_buf[0][0, 0, 1:6].abs().sum() == 0


# --- against recompute, on small random models ------------------------------------------------------


def random_transformer(seed: int, **cfg) -> Transformer:
    base = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**{**base, **cfg})).eval()
    with torch.no_grad():  # larger weights: attention that is far from uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    return model


MODELS = {
    "llama": {},
    "sliding": dict(
        model_type="mistral",
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
    ),
    "gemma3": dict(
        model_type="gemma3_text",
        embed_scale=64**0.5,
        norm_offset=True,
        qk_norm=True,
        sandwich_norms=True,
        wire_dtype="bf16",
        hidden_act="gelu_pytorch_tanh",
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    ),
}


class Oracle:
    """Every entry ever written (tokens [B], position, the entries it saw) and which of them the cache holds."""

    def __init__(self):
        self.tokens, self.positions, self.seen = [], [], []
        self.live, self.pending_start = [], 0

    def append(self, tokens: torch.Tensor, positions: list[int], mask: torch.Tensor) -> None:
        ids = list(range(len(self.tokens), len(self.tokens) + len(positions)))
        self.pending_start = len(self.live)
        for i in range(len(ids)):
            self.tokens.append(tokens[:, i])
            self.positions.append(positions[i])
            self.seen.append(set(self.live) | {ids[j] for j in range(len(ids)) if mask[i, j]})
        self.live += ids

    def recompute(self, model, e: int) -> torch.Tensor:
        """Logits [B, V] of entry e, from scratch: one forward over the entries it depends on."""
        need, todo = set(), [e]
        while todo:
            x = todo.pop()
            if x not in need:
                need.add(x)
                todo += self.seen[x]
        need = sorted(need)
        mask = torch.tensor([[b in self.seen[a] for b in need] for a in need])
        ids = torch.stack([self.tokens[x] for x in need], 1)  # [B, N]
        return model(ids, torch.tensor([self.positions[x] for x in need]), mask)[:, -1]


def random_tree(rng: random.Random, t: int) -> tuple[torch.Tensor, list[int]]:
    """A [t, t] tree mask (node i sees its ancestors and itself) and the depth of each node."""
    mask, depth = torch.zeros(t, t, dtype=torch.bool), []
    for i in range(t):
        p = rng.randint(-1, i - 1)
        mask[i, i] = True
        if p >= 0:
            mask[i] |= mask[p]
        depth.append(0 if p < 0 else depth[p] + 1)
    return mask, depth


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("rows", [1, 2])
def test_random_operations_equal_recompute(name, rows):
    model = random_transformer(7, **MODELS[name])
    rng = random.Random(f"{name}-{rows}")
    cache, oracle = KVCache(model.cfg.num_layers, block=4), Oracle()
    gen = torch.Generator().manual_seed(rows)
    with torch.no_grad():
        for _ in range(40):
            op = rng.choices(["append", "keep", "crop", "retain", "clear"], [6, 3, 2, 2, 0.5])[0]
            n_pending = len(oracle.live) - oracle.pending_start
            if op == "append":
                t = rng.randint(1, 9)
                mask, depth = random_tree(rng, t)
                base = max((oracle.positions[e] for e in oracle.live), default=-1) + 1
                positions = [base + d for d in depth]
                tokens = torch.randint(3, 256, (rows, t), generator=gen)
                oracle.append(tokens, positions, mask)
                model(tokens, torch.tensor(positions), mask, cache)
            elif op == "keep":
                idx = rng.sample(range(n_pending), rng.randint(0, n_pending))
                cache.keep(idx)
                oracle.live = oracle.live[: oracle.pending_start] + [oracle.live[oracle.pending_start + i] for i in idx]
                oracle.pending_start = len(oracle.live)
            elif op == "crop":
                n = rng.randint(0, len(oracle.live))
                cache.crop(n)
                oracle.live, oracle.pending_start = oracle.live[:n], min(oracle.pending_start, n)
            elif op == "retain":
                n = rng.randint(1, len(oracle.live) + 1)
                cache.retain_last(n)
                drop = max(0, len(oracle.live) - n)
                oracle.live, oracle.pending_start = oracle.live[drop:], max(0, oracle.pending_start - drop)
            else:
                cache.clear()
                oracle.live, oracle.pending_start = [], 0
            assert (cache.length, cache.pending_start) == (len(oracle.live), oracle.pending_start)
            assert cache.positions.tolist() == [oracle.positions[e] for e in oracle.live]
            # probe: the logits of a new token over what the cache holds, then take it back out
            pending_start, pos = cache.pending_start, max([oracle.positions[e] for e in oracle.live], default=-1) + 1
            probe = torch.randint(3, 256, (rows, 1), generator=gen)
            got = model(probe, torch.tensor([pos]), None, cache)[:, -1]
            cache.crop(cache.length - 1)
            cache.pending_start = pending_start
            live, ps = list(oracle.live), oracle.pending_start
            oracle.append(probe, [pos], torch.ones(1, 1, dtype=torch.bool))
            torch.testing.assert_close(got, oracle.recompute(model, oracle.live[-1]), atol=1e-4, rtol=1e-4)
            oracle.live, oracle.pending_start = live, ps


def test_keep_per_row_equals_recompute(model):
    rows, prefix_len, n = 3, 5, 4
    gen = torch.Generator().manual_seed(0)
    prefix, siblings = (
        torch.randint(3, 256, (rows, prefix_len), generator=gen),
        torch.randint(3, 256, (rows, n), generator=gen),
    )
    choice = torch.tensor([2, 0, 3])
    with torch.no_grad():
        cache = model.stack.new_cache()
        model(prefix, torch.arange(prefix_len), None, cache)
        model(siblings, torch.full((n,), prefix_len), torch.eye(n, dtype=torch.bool), cache)
        cache.keep_per_row(choice)
        assert cache.length == prefix_len + 1 and cache.positions.tolist() == list(range(prefix_len + 1))
        got = model(torch.full((rows, 1), 9), torch.tensor([prefix_len + 1]), None, cache)[:, -1]
    for b in range(rows):
        ids = prefix[b].tolist() + [int(siblings[b, choice[b]]), 9]
        torch.testing.assert_close(got[b], logits_from_scratch(model, ids)[-1], atol=1e-5, rtol=1e-5)
    with pytest.raises(IndexError):
        cache.begin(2)
        cache.keep_per_row(torch.tensor([0, 2, 1]))


def test_growth_across_blocks_keeps_the_entries():
    cache, keys = KVCache(2, block=4), []
    for t in [3, 1, 5, 4, 1]:
        cache.begin(t, torch.arange(cache.length, cache.length + t))
        k = torch.randn(2, 3, t, 8)
        keys.append(k)
        for layer in range(2):
            out_k, out_v = cache.update(layer, k + layer, k - layer)
            assert torch.equal(out_k, torch.cat(keys, 2) + layer) and torch.equal(out_v, torch.cat(keys, 2) - layer)
        assert cache.k_buf[0].shape[2] == -(-cache.length // 4) * 4  # the next multiple of the block
    assert cache.positions.tolist() == list(range(14))


def test_buffers_follow_the_first_update():
    cache = KVCache(2)
    cache.begin(3, torch.arange(3))
    k = torch.randn(2, 3, 3, 8, dtype=torch.bfloat16)
    cache.update(0, k, k)
    assert cache.k_buf[0].dtype == cache.v_buf[0].dtype == torch.bfloat16 and cache.k_buf[1] is None
    meta = KVCache(2)  # a device other than the CPU: buffers and positions move to it
    meta.begin(3, torch.arange(3))
    meta.update(0, torch.empty(1, 3, 3, 8, device="meta"), torch.empty(1, 3, 3, 8, device="meta"))
    assert meta.k_buf[0].device.type == meta.v_buf[0].device.type == meta.positions.device.type == "meta"
    meta.begin(2, torch.arange(3, 5))
    meta.update(0, torch.empty(1, 3, 2, 8, device="meta"), torch.empty(1, 3, 2, 8, device="meta"))
    meta.keep([1])
    assert meta.positions.device.type == "meta" and meta.length == 4
    with pytest.raises(ValueError):  # every update has the cache's batch size
        cache.begin(1)
        cache.update(0, torch.zeros(1, 3, 1, 8, dtype=torch.bfloat16), torch.zeros(1, 3, 1, 8, dtype=torch.bfloat16))


def test_a_cache_filled_in_inference_mode_changes_outside_it():
    with torch.inference_mode():  # the cloud's forward; its policy changes (retain_last) come outside
        cache = KVCache(1, block=2)
        cache.begin(3, torch.arange(3))
        cache.update(0, torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    cache.retain_last(2)
    cache.begin(2, torch.arange(3, 5))
    cache.update(0, torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))
    cache.keep([1])
    assert cache.length == 3 and cache.positions.tolist() == [1, 2, 4]
    with torch.inference_mode():
        cache.clear()
        fresh = KVCache(1)
    for c in (cache, fresh):
        c.begin(0)
        c.begin(1)
        c.update(0, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
        c.retain_last(0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cache_matches_cpu(model):
    ids, cuda = [5, 6, 7, 8], torch.device("cuda")
    with torch.no_grad():
        model.to(cuda)
        try:
            cache = model.stack.new_cache()
            model(torch.tensor([ids], device=cuda), torch.arange(4, device=cuda), None, cache)
            assert cache.k_buf[0].is_cuda and cache.positions.is_cuda
            model(
                torch.tensor([[9, 10]], device=cuda),
                torch.tensor([4, 4], device=cuda),
                torch.eye(2, dtype=torch.bool),
                cache,
            )
            cache.keep([1])
            got = model(torch.tensor([[11]], device=cuda), torch.tensor([5], device=cuda), None, cache)[0, -1].cpu()
        finally:
            model.to("cpu")
    torch.testing.assert_close(got, logits_from_scratch(model, ids + [10, 11])[-1], atol=1e-4, rtol=1e-4)


def test_nbytes_reports_capacity_and_used_reports_length():
    cache, entry = KVCache(2, block=4), 2 * 3 * 5 * 4  # bytes of one entry: B=2, Hkv=3, hd=5, float32
    assert cache.nbytes() == cache.used_nbytes() == 0
    cache.begin(3)
    for layer in range(2):
        cache.update(layer, torch.zeros(2, 3, 3, 5), torch.zeros(2, 3, 3, 5))
    assert cache.nbytes() == 2 * 2 * 4 * entry and cache.used_nbytes() == 2 * 2 * 3 * entry
    cache.begin(2)
    for layer in range(2):
        cache.update(layer, torch.zeros(2, 3, 2, 5), torch.zeros(2, 3, 2, 5))
    assert cache.nbytes() == 2 * 2 * 8 * entry and cache.used_nbytes() == 2 * 2 * 5 * entry
    cache.crop(1)
    assert cache.nbytes() == 2 * 2 * 8 * entry and cache.used_nbytes() == 2 * 2 * 1 * entry
    cache.clear()
    assert cache.nbytes() == cache.used_nbytes() == 0 and cache.k_buf == [None, None]
