"""Attention over several sequences in one call: the batched pass's queries, keys and values padded to
one [P, H, T_max, S_max] problem, so that a pass's kernel launches stop growing with its sequences.

Per sequence, a layer's attention is a dozen small kernels (rotary tables, two cache writes, the
attention, a reshape); on a GPU each costs its launch, and a pass of 64 sessions of the 8B shape
kept the GPU busy for 22 % of its 589 ms (docs/devices.md; 173 ms padded). Here the rotary tables apply once to
the packed rows, the cache
writes and the padded copies of the caches go as a few multi-tensor copies, and one attention call
serves every sequence. The pad costs P × T_max × S_max scores, a good trade on a GPU and a poor one
on a CPU, where the per-sequence path (`Attention.forward`) stays the default.

Padded query rows attend to one zero key (a row that sees no key at all would be NaN); their outputs
are dropped. Padded keys are zeros and masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitlm.model.kv_cache import KVCache

MAX_PAD = 4.0  # the padded scores may be at most this many times the real ones


def padding_pays(shapes: list[tuple[int, int]]) -> bool:
    """Whether sequences of (T_i new rows, S_i keys) are worth padding to one call: the padded problem
    P × T_max × S_max is at most `MAX_PAD` times their own scores (one 256-row prompt chunk among
    decoding steps would pad every step to 256 rows)."""
    t_max, s_max = max(t for t, _ in shapes), max(s for _, s in shapes)
    return len(shapes) * t_max * s_max <= MAX_PAD * sum(t * s for t, s in shapes)


def packed_rope(parts: list) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
    """The parts' rotary tables for their packed rows: local? -> (cos, sin) [1, N, hd]."""
    return {
        local: (
            torch.cat([p.rope[local][0] for p in parts], dim=1),
            torch.cat([p.rope[local][1] for p in parts], dim=1),
        )
        for local in parts[0].rope
    }


@dataclass
class Padding:
    """How a pass's packed rows map to the padded problem (built once per pass, on the rows' device)."""

    t_max: int
    s_max: int
    dest: torch.Tensor  # [N] long: packed row n -> p * t_max + r (sequence p, its row r)
    rope: dict[bool, tuple[torch.Tensor, torch.Tensor]]  # local? -> (cos, sin) [1, N, hd], the parts' packed
    masks: dict[int | None, torch.Tensor]  # window -> [P, 1, T_max, S_max] bool
    starts: list[int]  # first packed row of each sequence
    lengths: list[int]  # T_i
    caches: list[KVCache]  # or `paged_kv.PagedKVCache`s (that module builds on this one: not imported here)

    @classmethod
    def of(cls, parts: list, device: torch.device) -> Padding:
        """From `LayerStack.plan`'s parts (each with a cache and a batch of one row)."""
        shapes = [p.shape for p in parts]
        lengths, s = [t for t, _ in shapes], [keys for _, keys in shapes]
        t_max, s_max = max(lengths), max(s)
        starts = [sum(lengths[:i]) for i in range(len(parts))]
        dest = torch.cat([torch.arange(t, device=device) + i * t_max for i, t in enumerate(lengths)])
        rope = packed_rope(parts)
        masks = {}
        for window in parts[0].masks:
            mask = torch.zeros(len(parts), 1, t_max, s_max, dtype=torch.bool, device=device)
            mask[:, 0, :, 0] = True  # padded query rows see key 0 (their outputs are dropped)
            for i, p in enumerate(parts):
                mask[i, 0, : p.t, : s[i]] = p.masks[window][0, 0]
            masks[window] = mask
        return cls(t_max, s_max, dest, rope, masks, starts, lengths, [p.cache for p in parts])

    def write_and_gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each sequence's new keys and values (packed [1, Hkv, N, hd]) to its cache at `layer`;
        return every sequence's keys and values padded, [P, Hkv, S_max, hd] each."""
        dst, src = [], []
        for cache, start, t in zip(self.caches, self.starts, self.lengths, strict=True):
            k_new, v_new = k.narrow(2, start, t), v.narrow(2, start, t)
            k_slot, v_slot = cache.slots(layer, k_new, v_new)
            dst += [k_slot, v_slot]
            src += [k_new, v_new]
        torch._foreach_copy_(dst, src)  # noqa: SLF001 (one multi-tensor copy: torch's public-in-practice op)
        n = len(self.caches)
        k_pad = k.new_zeros(n, k.shape[1], self.s_max, k.shape[3])
        v_pad = v.new_zeros(n, v.shape[1], self.s_max, v.shape[3])
        dst, src = [], []
        for i, cache in enumerate(self.caches):
            k_all, v_all = cache.view(layer)  # [1, Hkv, S_i, hd]
            dst += [k_pad[i : i + 1, :, : k_all.shape[2]], v_pad[i : i + 1, :, : v_all.shape[2]]]
            src += [k_all, v_all]
        torch._foreach_copy_(dst, src)  # noqa: SLF001
        return k_pad, v_pad

    def pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """Packed queries [1, H, N, hd] -> [P, H, T_max, hd] (zeros in the pad)."""
        rows = q[0].transpose(0, 1)  # [N, H, hd]
        out = rows.new_zeros(len(self.caches) * self.t_max, rows.shape[1], rows.shape[2])
        out.index_copy_(0, self.dest, rows)
        return out.view(len(self.caches), self.t_max, rows.shape[1], rows.shape[2]).transpose(1, 2)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """Attention output [P, H, T_max, hd] -> the packed rows [1, N, H*hd]."""
        p, h, t, hd = y.shape
        return y.transpose(1, 2).reshape(p * t, h * hd).index_select(0, self.dest)[None]
