"""A step session over the whole model in this process (no network): tests and local baselines."""

from __future__ import annotations

import time

import torch

from splitlm.decoding.step import StepInput, StepResult
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
    def forward(self, step: StepInput) -> StepResult:
        """Like `EdgeSession.forward`: with `extras` = k, the step holds each row's top-k ids and
        final-normed hidden state; with `argmax` and `allowed` [R, V], each row's greedy id among its allowed."""
        start = time.perf_counter()
        ids, positions, mask, rows = step.ids, step.positions, step.mask, step.rows
        if step.keep is not None:
            self.cache.keep(step.keep)
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
        greedy = logits if step.allowed is None else logits.masked_fill(~step.allowed, -torch.inf)  # [R, V]
        result = StepResult(greedy.argmax(-1) if step.argmax else logits, len(ids), 0.0, compute_s)
        if step.extras:
            result.topk, result.hidden = logits.topk(step.extras, -1).indices, to_host(m.norm(h))
        return result
