"""A full model seen as the split sees it: head layers [0, K) on the edge, middle layers
[K, L-M) in the cloud, tail layers [L-M, L) + norm + LM head back on the edge."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splitlm.model.llama import LayerStack, Transformer, embed


def sub_stack(model: Transformer, start: int, end: int) -> LayerStack:
    """Layers [start, end) of `model`, sharing its weights."""
    stack = LayerStack(model.cfg, start, start)
    stack.end = end
    stack.layers = nn.ModuleList(model.stack.layers[start:end])
    stack.windows = model.stack.windows[start:end]
    stack.local_rope = model.stack.local_rope[start:end]
    return stack


class SplitView:
    """`up`: what the cloud receives (layer K's output); `down`: what it sends back (layer L-M's).

    `private_head` / `private_tail`: the edge's own (hardened) layers in place of the public ones;
    `public_head` / `public_tail` stay what anyone with the public weights can run."""

    def __init__(
        self,
        model: Transformer,
        head: int,
        tail: int,
        private_head: LayerStack | None = None,
        private_tail: LayerStack | None = None,
    ):
        n = model.cfg.num_layers
        self.model, self.k, self.tail_layers = model, head, tail
        self.public_head = sub_stack(model, 0, head)
        self.public_tail = sub_stack(model, n - tail, n)
        self.head = private_head if private_head is not None else self.public_head
        self.tail = private_tail if private_tail is not None else self.public_tail
        self.middle = sub_stack(model, head, n - tail)
        self.down_prefix = sub_stack(model, 0, n - tail)  # the public layers that produce `down`

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return embed(self.model.embed_tokens, ids, self.model.cfg)  # [B, T, D]

    def up(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids), torch.arange(ids.shape[1]))  # [B, T, D]

    def down(self, up: torch.Tensor) -> torch.Tensor:
        return self.middle(up, torch.arange(up.shape[1]))  # [B, T, D]

    def logits(self, down: torch.Tensor, tail: LayerStack | None = None) -> torch.Tensor:
        """The edge's logits [B, T, V] from the downlink; `tail`: another tail (the cloud's copy)."""
        return self.model.logits((tail or self.tail)(down, torch.arange(down.shape[1])))


def batched(fn, x: torch.Tensor, batch: int = 16) -> torch.Tensor:
    """fn over the first dimension of x in batches, without gradients."""
    with torch.no_grad():
        return torch.cat([fn(x[i : i + batch]) for i in range(0, x.shape[0], batch)])


def quality(view: SplitView, down: torch.Tensor, ids: torch.Tensor, ref_argmax: torch.Tensor) -> dict[str, float]:
    """Teacher-forced agreement of the next-token argmax with the undefended model, and perplexity."""
    agree, nll, n = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, ids.shape[0], 16):
            logits = view.logits(down[i : i + 16]).float()  # [b, S, V]
            agree += int((logits.argmax(-1) == ref_argmax[i : i + 16]).sum())
            nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[i : i + 16, 1:].flatten(), reduction="sum"))
            n += ids[i : i + 16, 1:].numel()
    return {"agreement": agree / ref_argmax.numel(), "ppl": math.exp(nll / n)}
