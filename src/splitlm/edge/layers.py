"""The edge's own layers of one session (`EdgeLayers`): the head and the tail with their KV caches,
and the blocks between them: the last one sent and not yet settled (`pending`) and the last one the
tail ran whose keep it has not applied (`tail_block`). `splitlm.edge.session.EdgeSession` drives it
and tells the cloud side (`splitlm.edge.link.CloudLink`) what it settles."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from splitlm import SplitLMError
from splitlm.decoding.step import StepInput
from splitlm.edge.backends import EdgeBackend, TailOut
from splitlm.edge.link import Flight
from splitlm.transport.messages import Result


@dataclass
class Settled:
    """A settled block's kept entries, to commit on the cloud side."""

    h: torch.Tensor  # [K, D] their head outputs
    positions: list[int]
    keep: list[int] | None  # None: the whole block


@dataclass
class Redo:
    """A rewind: back to the first `n` committed entries, then the entries the guess dropped, recomputed
    by the head (`h` [R, D] at `positions`; None when there are none), to go up as context rows."""

    n: int
    h: torch.Tensor | None
    positions: list[int]
    seconds: float  # the head's compute


class EdgeLayers:
    """The head and tail layers of one session (through the edge's back end) and their caches."""

    def __init__(self, backend: EdgeBackend):
        self.backend = backend
        self.head_cache, self.tail_cache = backend.new_caches()
        self.pending: Flight | None = None  # the last forward's block, not yet settled
        self.tail_block: Flight | None = None  # the last block run through the tail whose keep is not applied there

    @property
    def length(self) -> int:
        return self.head_cache.length

    def head(self, step: StepInput, overlapped: bool) -> Flight:
        """Run the head on a block of new tokens (after the committed ones); it becomes the pending block."""
        positions = step.positions
        if positions is None:
            positions = list(range(self.length, self.length + len(step.ids)))
        n = self.length
        t0 = time.perf_counter()
        h = self.backend.head(step.ids, positions, step.mask, self.head_cache)  # [T, D]
        self.pending = Flight(
            list(step.ids),
            h,
            list(positions),
            step.mask,
            step.rows,
            n,
            step.argmax,
            step.extras,
            allowed=step.allowed,
            edge_s=time.perf_counter() - t0,
            overlapped=overlapped,
        )
        return self.pending

    def tail(self, f: Flight, result: Result) -> TailOut:
        """Run the tail and LM head on block `f`'s reply; its keep applies at the next tail pass (a
        guessed keep may still be rewound)."""
        if self.tail_block is not None:  # the block before this one, settled since
            self.settle_tail()
        out = self.backend.finish(result, f, self.tail_cache)
        self.tail_block = f
        return out

    def settle(self, keep: list[int] | None) -> Settled | None:
        """Resolve the pending block: keep only `keep` (all if None) in the head cache now, in the tail
        cache once it has run the block (a pipelined block's reply may still be in flight); None when
        nothing is pending."""
        f = self.pending
        if f is None:
            return None
        self.pending = None
        f.settle(keep)
        h, pos = f.h, f.positions
        if keep is not None:
            self.head_cache.keep(keep)
            h, pos = h[keep], [pos[i] for i in keep]
        if self.tail_block is f:
            self.settle_tail()
        return Settled(h, pos, keep)

    def settle_tail(self) -> None:
        """Apply the keep of the last block the tail ran, if it has one."""
        f, self.tail_block = self.tail_block, None
        if f is not None and f.keep is not None:
            self.tail_cache.keep(f.keep)

    def crop(self, n: int) -> None:
        """Truncate both caches to their first n committed entries."""
        if not 0 <= n <= self.length:
            raise SplitLMError(f"cannot crop to {n} tokens: the session holds {self.length}")
        self.head_cache.crop(n)
        self.tail_cache.crop(n)

    def rewind(self, f: Flight, keep: list[int]) -> Redo:
        """Block `f` (received) was settled with a guess; really keep `keep` of it. The head cache goes
        back to where guess and `keep` part, and the entries of `keep` past it are recomputed by the
        head; the tail ran the whole block and keeps them."""
        if self.tail_block is not f or not f.settled or self.pending is f:
            raise SplitLMError("rewind needs the received, settled step before the in-flight ones")
        guess = list(range(len(f.ids))) if f.keep is None else f.keep
        common = 0
        while common < min(len(guess), len(keep)) and guess[common] == keep[common]:
            common += 1
        f.settle(keep)
        self.settle_tail()
        self.pending = None
        n = f.start + common
        self.head_cache.crop(n)
        redo = keep[common:]
        pos = [f.positions[i] for i in redo]
        if not redo:
            return Redo(n, None, pos, 0.0)
        t0 = time.perf_counter()
        h = self.backend.head([f.ids[i] for i in redo], pos, None, self.head_cache)  # [R, D]
        return Redo(n, h, pos, time.perf_counter() - t0)
