"""The paged KV cache (`splitlm.model.paged_kv`) against the contiguous `KVCache`: the same keys, values and
positions after the same edits; blocks taken and given back as the sequences grow and shrink; a packed
pass through paged caches gives what attention per sequence gives, with one write and one gather per layer."""

import copy
import gc
import random

import pytest
import torch
from test_families import make_family
from test_padded import tree_mask

from conftest import make_tiny_llama
from splitlm.model.kv_cache import KVCache
from splitlm.model.loading import load_model
from splitlm.model.paged_kv import BlockPool, PagedKVCache

HKV, HD, LAYERS = 2, 4, 3


def pool(block_size: int = 4) -> BlockPool:
    return BlockPool(LAYERS, (HKV, HD), torch.float32, "cpu", block_size)


def append(caches, t: int, gen: torch.Generator, start_pos: int) -> None:
    """The same t random entries (at positions start_pos..) appended to every cache of `caches`."""
    positions = torch.arange(start_pos, start_pos + t)
    kvs = [(torch.randn(1, HKV, t, HD, generator=gen), torch.randn(1, HKV, t, HD, generator=gen)) for _ in range(3)]
    for cache in caches:
        cache.begin(t, positions)
        for layer, (k, v) in enumerate(kvs):
            cache.update(layer, k, v)


def assert_same(paged: PagedKVCache, ref: KVCache) -> None:
    assert (paged.length, paged.pending_start) == (ref.length, ref.pending_start)
    assert torch.equal(paged.positions, ref.positions)
    for layer in range(LAYERS):
        got, want = paged.view(layer), ref.view(layer)
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert paged.nbytes() == -(-paged.length // paged.block) * paged.block * LAYERS * 2 * HKV * HD * 4


@pytest.mark.parametrize("seed", range(6))
def test_random_edits_equal_the_contiguous_cache(seed):
    """Several paged caches of one pool, edited in an interleaved random order, each equal to its
    contiguous twin after every edit; the pool then holds exactly the blocks their lengths need."""
    rng, gen, shared = random.Random(seed), torch.Generator().manual_seed(seed), pool()
    pairs = [(shared.new_cache(), KVCache(LAYERS)) for _ in range(3)]
    for _ in range(60):
        paged, ref = rng.choice(pairs)
        op = rng.choice(["append", "append", "keep", "crop", "retain", "clear"])
        pending = ref.length - ref.pending_start
        if op == "append":
            append([paged, ref], rng.randint(1, 9), gen, ref.length)
        elif op == "keep" and pending:
            idx = rng.sample(range(pending), rng.randint(0, pending))
            paged.keep(idx)
            ref.keep(idx)
        elif op == "crop":
            n = rng.randint(0, ref.length)
            paged.crop(n)
            ref.crop(n)
        elif op == "retain":
            n = rng.randint(0, ref.length + 2)
            paged.retain_last(n)
            ref.retain_last(n)
        elif op == "clear":
            paged.clear()
            ref.clear()
        assert_same(paged, ref)
        assert shared.used_blocks == sum(len(p.blocks) for p, _ in pairs)
        assert shared.used_blocks == sum(-(-p.length // shared.block_size) for p, _ in pairs)


def test_blocks_come_back_zeroed_on_crop_clear_and_collection():
    shared, gen = pool(block_size=4), torch.Generator().manual_seed(1)
    a, b = shared.new_cache(), shared.new_cache()
    append([a], 10, gen, 0)  # 3 blocks
    append([b], 3, gen, 0)  # 1 block
    assert (len(a.blocks), len(b.blocks), shared.used_blocks) == (3, 1, 4)
    dropped = a.slots(4, 10)
    a.crop(4)  # 1 block: entries 4..7 and 8..9 gone
    assert shared.used_blocks == 2 and a.nbytes() == 4 * shared.bytes_per_entry
    assert not shared.kv.index_select(1, dropped).any()
    b_slots = b.slots()
    del b
    gc.collect()
    assert shared.used_blocks == 1 and not shared.kv.index_select(1, b_slots).any()
    a.clear()
    assert shared.used_blocks == 0 and not shared.kv.any()
    assert a.view(0) is None and a.nbytes() == 0


def test_retain_last_leaves_no_dropped_entry_in_the_pool():
    """A window policy's promise, as the contiguous cache keeps it: no dropped entry stays behind."""
    shared, gen = pool(block_size=4), torch.Generator().manual_seed(2)
    cache = shared.new_cache()
    append([cache], 11, gen, 0)
    dropped = [cache.view(layer)[0][0, :, :7].clone() for layer in range(LAYERS)]
    cache.retain_last(4)
    assert cache.length == 4 and len(cache.blocks) == 1
    flat = shared.kv.reshape(LAYERS, -1, HD)
    for layer in range(LAYERS):
        for row in dropped[layer].reshape(-1, HD):
            assert not (flat[layer] == row).all(dim=-1).any()


def test_keep_per_row_and_wrong_shapes():
    shared, gen = pool(), torch.Generator().manual_seed(3)
    paged, ref = shared.new_cache(), KVCache(LAYERS)
    append([paged, ref], 5, gen, 0)
    append([paged, ref], 3, gen, 5)
    paged.keep_per_row([2])
    ref.keep_per_row([2])
    assert_same(paged, ref)
    paged.begin(1)
    with pytest.raises(ValueError, match="one row"):
        paged.update(0, torch.zeros(2, HKV, 1, HD), torch.zeros(2, HKV, 1, HD))
    with pytest.raises(ValueError, match="do not fit"):
        paged.update(0, torch.zeros(1, HKV + 1, 1, HD), torch.zeros(1, HKV + 1, 1, HD))
    with pytest.raises(IndexError):
        paged.crop(paged.length + 1)


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def stack(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"paged-{request.param}")
    if request.param == "llama":
        make_tiny_llama(path, seed=5)
    else:
        make_family(path, "gemma3", seed=5)  # sliding windows, q/k norms, local rotary base
    return load_model(path)[0].stack


def packed_pass(stack, caches, gen, pasts, news, masks):
    """Histories of `pasts` entries written one sequence at a time, then one packed pass of `news` rows."""
    d = stack.cfg.hidden_size
    for cache, past in zip(caches, pasts, strict=True):
        if past:
            stack(torch.randn(1, past, d, generator=gen), torch.arange(past), None, cache)
    xs = [torch.randn(1, t, d, generator=gen) for t in news]
    positions = [torch.arange(p, p + t) for p, t in zip(pasts, news, strict=True)]
    return stack.forward_packed(xs, positions, masks, caches)


@pytest.mark.parametrize("pad", [False, True])
@torch.inference_mode()
def test_paged_pass_equals_attention_per_sequence(stack, pad):
    stack = copy.deepcopy(stack)
    pasts, news = [5, 17, 30, 0], [1, 4, 7, 3]
    masks = [None, tree_mask(4), None, tree_mask(3)]
    stack.pad_attention = False
    ref_caches = [stack.new_cache() for _ in pasts]
    want = packed_pass(stack, ref_caches, torch.Generator().manual_seed(0), pasts, news, masks)
    stack.pad_attention = pad
    shared = BlockPool.for_stack(stack)
    caches = [shared.new_cache() for _ in pasts]
    got = packed_pass(stack, caches, torch.Generator().manual_seed(0), pasts, news, masks)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for paged, ref in zip(caches, ref_caches, strict=True):
        assert torch.equal(paged.positions, ref.positions)
        for layer in range(len(stack.layers)):
            torch.testing.assert_close(paged.view(layer)[0], ref.view(layer)[0], rtol=1e-5, atol=1e-5)


def count_calls(monkeypatch, name: str, on: BlockPool | None = None) -> list[int]:
    """Counts the calls of tensor method `name` (the one-element list's value; with `on`, only those on the
    storage of that pool's tensor), which still works."""
    calls, orig = [0], getattr(torch.Tensor, name)

    def counted(self, *args, **kwargs):
        if on is None or self.untyped_storage().data_ptr() == on.kv.untyped_storage().data_ptr():
            calls[0] += 1
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("sessions", [1, 3, 8])
@pytest.mark.parametrize("pad", [False, True])
@torch.inference_mode()
def test_one_write_and_one_gather_per_layer_per_pass(stack, sessions, pad, monkeypatch):
    """Whatever the number of sessions in a pass: per layer one index_copy_ (every session's new keys and
    values into the pool) and one index_select (every session's keys and values), no per-session copy."""
    stack = copy.deepcopy(stack)
    stack.pad_attention = pad and sessions > 1
    shared, d = BlockPool.for_stack(stack), stack.cfg.hidden_size
    gen = torch.Generator().manual_seed(7)
    caches = [shared.new_cache() for _ in range(sessions)]
    for i, cache in enumerate(caches):
        stack(torch.randn(1, 3 + 5 * i, d, generator=gen), torch.arange(3 + 5 * i), None, cache)
    counters = {name: count_calls(monkeypatch, name, shared) for name in ("index_copy_", "index_select")}
    counters["copy_"] = count_calls(monkeypatch, "copy_")
    monkeypatch.setattr(PagedKVCache, "update", lambda *a: pytest.fail("a per-session cache write"))
    xs = [torch.randn(1, 1, d, generator=gen) for _ in caches]
    stack.forward_packed(xs, [torch.tensor([c.length]) for c in caches], [None] * sessions, caches)
    layers = len(stack.layers)
    assert counters["index_copy_"][0] == layers
    assert counters["index_select"][0] == layers
    assert counters["copy_"][0] == sessions  # each session's positions, once per pass
