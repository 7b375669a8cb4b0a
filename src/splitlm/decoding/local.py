"""A step session over the whole model in this process (no network): tests and local baselines."""

from __future__ import annotations

import time

import torch

from splitlm.decoding.step import StepInput, StepResult
from splitlm.model.device import to_host
from splitlm.model.llama import Transformer, embed


class LocalSession:
    max_step_tokens: int | None = None  # no cloud cache window caps a step here

    def __init__(self, model: Transformer, feature_layers: tuple[int, int] | None = None):
        """`feature_layers` (K, L - M): the layers whose outputs a step's `feature_rows` give as an edge
        split there would (with the final-normed state; `StepResult.features`)."""
        self.model = model
        self.cache = model.stack.new_cache()
        self.feature_layers = feature_layers

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
        x = embed(m.embed_tokens, torch.tensor([ids], device=dev), m.cfg)
        caught: dict[int, torch.Tensor] = {}
        wanted = self.feature_layers if step.feature_rows is not None and self.feature_layers else ()
        hooks = [
            m.stack.layers[i - 1].register_forward_hook(lambda _m, _a, out, i=i: caught.__setitem__(i, out))
            for i in wanted
            if i > 0
        ]
        try:
            full = m.stack(x, torch.tensor(positions, device=dev), None if mask is None else mask.to(dev), self.cache)[
                0
            ]
        finally:
            for hook in hooks:
                hook.remove()
        h = full if rows is None else full[rows]  # [R, D]
        logits = to_host(m.logits(h))  # [R, V]
        compute_s = time.perf_counter() - start
        greedy = logits if step.allowed is None else logits.masked_fill(~step.allowed, -torch.inf)  # [R, V]
        result = StepResult(greedy.argmax(-1) if step.argmax else logits, len(ids), 0.0, compute_s)
        if step.extras:
            result.topk, result.hidden = logits.topk(step.extras, -1).indices, to_host(m.norm(h))
        if step.feature_rows is not None and self.feature_layers is not None:
            fr = step.feature_rows
            low, mid = (caught.get(i, x)[0, fr].float() for i in self.feature_layers)
            result.features = to_host(torch.stack([low, mid, m.norm(full[fr]).float()], 1))  # [F, 3, D]
        return result
