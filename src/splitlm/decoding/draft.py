"""Draft models on the edge: a small model of the same vocabulary, or the edge's own layers.

A `DraftLM` runs causally over its own KV caches. `ModelDrafter` rolls its top-1 continuation out
from the root for up to `max_depth` tokens and adds, at every depth, the next `top_k - 1`
alternatives as leaves; it stops when the best continuation's probability falls under `min_prob`.
Node scores are the draft's conditional probabilities (the budget calibrates them). Draft weights
and drafts never leave the edge.

Self-draft: embedding → head layers [0, K) → (an optional linear adapter) → tail layers
[L−M, L) → final norm → LM head, skipping the cloud. Without an adapter the tail layers see
layer-K activations where they expect layer-(L−M) ones; `splitlm train-draft` fits the adapter
(ridge regression from the full model's layer-K to layer-(L−M) hidden states on local text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from splitlm import SplitLMError
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.tree import TokenTree
from splitlm.model.device import to_host
from splitlm.model.llama import Transformer, embed, softcap

ADAPTER_FILE = "draft_adapter.safetensors"


class DraftLM(Protocol):
    def new_state(self) -> object: ...

    def logits(self, ids: list[int], positions: list[int], state) -> torch.Tensor: ...  # [T, V]

    def crop(self, state, n: int) -> None: ...


class ModelDraft:
    """A separate small model (our Transformer) that shares the target's tokenizer."""

    def __init__(self, model: Transformer):
        self.model = model

    def new_state(self):
        return self.model.stack.new_cache()

    @torch.inference_mode()
    def logits(self, ids, positions, state) -> torch.Tensor:
        dev = self.model.embed_tokens.weight.device
        return to_host(self.model(torch.tensor([ids], device=dev), torch.tensor(positions, device=dev), None, state)[0])

    def crop(self, state, n: int) -> None:
        state.crop(n)


class SelfDraft:
    """The edge's own head and tail layers and LM head, with an optional adapter W [D+1, D] between them."""

    def __init__(self, edge_model, adapter: torch.Tensor | None = None):
        if getattr(edge_model, "split_head", False) or edge_model.norm is None:
            raise SplitLMError("self-draft needs a tail-local edge shard (split-head keeps no tail layers)")
        w = edge_model.embed_tokens.weight
        self.m, self.adapter = edge_model, None if adapter is None else adapter.to(w.device, torch.float32)

    def new_state(self):
        return self.m.head.new_cache(), self.m.tail.new_cache()

    @torch.inference_mode()
    def logits(self, ids, positions, state) -> torch.Tensor:
        head_cache, tail_cache = state
        dev = self.m.embed_tokens.weight.device
        pos = torch.tensor(positions, device=dev)
        h = self.m.head(embed(self.m.embed_tokens, torch.tensor([ids], device=dev), self.m.cfg), pos, None,
                        head_cache)  # [1, T, D]
        if self.adapter is not None:
            h = h @ self.adapter[:-1] + self.adapter[-1]
        h = self.m.tail(h, pos, None, tail_cache)
        w = self.m.embed_tokens.weight if self.m.lm_head is None else self.m.lm_head.weight
        return to_host(softcap(F.linear(self.m.norm(h), w), self.m.cfg.final_logit_softcapping)[0])

    def crop(self, state, n: int) -> None:
        state[0].crop(n)
        state[1].crop(n)


def load_adapter(path: str | Path) -> torch.Tensor | None:
    path = Path(path)
    if path.is_dir():
        path = path / ADAPTER_FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))["adapter"]


class ModelDrafter(Drafter):
    name = "draft"

    def __init__(self, lm: DraftLM, max_depth: int = 6, top_k: int = 3, min_prob: float = 0.05):
        self.lm, self.max_depth, self.top_k, self.min_prob = lm, max_depth, top_k, min_prob
        self.proposed = self.hits = 0

    def reset(self, context: list[int]) -> None:
        super().reset(context)
        self.state, self.fed = self.lm.new_state(), 0

    def propose(self) -> TokenTree:
        ctx = self.context
        if self.fed < len(ctx) - 1:  # the accepted context, up to the root
            self.lm.logits(ctx[self.fed:-1], list(range(self.fed, len(ctx) - 1)), self.state)
            self.fed = len(ctx) - 1
        tree = TokenTree.root_only(ctx[-1])
        node, token, pos = 0, ctx[-1], len(ctx) - 1
        for _ in range(self.max_depth):
            probs = torch.softmax(self.lm.logits([token], [pos], self.state)[-1].float(), -1)  # [V]
            top = torch.topk(probs, self.top_k)
            children = [tree.add(node, int(t), float(p)) for p, t in zip(top.values, top.indices, strict=True)]
            if float(top.values[0]) < self.min_prob:
                break
            node, token, pos = children[0], int(top.indices[0]), pos + 1
        self.lm.crop(self.state, self.fed)  # forget the rollout
        self.proposed += 1
        return tree

    def accepted(self, drafted: list[int]) -> None:
        self.hits += len(drafted)

    def truncate(self, n: int) -> None:
        """Cut the context back to its first n tokens (pipelined speculation's rollback)."""
        self.context = self.context[:n]
        if self.fed > n - 1:
            self.lm.crop(self.state, n - 1)
            self.fed = n - 1


def make_draft_lm(draft: str, edge_model=None, edge_dir: str | Path | None = None) -> DraftLM:
    """`self` (the edge's own layers, with the adapter in the edge shard if `train-draft` made one),
    `self-raw` (the same without an adapter) or a model path / built-in name of the same vocabulary."""
    if draft in ("self", "self-raw"):
        if edge_model is None:
            raise SplitLMError("--draft self needs an edge shard")
        adapter = load_adapter(edge_dir) if draft == "self" and edge_dir is not None else None
        return SelfDraft(edge_model, adapter)
    from splitlm.model.loading import load_model

    model, _ = load_model(draft)
    if edge_model is not None and model.cfg.vocab_size != edge_model.cfg.vocab_size:
        raise SplitLMError(f"the draft model's vocabulary ({model.cfg.vocab_size}) differs from the target's "
                           f"({edge_model.cfg.vocab_size}); a draft model must share the tokenizer")
    return ModelDraft(model)
