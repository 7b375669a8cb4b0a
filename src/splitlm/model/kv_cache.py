"""Preallocated KV cache for a stack of layers, with the keep/crop operations speculative decoding needs."""

from __future__ import annotations

import torch

BLOCK = 256  # entries: capacity grows to the next multiple of this


def _empty(shape: list[int], dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    # a normal tensor, not an inference tensor: buffers are written in place in and out of inference mode
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


def _resized(
    buf: torch.Tensor | None,
    shape: list[int],
    like: torch.Tensor,
    dim: int,
    used: int,
    device: torch.device | None = None,
) -> torch.Tensor:
    """A new buffer of `shape` (dtype of `like`, device of `like` unless given) holding the first `used`
    entries of `buf` along `dim`."""
    new = _empty(shape, like.dtype, like.device if device is None else device)
    if buf is not None and used:
        new.narrow(dim, 0, used).copy_(buf.narrow(dim, 0, used))
    return new


class KVCache:
    """Keys and values of `num_layers` consecutive layers, for B rows that share one length.

    Every forward appends T new entries per layer (`begin(T)`, then `update` per layer, which
    returns the keys/values of all entries so far as [B, H_kv, length, head_dim] views).
    After verification, `keep(indices)` retains only the listed entries of the most recent
    append (compacted, in the given order); `crop(n)` truncates to the first n entries.

    Storage: per layer a key and a value buffer [B, H_kv, capacity, head_dim], allocated on the
    layer's first `update` with the batch size, dtype and device of its keys, and grown (copied) to
    the next multiple of `block` entries when an append needs more room: linear growth, so at most
    one block of slack per layer. keep/crop/retain_last move entries inside the buffers.
    """

    def __init__(self, num_layers: int, block: int = BLOCK):
        self.k_buf: list[torch.Tensor | None] = [None] * num_layers  # [B, Hkv, capacity, hd]
        self.v_buf: list[torch.Tensor | None] = [None] * num_layers
        self.pos_buf = _empty([0], torch.long, None)  # [capacity] position of each entry (sliding windows)
        self.block = block
        self.length = 0  # committed + pending entries
        self.pending_start = 0  # where the most recent append began

    @property
    def num_layers(self) -> int:
        return len(self.k_buf)

    @property
    def positions(self) -> torch.Tensor:
        """[length] long: the position of each entry."""
        return self.pos_buf[: self.length]

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys and values of `layer`, [B, Hkv, length, hd] views; None before its first update."""
        k, v = self.k_buf[layer], self.v_buf[layer]
        return None if k is None else (k.narrow(2, 0, self.length), v.narrow(2, 0, self.length))

    def _room(self, n: int) -> int:
        return -(-n // self.block) * self.block

    def begin(self, t: int, positions: torch.Tensor | None = None) -> None:
        """Start an append of t entries at `positions` ([t] long; None = unknown, stored as -1)."""
        start = self.pending_start = self.length
        self.length += t
        if self.pos_buf.shape[0] < self.length:
            keys = next(iter(self._buffers()), None)
            if keys is not None:  # positions live with the keys
                device = keys.device
            elif positions is not None and not start:  # before there are any, with the first positions given
                device = positions.device
            else:
                device = self.pos_buf.device
            self.pos_buf = _resized(self.pos_buf, [self._room(self.length)], self.pos_buf, 0, start, device)
        new = self.pos_buf.narrow(0, start, t)
        if positions is None:
            new.fill_(-1)
        else:
            new.copy_(positions.reshape(-1))

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the current append's keys/values [B, Hkv, T, hd] to `layer`; return all its entries."""
        k_slot, v_slot = self.slots(layer, k_new, v_new)
        k_slot.copy_(k_new)
        v_slot.copy_(v_new)
        return self.view(layer)

    def slots(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the current append's keys/values (shaped like `k_new`, `v_new` [B, Hkv, T, hd]) go in
        `layer`: views of its buffers, grown first if needed; the caller writes them."""
        end = self.length
        t = k_new.shape[2]
        k, v = self.k_buf[layer], self.v_buf[layer]
        if k is None or k.shape[2] < end:
            k, v = self._grow(layer, k_new, v_new, end - t)
        elif k.shape[0] != k_new.shape[0]:
            raise ValueError(f"the cache holds {k.shape[0]} rows, the update has {k_new.shape[0]}")
        return k.narrow(2, end - t, t), v.narrow(2, end - t, t)

    def _grow(
        self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor, used: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(Re)allocate the buffers of `layer` with room for `length` entries, keeping its first `used`."""
        k, v = self.k_buf[layer], self.v_buf[layer]
        if k is not None and k.shape[0] != k_new.shape[0]:
            raise ValueError(f"the cache holds {k.shape[0]} rows, the update has {k_new.shape[0]}")
        b, h, _, hd = k_new.shape
        cap = self._room(self.length)
        k = _resized(k, [b, h, cap, hd], k_new, 2, used)
        v = _resized(v, [b, h, cap, v_new.shape[3]], v_new, 2, used)
        self.k_buf[layer], self.v_buf[layer] = k, v
        if self.pos_buf.device != k.device:  # positions live with the keys
            self.pos_buf = _resized(self.pos_buf, [self.pos_buf.shape[0]], self.pos_buf, 0, self.length, k.device)
        return k, v

    def _buffers(self) -> list[torch.Tensor]:
        return [t for t in self.k_buf + self.v_buf if t is not None]

    def keep(self, indices: list[int] | torch.Tensor) -> None:
        """Keep only entries `pending_start + i` for i in `indices` of the most recent append
        (at most as many as the append has; validated on the Python list, so a tensor costs one sync)."""
        indices = indices.reshape(-1).tolist() if isinstance(indices, torch.Tensor) else list(indices)
        start, n_pending, m = self.pending_start, self.length - self.pending_start, len(indices)
        if m and (min(indices) < 0 or max(indices) >= n_pending):
            raise IndexError(f"keep index out of range: pending block has {n_pending} entries")
        if m > n_pending:
            raise ValueError(f"keep lists {m} entries, the pending block has {n_pending}")
        if indices != list(range(m)):  # (a prefix is already in place)
            src = torch.tensor([start + i for i in indices], dtype=torch.long, device=self.pos_buf.device)  # [m]
            for buf in self._buffers():
                buf.narrow(2, start, m).copy_(buf.index_select(2, src))
            self.pos_buf.narrow(0, start, m).copy_(self.pos_buf.index_select(0, src))
        self.length = self.pending_start = start + m

    def keep_per_row(self, choice: list[int] | torch.Tensor) -> None:
        """Batch row b keeps only entry `pending_start + choice[b]` of the most recent append.

        Positions are shared by the rows: the kept entry has the position of the append's first entry.
        """
        start, n_pending = self.pending_start, self.length - self.pending_start
        choice = torch.as_tensor(choice, dtype=torch.long, device=self.pos_buf.device).reshape(-1)  # [B]
        if not n_pending or int(choice.min()) < 0 or int(choice.max()) >= n_pending:
            raise IndexError(f"keep index out of range: pending block has {n_pending} entries")
        rows = torch.arange(choice.shape[0], device=choice.device)
        for buf in self._buffers():
            if buf.shape[0] != choice.shape[0]:
                raise ValueError(f"the cache holds {buf.shape[0]} rows, got {choice.shape[0]} choices")
            buf[:, :, start] = buf[rows, :, start + choice]  # [B, Hkv, hd]
        self.length = self.pending_start = start + 1

    def crop(self, n: int) -> None:
        """Truncate to the first n entries."""
        if not 0 <= n <= self.length:
            raise IndexError(f"crop({n}) outside cache of length {self.length}")
        self.length = n
        self.pending_start = min(self.pending_start, n)

    def retain_last(self, n: int) -> None:
        """Drop the oldest entries so that at most n remain (the pending block shifts down with them).

        The vacated slots are zeroed: no dropped entry stays in the buffers (a window policy's promise)."""
        drop = max(0, self.length - n)
        if not drop:
            return
        left = self.length - drop
        for buf, dim in [(b, 2) for b in self._buffers()] + [(self.pos_buf, 0)]:
            src = buf.narrow(dim, drop, left)
            buf.narrow(dim, 0, left).copy_(src.clone() if drop < left else src)  # clone when they overlap
            buf.narrow(dim, left, drop).zero_()
        self.length = left
        self.pending_start = max(0, self.pending_start - drop)

    def clear(self) -> None:
        """Drop every entry and free the buffers."""
        self.crop(0)
        self.k_buf = [None] * self.num_layers
        self.v_buf = [None] * self.num_layers
        self.pos_buf = _empty([0], torch.long, self.pos_buf.device)

    def nbytes(self) -> int:
        """Bytes allocated for keys and values: the buffers' capacity, not their length (positions not counted)."""
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def used_nbytes(self) -> int:
        """Bytes of the keys and values of the `length` entries in use."""
        return sum(t.numel() // t.shape[2] * self.length * t.element_size() for t in self._buffers())
