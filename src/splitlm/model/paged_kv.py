"""A paged KV cache: the keys and values of many sequences in fixed-size blocks of one pool.

`BlockPool` holds, for every layer of a stack, one tensor of slots [L, slots, 2, Hkv, hd] (a key and a
value per slot); slots come in blocks of `block_size` consecutive entries. A `PagedKVCache` is one
sequence's block table: entry i of the sequence lives in slot `blocks[i // bs] * bs + i % bs`. A
sequence takes blocks as it grows and gives them back (zeroed) when it shrinks (crop, keep, a window
policy) or is cleared, and when the cache object is garbage-collected. The cache behaves as the
contiguous `KVCache` (same begin/update/view/keep/crop/retain_last/clear, one row per sequence), so
sealing, policies and the runner use it unchanged; `nbytes` counts the blocks it holds.

`PagedPass` serves a packed pass of several sequences of one pool (`LayerStack.forward_packed`): per
layer, ONE `index_copy_` writes every sequence's new keys and values into the pool and ONE
`index_select` gathers every sequence's keys and values (packed one after another, or padded to one
[P, S_max] problem); attention then reads views of the gathered tensor.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch

from splitlm.model.padded import Padding, packed_rope

BLOCK_SIZE = 16  # entries per block (docs/decisions.md: the granularity of what a session holds)


def _arange(n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, dtype=torch.long, device=device)


class BlockPool:
    """The slots of `num_layers` layers, handed out in blocks; grown (copied) when more blocks are needed.

    Thread-safe for taking and giving back blocks (the event loop frees caches, the compute thread fills them)."""

    def __init__(
        self,
        num_layers: int,
        kv_shape: tuple[int, int],  # (Hkv, hd)
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        block_size: int = BLOCK_SIZE,
    ):
        self.num_layers, self.kv_shape, self.dtype = num_layers, tuple(kv_shape), dtype
        self.device, self.block_size = torch.device(device or "cpu"), block_size
        with torch.inference_mode(False):  # written in place in and out of inference mode
            self.kv = torch.zeros(num_layers, 0, 2, *kv_shape, dtype=dtype, device=self.device)
        self.free: list[int] = []
        self.lock = threading.RLock()  # a finalizer may give blocks back while this thread takes some

    @classmethod
    def for_stack(cls, stack, block_size: int = BLOCK_SIZE) -> BlockPool:
        """A pool for `stack`'s layers (a `LayerStack`), in its weights' dtype and on their device."""
        weight = next(stack.parameters())
        cfg = stack.cfg
        return cls(len(stack.layers), (cfg.num_kv_heads, cfg.head_dim), weight.dtype, weight.device, block_size)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[1] // self.block_size

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def bytes_per_entry(self) -> int:
        hkv, hd = self.kv_shape
        return self.num_layers * 2 * hkv * hd * self.kv.element_size()

    def new_cache(self) -> PagedKVCache:
        return PagedKVCache(self)

    def take(self, n: int) -> list[int]:
        """n free blocks (the pool grows by at least a quarter when it runs out)."""
        with self.lock:
            if len(self.free) < n:
                self._grow(max(n - len(self.free), self.num_blocks // 4, 4))
            taken, self.free = self.free[-n:] if n else [], self.free[: len(self.free) - n]
            return taken

    def give_back(self, blocks: list[int]) -> None:
        """Blocks a sequence no longer holds: zeroed (no entry stays behind) and free again."""
        if not blocks:
            return
        with self.lock:
            self.kv.index_fill_(1, self.slots_of(blocks), 0)
            self.free += blocks

    def _grow(self, more: int) -> None:
        old = self.num_blocks
        with torch.inference_mode(False):
            kv = self.kv.new_zeros(self.num_layers, (old + more) * self.block_size, 2, *self.kv_shape)
        kv.narrow(1, 0, self.kv.shape[1]).copy_(self.kv)
        self.kv = kv
        self.free = list(range(old + more - 1, old - 1, -1)) + self.free  # lowest ids are taken first

    def slots_of(self, blocks: list[int]) -> torch.Tensor:
        """[len(blocks) * bs] long: the slots of `blocks`, in order."""
        ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return (ids[:, None] * self.block_size + _arange(self.block_size, self.device)).reshape(-1)


def _give_back(pool: BlockPool, blocks: list[int]) -> None:
    pool.give_back(list(blocks))
    blocks.clear()


class PagedKVCache:
    """One sequence's entries in `pool`: its block table, length and positions (see the module doc)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0  # committed + pending entries
        self.pending_start = 0  # where the most recent append began
        self.pos_buf = torch.empty(0, dtype=torch.long, device=pool.device)  # [capacity]
        self.written: set[int] = set()  # layers written since the last clear (`view` is None for the others)
        self._table: torch.Tensor | None = None  # [len(blocks) * bs] slots, rebuilt when the blocks change
        self._finalizer = weakref.finalize(self, _give_back, pool, self.blocks)

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def block(self) -> int:
        return self.pool.block_size

    @property
    def positions(self) -> torch.Tensor:
        """[length] long: the position of each entry."""
        return self.pos_buf[: self.length]

    def slots(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """[hi - lo] long: the pool slots of entries lo..hi (default: all entries)."""
        if self._table is None:
            self._table = self.pool.slots_of(self.blocks)
        return self._table[lo : self.length if hi is None else hi]

    def _fit(self, entries: int) -> None:
        """Hold exactly the blocks `entries` entries need: take more, or give the surplus back."""
        need = -(-entries // self.block)
        if need > len(self.blocks):
            self.blocks += self.pool.take(need - len(self.blocks))
        elif need < len(self.blocks):
            surplus = self.blocks[need:]
            del self.blocks[need:]
            self.pool.give_back(surplus)
        else:
            return
        self._table = None

    def begin(self, t: int, positions: torch.Tensor | None = None) -> None:
        """Start an append of t entries at `positions` ([t] long; None = unknown, stored as -1)."""
        start = self.pending_start = self.length
        self.length += t
        self._fit(self.length)
        if self.pos_buf.shape[0] < self.length:
            grown = torch.full((len(self.blocks) * self.block,), -1, dtype=torch.long, device=self.pool.device)
            grown[:start] = self.pos_buf[:start]
            self.pos_buf = grown
        new = self.pos_buf.narrow(0, start, t)
        if positions is None:
            new.fill_(-1)
        else:
            new.copy_(positions.reshape(-1))

    def _check(self, k_new: torch.Tensor) -> None:
        if k_new.shape[0] != 1:
            raise ValueError(f"a paged cache holds one row, the update has {k_new.shape[0]}")
        if tuple(k_new.shape[1:2]) + tuple(k_new.shape[3:]) != self.pool.kv_shape:
            raise ValueError(f"keys {list(k_new.shape)} do not fit the pool's (Hkv, hd) {self.pool.kv_shape}")

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current append's keys/values [1, Hkv, T, hd] to `layer`; return all its entries."""
        self._check(k_new)
        t = k_new.shape[2]
        kv = torch.stack([k_new[0], v_new[0]]).permute(2, 0, 1, 3)  # [T, 2, Hkv, hd]
        self.pool.kv[layer].index_copy_(0, self.slots(self.length - t, self.length), kv.to(self.pool.dtype))
        self.written.add(layer)
        return self.view(layer)

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values of `layer`, [1, Hkv, length, hd] (gathered copies); None before its first update."""
        if layer not in self.written:
            return None
        kv = self.pool.kv[layer].index_select(0, self.slots())  # [S, 2, Hkv, hd]
        return kv[:, 0].transpose(0, 1)[None], kv[:, 1].transpose(0, 1)[None]

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entries at slots `src` copied to slots `dst` in every layer (positions are the caller's)."""
        self.pool.kv.index_copy_(1, dst, self.pool.kv.index_select(1, src))

    def keep(self, indices: list[int] | torch.Tensor) -> None:
        """Keep only entries `pending_start + i` for i in `indices` of the most recent append (as `KVCache.keep`)."""
        indices = indices.reshape(-1).tolist() if isinstance(indices, torch.Tensor) else list(indices)
        start, n_pending, m = self.pending_start, self.length - self.pending_start, len(indices)
        if m and (min(indices) < 0 or max(indices) >= n_pending):
            raise IndexError(f"keep index out of range: pending block has {n_pending} entries")
        if m > n_pending:
            raise ValueError(f"keep lists {m} entries, the pending block has {n_pending}")
        if indices != list(range(m)):  # (a prefix is already in place)
            src = torch.tensor([start + i for i in indices], dtype=torch.long, device=self.pool.device)  # [m]
            self._move(self.slots().index_select(0, src), self.slots(start, start + m))
            self.pos_buf.narrow(0, start, m).copy_(self.pos_buf.index_select(0, src))
        self.length = self.pending_start = start + m
        self._fit(self.length)

    def keep_per_row(self, choice: list[int] | torch.Tensor) -> None:
        """One row: keep only entry `pending_start + choice[0]` of the most recent append."""
        choice = torch.as_tensor(choice, dtype=torch.long).reshape(-1).tolist()
        if len(choice) != 1:
            raise ValueError(f"the cache holds 1 row, got {len(choice)} choices")
        first = self.pos_buf[self.pending_start].clone() if self.length > self.pending_start else None
        self.keep(choice)
        self.pos_buf[self.pending_start - 1] = first  # positions are the append's first entry's, as KVCache's

    def crop(self, n: int) -> None:
        """Truncate to the first n entries (the blocks past them are given back)."""
        if not 0 <= n <= self.length:
            raise IndexError(f"crop({n}) outside cache of length {self.length}")
        self.length = n
        self.pending_start = min(self.pending_start, n)
        self._fit(n)

    def retain_last(self, n: int) -> None:
        """Drop the oldest entries so that at most n remain (the pending block shifts down with them);
        the vacated slots are zeroed and the blocks no longer needed given back."""
        drop = max(0, self.length - n)
        if not drop:
            return
        left, old = self.length - drop, self.length
        slots = self.slots()
        with self.pool.lock:  # the pool must not grow under the move
            self._move(slots[drop:old], slots[:left])
            self.pool.kv.index_fill_(1, slots[left:old], 0)
        self.pos_buf[:left] = self.pos_buf[drop:old].clone()
        self.pos_buf[left:old] = 0
        self.length = left
        self.pending_start = max(0, self.pending_start - drop)
        self._fit(left)

    def clear(self) -> None:
        """Drop every entry and give every block back."""
        self.crop(0)
        self.written.clear()
        self.pos_buf = self.pos_buf[:0].clone()

    def nbytes(self) -> int:
        """Bytes of keys and values in the blocks this sequence holds."""
        return len(self.blocks) * self.block * self.pool.bytes_per_entry

    def used_nbytes(self) -> int:
        """Bytes of the keys and values of the `length` entries in use."""
        return self.length * self.pool.bytes_per_entry


def shared_pool(caches: list) -> BlockPool | None:
    """The pool every one of `caches` is paged in, or None (a cache missing, contiguous, or another pool)."""
    pools = {id(c.pool): c.pool for c in caches if isinstance(c, PagedKVCache)}
    if len(pools) != 1 or not all(isinstance(c, PagedKVCache) for c in caches):
        return None
    return next(iter(pools.values()))


@dataclass
class PagedPass:
    """A packed pass of sequences of one pool: where their new rows go and where all their keys are."""

    pool: BlockPool
    new_slots: torch.Tensor  # [N] the slots of the pass's packed new rows
    key_slots: torch.Tensor  # [sum S_i] the slots of every sequence's entries, or [P * S_max] when padded
    key_starts: list[int]  # where sequence i's keys begin in the gathered rows
    key_lengths: list[int]  # S_i
    rope: dict  # local? -> (cos, sin) [1, N, hd]: the packed rows' rotary tables
    padding: Padding | None = None  # attention padded to one [P, T_max, S_max] call (`splitlm.model.padded`)

    @classmethod
    def of(cls, parts: list, padding: Padding | None = None) -> PagedPass:
        """From `LayerStack.plan`'s parts (each with a paged cache of one pool, its append begun)."""
        caches, ts = [p.cache for p in parts], [p.t for p in parts]
        pool = caches[0].pool
        new = torch.cat([c.slots(c.length - t, c.length) for c, t in zip(caches, ts, strict=True)])
        lengths = [c.length for c in caches]
        for c in caches:  # the pass writes every layer of the pool
            c.written.update(range(pool.num_layers))
        rope = packed_rope(parts)
        if padding is not None:  # pad keys read slot 0 of the pool: masked
            s_max = max(lengths)
            keys = torch.zeros(len(caches), s_max, dtype=torch.long, device=pool.device)
            for i, c in enumerate(caches):
                keys[i, : c.length] = c.slots()
            return cls(pool, new, keys.reshape(-1), [i * s_max for i in range(len(caches))], lengths, rope, padding)
        starts = [sum(lengths[:i]) for i in range(len(caches))]
        return cls(pool, new, torch.cat([c.slots() for c in caches]), starts, lengths, rope)

    def write_and_gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write the packed new keys/values [1, Hkv, N, hd] of `layer` (one index_copy_) and return every
        sequence's keys and values (one index_select): [sum S_i, 2, Hkv, hd], or [P, S_max, 2, Hkv, hd] padded."""
        store = self.pool.kv[layer]  # [slots, 2, Hkv, hd]
        store.index_copy_(0, self.new_slots, torch.stack([k[0], v[0]]).permute(2, 0, 1, 3).to(store.dtype))
        kv = store.index_select(0, self.key_slots)
        return kv if self.padding is None else kv.view(len(self.key_lengths), -1, *kv.shape[1:])

    def keys(self, kv: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's keys and values from the packed gather, [1, Hkv, S_i, hd] views each."""
        part = kv.narrow(0, self.key_starts[i], self.key_lengths[i])  # [S_i, 2, Hkv, hd]
        return part[:, 0].transpose(0, 1)[None], part[:, 1].transpose(0, 1)[None]
