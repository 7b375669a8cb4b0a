"""KVCache against the cat-based cache it replaced: random sequences of every operation, both caches
compared after each."""

import random

import pytest
import torch

from splitlm.model.kv_cache import KVCache


class CatCache:
    def __init__(self, num_layers):
        self.k, self.v = [None] * num_layers, [None] * num_layers
        self.length = self.pending_start = 0
        self.positions = torch.zeros(0, dtype=torch.long)

    def begin(self, t, positions=None):
        self.pending_start, self.length = self.length, self.length + t
        new = torch.full((t,), -1, dtype=torch.long) if positions is None else positions.reshape(-1).long()
        self.positions = torch.cat([self.positions, new])

    def update(self, layer, k_new, v_new):
        k_old, v_old = self.k[layer], self.v[layer]
        self.k[layer] = k_new if k_old is None else torch.cat([k_old, k_new], dim=2)
        self.v[layer] = v_new if v_old is None else torch.cat([v_old, v_new], dim=2)
        return self.k[layer], self.v[layer]

    def _select(self, index):  # index [S], or [B, S] per row
        def pick(t):
            return t[:, :, index] if index.dim() == 1 else torch.stack([t[b, :, index[b]] for b in range(len(t))])

        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is not None:
                self.k[i], self.v[i] = pick(k), pick(v)

    def keep(self, indices):
        start = self.pending_start
        idx = torch.as_tensor(indices, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.length - start):
            raise IndexError
        self._select(torch.cat([torch.arange(start), start + idx]))
        self.positions = self.positions[torch.cat([torch.arange(start), start + idx])]
        self.length = self.pending_start = start + idx.numel()

    def keep_per_row(self, choice):
        start = self.pending_start
        self._select(torch.cat([torch.arange(start).expand(len(choice), -1), start + choice[:, None]], 1))
        self.positions = self.positions[: start + 1]
        self.length = self.pending_start = start + 1

    def crop(self, n):
        if not 0 <= n <= self.length:
            raise IndexError
        self._select(torch.arange(n))
        self.positions, self.length, self.pending_start = self.positions[:n], n, min(self.pending_start, n)

    def retain_last(self, n):
        drop = max(0, self.length - n)
        self._select(torch.arange(drop, self.length))
        self.positions, self.length = self.positions[drop:], self.length - drop
        self.pending_start = max(0, self.pending_start - drop)

    def clear(self):
        self.crop(0)
        self.k, self.v = [None] * len(self.k), [None] * len(self.v)


def assert_same(new: KVCache, old: CatCache):
    assert (new.length, new.pending_start) == (old.length, old.pending_start)
    assert torch.equal(new.positions, old.positions)
    for layer in range(new.num_layers):
        got = new.view(layer)
        assert (got is None) == (old.k[layer] is None)
        if got is not None:
            assert torch.equal(got[0], old.k[layer]) and torch.equal(got[1], old.v[layer])


# each operation on both caches at once; `dims`: (layers, rows, heads, hd)
def op_append(rng, caches, n_pending, dims):
    layers, rows, heads, hd = dims
    t = rng.randint(1, 12)
    positions = None if rng.random() < 0.2 else torch.tensor([rng.randint(0, 99) for _ in range(t)])
    for c in caches:
        c.begin(t, positions)
    for layer in range(layers):
        k = torch.randint(-9, 9, (rows, heads, t, hd)).float()
        out = [c.update(layer, k, 2 * k) for c in caches]
        assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def op_keep(rng, caches, n_pending, dims, as_tensor=False):
    idx = rng.sample(range(n_pending), rng.randint(0, n_pending))
    if rng.random() < 0.3:
        idx = list(range(len(idx)))  # a prefix: nothing moves
    for c in caches:
        c.keep(torch.tensor(idx, dtype=torch.long) if as_tensor else idx)


def op_keep_tensor(rng, caches, n_pending, dims):
    op_keep(rng, caches, n_pending, dims, as_tensor=True)


def op_per_row(rng, caches, n_pending, dims):
    if n_pending:
        choice = torch.tensor([rng.randrange(n_pending) for _ in range(dims[1])])
        for c in caches:
            c.keep_per_row(choice)


def op_crop(rng, caches, n_pending, dims):
    n = rng.randint(0, caches[1].length)
    for c in caches:
        c.crop(n)


def op_retain(rng, caches, n_pending, dims):
    n = rng.randint(0, caches[1].length + 2)
    for c in caches:
        c.retain_last(n)


def op_clear(rng, caches, n_pending, dims):
    for c in caches:
        c.clear()
    assert caches[0].nbytes() == 0


def op_bad(rng, caches, n_pending, dims):
    with pytest.raises(IndexError):
        caches[0].keep([n_pending])
    with pytest.raises(IndexError):
        caches[0].crop(caches[1].length + 1)


OPS = {
    "append": op_append,
    "keep": op_keep,
    "keep_t": op_keep_tensor,
    "per_row": op_per_row,
    "crop": op_crop,
    "retain": op_retain,
    "clear": op_clear,
    "bad": op_bad,
}


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_the_cat_based_cache(seed):
    rng = random.Random(seed)
    dims = (3, 1 + seed % 3, 2, 4)  # layers, rows, heads, hd
    new, old = KVCache(dims[0], block=rng.choice([1, 3, 8])), CatCache(dims[0])
    for _ in range(300):
        op = rng.choices(list(OPS), [8, 3, 2, 1, 2, 2, 0.3, 1])[0]
        OPS[op](rng, (new, old), old.length - old.pending_start, dims)
        assert_same(new, old)
        assert new.used_nbytes() <= new.nbytes()
