"""The cloud's KV memory budget: what the sessions' caches may take on the model's device.

Every open session reserves the bytes its cache needs: at least one block of entries (what its
first step allocates), during a FORWARD what the cache holds while the pass runs (its entries after
crop and keep, plus the request's rows), afterwards what stays allocated (`nbytes` of its cache; a
`none` session gives everything back, a sealed one keeps only ciphertext in host memory). The
single-process cloud pages its caches in one pool (`splitlm.model.paged_kv`): a session holds
blocks of `BLOCK_SIZE` (16) entries, taken as it grows and given back as it shrinks, so the budget
follows the tokens held. The Ray stages keep contiguous `KVCache`s, grown in blocks of 256 entries;
either way the figures are the caches' real allocations.

An OPEN or a FORWARD that would take the reservations over the budget is answered `CAPACITY`
(docs/protocol.md §7): nothing changes, the edge may retry later or go to another cloud.

Not counted: the weights (loaded before the budget is set), the positions (8 bytes per entry), the
pass's transient activations, and sealed blobs (host memory).
"""

from __future__ import annotations

import os

import torch

from splitlm.model.paged_kv import BLOCK_SIZE

AUTO_DEVICE_FRACTION = 0.9  # of the device memory free after loading the weights (CUDA)
AUTO_HOST_FRACTION = 0.25  # of the physical memory (CPU)


def auto_budget(device: torch.device) -> int:
    """The default budget: most of the free device memory on CUDA, a quarter of the RAM elsewhere."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * AUTO_DEVICE_FRACTION)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * AUTO_HOST_FRACTION)
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30


def size_text(n: int) -> str:
    """Bytes for a person: "40.0 MB", "8.0 KB"."""
    return f"{n / 2**20:.1f} MB" if abs(n) >= 2**20 else f"{n / 2**10:.1f} KB"


class KVBudget:
    def __init__(self, budget_bytes: int, bytes_per_entry: int, block: int = BLOCK_SIZE):
        self.budget_bytes, self.bytes_per_entry, self.block = budget_bytes, bytes_per_entry, block

    @classmethod
    def for_model(cls, model, budget_bytes: int = 0, block: int = BLOCK_SIZE) -> KVBudget:
        """`budget_bytes` 0 = automatic (`auto_budget`). Bytes per entry: keys and values of every
        cloud layer, in the model's compute dtype; `block`: the entries a cache allocates at a time."""
        weight = next(model.parameters())
        cfg, layers = model.cfg, len(model.middle.layers)
        per_entry = 2 * layers * cfg.num_kv_heads * cfg.head_dim * weight.element_size()
        return cls(budget_bytes or auto_budget(weight.device), per_entry, block)

    def need(self, entries: int) -> int:
        """Bytes a cache of `entries` entries allocates (whole blocks, at least one)."""
        blocks = max(1, -(-entries // self.block))
        return blocks * self.block * self.bytes_per_entry

    @property
    def max_entries(self) -> int:
        """The largest cache the whole budget holds (whole blocks): a request needing more never fits."""
        return self.budget_bytes // max(1, self.block * self.bytes_per_entry) * self.block

    @property
    def entries(self) -> int:
        """How many cache entries the whole budget holds."""
        return self.budget_bytes // max(1, self.bytes_per_entry)
