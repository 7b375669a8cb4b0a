"""Drafting with the head that reads the edge's layers (`splitlm.decoding.layer_head`).

`LayerHeadRunner` holds the head with the edge's embedding and the LM-head rows of its vocabulary, and
runs its layer a few rows at a time: `append` adds verified positions (their three features and next
tokens) to a request's `Ring` of keys and values, `step` runs drafted rows that attend over the ring
and their own chain. `LayerHeadDrafter` grows trees from it best-first (as `HeadDrafter`, whose
calibration, guide and `propose_after` it shares in kind), a depth at a time: dynamic trees from the
head's calibrated confidence (EAGLE-2), the likeliest `width` nodes expanded at each depth.
"""

from __future__ import annotations

import copy
import heapq
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from splitlm.decoding.drafters import KeyedCalibration, either
from splitlm.decoding.head import AFTER_NODES, MAX_ROLL, HeadDrafter, native_bf16
from splitlm.decoding.layer_head import RING, LayerHead
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree


@dataclass
class Ring:
    """One request's context for the head: its layer's keys and values at the last `RING` verified
    positions, and the output at the newest one (what depth 1 is drafted from)."""

    k: torch.Tensor  # [Hkv, n, hd]
    v: torch.Tensor  # [Hkv, n, hd]
    last: torch.Tensor | None = None  # [D] the output at the newest position (None: nothing to draft from)
    position: int = -1  # the newest position


@dataclass
class Chain:
    """A drafted node's state: its output, and the keys and values of its rows after the ring."""

    out: torch.Tensor  # [D]
    k: torch.Tensor  # [Hkv, j, hd]
    v: torch.Tensor  # [Hkv, j, hd]
    position: int


class LayerHeadRunner:
    """A `LayerHead` with the edge's embedding and LM-head rows of its vocabulary, ready to draft
    (in bf16 where bf16 products are native, as `HeadRunner`)."""

    features = True  # it reads every verified row's three features (`StepResult.features`)

    def __init__(
        self,
        head: LayerHead,
        embed: torch.Tensor,
        lm_head: torch.Tensor,
        embed_scale: float = 1.0,
        dtype: torch.dtype | None = None,
    ):
        w = lm_head.detach().float()[head.vocab_ids]  # [S, D]
        if dtype is None:
            dtype = torch.bfloat16 if native_bf16(w.device) else torch.float32
        self.dtype = dtype
        self.head = copy.deepcopy(head).to(dtype).eval().requires_grad_(False)  # the caller's stays as it was
        self.embed, self.scale = embed.detach(), embed_scale  # [V, D]
        self.lm = w.to(dtype)  # [S, D]
        self.ids = head.vocab_ids
        self.calibration = KeyedCalibration()

    def drafter(self) -> LayerHeadDrafter:
        return LayerHeadDrafter(self)

    def new_ring(self) -> Ring:
        s, dev = self.head.shape, self.lm.device
        empty = torch.zeros(s.kv_heads, 0, s.head_dim, dtype=self.dtype, device=dev)
        return Ring(empty, empty.clone())

    def embedded(self, tokens: list[int]) -> torch.Tensor:
        return (self.embed[torch.tensor(tokens, device=self.embed.device)].float() * self.scale).to(self.dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
        h = self.head
        return F.scaled_dot_product_attention(q, h.expand_kv(k), h.expand_kv(v), attn_mask=mask)

    @torch.inference_mode()
    def append(self, ring: Ring, feats: torch.Tensor, tokens: list[int], positions: list[int]) -> None:
        """Verified positions: feats [n, 3, D] and the token after each -> their keys and values join the
        ring (the oldest beyond `RING` go) and the newest one's output is what depth 1 drafts from."""
        h, dev = self.head, self.lm.device
        g = h.fused(feats.to(dev, self.dtype))[None]  # [1, n, D]
        q, k, v = h.project(g, self.embedded(tokens)[None], torch.tensor(positions, device=dev))
        keys, values = torch.cat([ring.k[None], k], 2), torch.cat([ring.v[None], v], 2)  # [1, Hkv, m + n, hd]
        m, n = ring.k.shape[1], len(tokens)
        mask = torch.ones(n, m + n, dtype=torch.bool, device=dev)
        mask[:, m:] = torch.ones(n, n, dtype=torch.bool, device=dev).tril()
        out = h.finish(g, self.attend(q, keys, values, mask))[0]  # [n, D]
        ring.k, ring.v = keys[0, :, -RING:].contiguous(), values[0, :, -RING:].contiguous()
        ring.last, ring.position = out[-1], positions[-1]

    @torch.inference_mode()
    def step(self, ring: Ring, parents: list[Chain], tokens: list[int]) -> list[Chain]:
        """Drafted rows, one after each of `parents` (chains of one length), carrying `tokens`: their states."""
        h, dev = self.head, self.lm.device
        b = len(parents)
        g = torch.stack([p.out for p in parents])[:, None]  # [B, 1, D]
        pos = torch.tensor([[p.position + 1] for p in parents], device=dev)  # [B, 1]
        q, k, v = h.project(g, self.embedded(tokens)[:, None], pos)  # [B, H, 1, hd], [B, Hkv, 1, hd]
        ck = torch.stack([p.k for p in parents])  # [B, Hkv, j, hd]
        cv = torch.stack([p.v for p in parents])
        keys = torch.cat([ring.k[None].expand(b, -1, -1, -1), ck, k], 2)
        values = torch.cat([ring.v[None].expand(b, -1, -1, -1), cv, v], 2)
        out = h.finish(g, self.attend(q, keys, values))[:, 0]  # [B, D]
        return [
            Chain(out[i], torch.cat([ck[i], k[i]], 1), torch.cat([cv[i], v[i]], 1), parents[i].position + 1)
            for i in range(b)
        ]

    @torch.inference_mode()
    def top(self, outs: list[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs [B] x [D] -> (top-k probabilities [B, k], their token ids [B, k])."""
        logits = self.head.readout(torch.stack(outs), self.lm).float()  # [B, S]
        top = logits.topk(k, -1).indices
        return torch.softmax(logits, -1).gather(-1, top), self.ids[top]

    def root(self, ring: Ring, known: list[int]) -> Chain | None:
        """The state at the tree's root: the ring's newest output, through the `known` tokens the context
        gained after it (a grammar's forced chain); None when there is nothing to draft from."""
        if ring.last is None or len(known) > MAX_ROLL:
            return None
        s = self.head.shape
        empty = torch.zeros(s.kv_heads, 0, s.head_dim, dtype=self.dtype, device=self.lm.device)
        state = Chain(ring.last, empty, empty, ring.position)
        for tok in known:
            state = self.step(ring, [state], [tok])[0]
        return state


class LayerHeadDrafter(HeadDrafter):
    """Best-first trees from a `LayerHeadRunner`, grown as `HeadDrafter`'s (its settings, its bookkeeping
    of the tokens owed and known after the anchor), from the request's `Ring` instead of one state."""

    features = True  # verification passes (and the prefill's last `RING` rows) return the rows' features

    def __init__(self, runner: LayerHeadRunner, **settings):
        super().__init__(runner, **settings)
        self.ring = runner.new_ring()
        self.root_position = 0

    def reset(self, context: list[int]) -> None:
        super().reset(context)
        self.ring = self.runner.new_ring()

    def propose(self, guide: TokenTree | None = None) -> TokenTree:
        tree = TokenTree.root_only(self.context[-1])
        self.last, self.root_position = tree, len(self.context) - 1
        root = self.runner.root(self.ring, self.known)
        if root is not None:
            self.grow(tree, [(1.0, 0, root, 0 if guide is not None else None)], guide, self.max_nodes)
        return tree

    def propose_after(self, paths: list[list[int]], reaches: list[float], guide: TokenTree | None = None) -> TokenTree:
        """A tree holding `paths` (each reached with the chance in `reaches`) and the head's drafts after each."""
        tree = TokenTree.root_only(self.context[-1])
        self.root_position = len(self.context) - 1
        root = self.runner.root(self.ring, self.known)
        if root is None or not paths:
            return tree
        nodes = [[0] for _ in paths]  # each path's nodes, root first
        for path, ns in zip(paths, nodes, strict=True):
            for tok in path:
                ns.append(tree.add(ns[-1], tok, 1.0))
        state = {0: root}  # each path node's state, a depth at a time (shared prefixes once)
        for depth in range(1, max(map(len, paths)) + 1):
            todo = sorted({ns[depth] for ns in nodes if len(ns) > depth and ns[depth] not in state})
            if todo:
                grown = self.runner.step(
                    self.ring, [state[tree.parents[n]] for n in todo], [tree.tokens[n] for n in todo]
                )
                state.update(zip(todo, grown, strict=True))
        frontier = [(reach, ns[-1], state[ns[-1]], None) for ns, reach in zip(nodes, reaches, strict=True)]
        self.grow(tree, frontier, None, len(tree) + AFTER_NODES)
        return tree

    def grow(self, tree: TokenTree, frontier: list, guide: TokenTree | None, max_nodes: int) -> None:
        """Best-first: from `frontier` [(reach, node, its state, guide node)] add the top `k` of the
        likeliest `width` nodes a depth at a time, up to `max_nodes`; only the nodes kept for the next
        depth run the head's layer."""
        cal, runner = self.runner.calibration, self.runner
        for depth in range(1, self.max_depth + 1):
            if not frontier or len(tree) >= max_nodes:
                break
            probs, ids = runner.top([s.out for _, _, s, _ in frontier], self.k)
            grown = []
            for (reach, node, state, g), ps, ts in zip(frontier, probs.tolist(), ids.tolist(), strict=True):
                for rank, (p, t) in enumerate(zip(ps, ts, strict=True)):
                    if len(tree) >= max_nodes:
                        break
                    key = (min(depth, 5), rank, min(9, int(p * 10)))
                    q = cal.p(key, p)
                    child = tree.add(node, t, q, key)
                    gc = guide.child(g, t) if g is not None else None
                    merged = q if gc is None else either(q, guide.scores[gc])
                    grown.append((reach * merged, child, state, gc))
            best = [x for x in heapq.nlargest(self.width, grown, key=lambda x: x[0]) if x[0] >= self.min_reach]
            if not best or depth == self.max_depth or len(tree) >= max_nodes:
                break
            states = runner.step(self.ring, [s for _, _, s, _ in best], [tree.tokens[c] for _, c, _, _ in best])
            frontier = [(r, c, s, gc) for (r, c, _, gc), s in zip(best, states, strict=True)]

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        feats = step.features
        if self.fresh:  # the prefill: features of the prompt's last rows, each followed by the next context token
            if feats is not None and len(feats):
                n, end = len(feats), len(self.context) - 1
                self.runner.append(self.ring, feats, self.context[-n:], list(range(end - n, end)))
            self.owed = 0
        elif feats is None:
            self.ring.last = None  # a pass without features: nothing fresh to draft from
            self.owed = len(new)
        else:
            self.runner.append(self.ring, feats[path], new, [self.root_position + i for i in range(len(path))])
            self.owed = len(new)
        self.known, self.fresh = [], False
        if self.last is not None and len(self.last) > 1:
            self.runner.calibration.learn(self.last, new)
        self.last = None
