"""KV cache for a stack of layers, with the keep/crop operations speculative decoding needs."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of `num_layers` consecutive layers, each [B, H_kv, S, head_dim].

    Every forward appends T new entries per layer (`begin(T)`, then `update` per layer).
    After verification, `keep(indices)` retains only the listed entries of the most recent
    append (compacted, in the given order); `crop(n)` truncates to the first n entries.
    """

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0  # committed + pending entries
        self.pending_start = 0  # where the most recent append began
        self.positions = torch.zeros(0, dtype=torch.long)  # [S] position of each entry (sliding windows)

    def begin(self, t: int, positions: torch.Tensor | None = None) -> None:
        self.pending_start = self.length
        self.length += t
        new = torch.full((t,), -1, dtype=torch.long) if positions is None else positions.reshape(-1).long()
        self.positions = torch.cat([self.positions, new])

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_old, v_old = self.k[layer], self.v[layer]
        k = k_new if k_old is None else torch.cat([k_old, k_new], dim=2)
        v = v_new if v_old is None else torch.cat([v_old, v_new], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    def keep(self, indices: list[int] | torch.Tensor) -> None:
        """Keep only entries `pending_start + i` for i in `indices` of the most recent append."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        n_pending = self.length - self.pending_start
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n_pending):
            raise IndexError(f"keep index out of range: pending block has {n_pending} entries")
        start = self.pending_start
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is None:
                continue
            self.k[i] = torch.cat([k[:, :, :start], k[:, :, start + idx]], dim=2)
            self.v[i] = torch.cat([v[:, :, :start], v[:, :, start + idx]], dim=2)
        self.positions = torch.cat([self.positions[:start], self.positions[start + idx]])
        self.length = start + idx.numel()
        self.pending_start = self.length

    def crop(self, n: int) -> None:
        """Truncate to the first n entries."""
        if not 0 <= n <= self.length:
            raise IndexError(f"crop({n}) outside cache of length {self.length}")
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is not None:
                self.k[i], self.v[i] = k[:, :, :n], v[:, :, :n]
        self.positions = self.positions[:n]
        self.length = n
        self.pending_start = min(self.pending_start, n)

    def retain_last(self, n: int) -> None:
        """Drop the oldest entries so that at most n remain (the pending block shifts down with them)."""
        drop = max(0, self.length - n)
        if not drop:
            return
        for i, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            if k is not None:
                self.k[i], self.v[i] = k[:, :, drop:], v[:, :, drop:]
        self.positions = self.positions[drop:]
        self.length -= drop
        self.pending_start = max(0, self.pending_start - drop)

    def clear(self) -> None:
        self.crop(0)
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v if t is not None)
