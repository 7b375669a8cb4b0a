"""A step session over the whole model in this process (no network): tests and local baselines."""

from __future__ import annotations

import time

import torch

from splitlm.decoding.step import StepResult
from splitlm.model.device import to_host
from splitlm.model.llama import Transformer, embed


class LocalSession:
    max_step_tokens: int | None = None  # no cloud cache window caps a step here

    def __init__(self, model: Transformer):
        self.model = model
        self.cache = model.stack.new_cache()

    @property
    def length(self) -> int:
        return self.cache.length

    def settle(self, keep: list[int] | None = None) -> None:
        """Keep only these entries of the last forward's tokens (None: all)."""
        if keep is not None:
            self.cache.keep(keep)

    def crop(self, n: int) -> None:
        """Keep the first n tokens."""
        self.cache.crop(n)

    @torch.inference_mode()
    def forward(
        self,
        ids: list[int],
        positions: list[int] | None = None,
        mask: torch.Tensor | None = None,
        keep: list[int] | None = None,
        rows: list[int] | None = None,
        argmax: bool = False,
        extras: int = 0,
        allowed: torch.Tensor | None = None,
    ) -> StepResult:
        """Like `EdgeSession.forward`: with `extras` = k, the step holds each row's top-k ids and
        final-normed hidden state; with `argmax` and `allowed` [R, V], each row's greedy id among its allowed."""
        start = time.perf_counter()
        if keep is not None:
            self.cache.keep(keep)
        if positions is None:
            positions = list(range(self.cache.length, self.cache.length + len(ids)))
        dev = self.model.embed_tokens.weight.device
        m = self.model
        h = m.stack(
            embed(m.embed_tokens, torch.tensor([ids], device=dev), m.cfg),
            torch.tensor(positions, device=dev),
            None if mask is None else mask.to(dev),
            self.cache,
        )[0]  # [T, D]
        h = h if rows is None else h[rows]
        logits = to_host(m.logits(h))  # [R, V]
        compute_s = time.perf_counter() - start
        greedy = logits if allowed is None else logits.masked_fill(~allowed, -torch.inf)  # [R, V]
        step = StepResult(greedy.argmax(-1) if argmax else logits, len(ids), 0.0, compute_s)
        if extras:
            step.topk, step.hidden = logits.topk(extras, -1).indices, to_host(m.norm(h))
        return step
