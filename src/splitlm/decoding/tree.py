"""Token trees: the candidates of one decoding step, and their visibility mask and positions.

Node 0 is the root: the last generated token, not yet in any KV cache. Every other node is a
drafted token with a parent among the earlier nodes. A node sees the committed context and its
own ancestors, nothing else; its position is the root's position plus its depth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from splitlm.decoding.sampling import Sampler


class Certain:
    """The key of a node a grammar forces (`splitlm.decoding.grammar_tree`): emitted whatever the model
    says, so accepted whenever its parent is; the step budget counts it with probability 1."""

    def __repr__(self) -> str:
        return "FORCED"


FORCED = Certain()


@dataclass
class TokenTree:
    tokens: list[int]  # [N], tokens[0] is the root
    parents: list[int]  # [N], parents[0] == -1, parents[i] < i
    scores: list[float] = field(default_factory=list)  # [N], estimated P(node accepted); root 1.0
    keys: list = field(default_factory=list)  # [N], what the drafter calibrates the node's score by (None: nothing)

    def __post_init__(self):
        if len(self.keys) != len(self.tokens):
            self.keys = [None] * len(self.tokens)
        # (parent, token) -> node: trees are built by `add` only, and merging drafters' trees asks
        # for a child at every node (a scan of the later nodes made that quadratic)
        self._children: dict[tuple[int, int], int] = {}
        for i, (p, t) in enumerate(zip(self.parents, self.tokens, strict=True)):
            if p >= 0:
                self._children.setdefault((p, t), i)

    @classmethod
    def root_only(cls, token: int) -> TokenTree:
        return cls([token], [-1], [1.0])

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        d: list[int] = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def certain(self, node: int) -> bool:
        """Whether the node is forced (its key is `FORCED`)."""
        return self.keys[node] is FORCED

    def child(self, node: int, token: int) -> int | None:
        return self._children.get((node, token))

    def kids(self) -> dict[int, list[int]]:
        """node -> its children's indices, in the order they were added (leaves absent)."""
        kids: dict[int, list[int]] = {}
        for i in range(1, len(self)):
            kids.setdefault(self.parents[i], []).append(i)
        return kids

    def add(
        self, parent: int, token: int, score: float, key=None, combine: Callable[[float, float], float] | None = None
    ) -> int:
        """Add `token` under `parent` unless that child exists (then keep the higher score and its key,
        or with `combine` give it combine(its score, `score`)); return its index."""
        existing = self.child(parent, token)
        if existing is not None:
            if combine is not None:
                self.scores[existing] = combine(self.scores[existing], score)
            elif score > self.scores[existing]:
                self.scores[existing], self.keys[existing] = score, key
            return existing
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.keys.append(key)
        self._children[parent, token] = len(self.tokens) - 1
        return len(self.tokens) - 1

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens after the root, [N]."""
        out: list[tuple[int, ...]] = []
        for i, p in enumerate(self.parents):
            out.append(() if p < 0 else out[p] + (self.tokens[i],))
        return out

    def add_tree(
        self, other: TokenTree, at: int = 0, combine: Callable[[float, float], float] | None = None
    ) -> list[int]:
        """Add `other`'s nodes (its root is this tree's node `at`) with their scores and keys, by `add`;
        return the node each of them is here, [len(other)]."""
        where = [at]
        for i in range(1, len(other)):
            where.append(self.add(where[other.parents[i]], other.tokens[i], other.scores[i], other.keys[i], combine))
        return where

    def add_path(self, tokens: list[int], scores: list[float]) -> int:
        """Add `tokens` as a path from the root; return its last node."""
        node = 0
        for tok, s in zip(tokens, scores, strict=True):
            node = self.add(node, tok, s)
        return node

    def mask(self) -> torch.Tensor:
        """[N, N] bool: row i sees column j iff j is i or an ancestor of i."""
        n = len(self.tokens)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                m[i] = m[p]
            m[i, i] = True
        return m

    def pruned(self, max_nodes: int, priority: list[float] | None = None) -> TokenTree:
        """The `max_nodes` best nodes by `priority` (default: score); the root and every kept node's
        parent are kept too."""
        if len(self) <= max_nodes:
            return self
        priority = self.scores if priority is None else priority
        order = sorted(range(1, len(self)), key=lambda i: -priority[i])
        keep = {0}
        for i in order:
            if len(keep) >= max_nodes:
                break
            chain = []
            j = i
            while j not in keep:
                chain.append(j)
                j = self.parents[j]
            if len(keep) + len(chain) <= max_nodes:
                keep.update(chain)
        old = sorted(keep)
        index = {o: n for n, o in enumerate(old)}
        return TokenTree(
            [self.tokens[o] for o in old],
            [index.get(self.parents[o], -1) for o in old],
            [self.scores[o] for o in old],
            [self.keys[o] for o in old],
        )


def accept_greedy(tree: TokenTree, argmax: list[int]) -> tuple[list[int], list[int]]:
    """Walk the tree along the target's greedy choices.

    argmax[i] is the target's next token after node i's path. Returns (accepted node indices,
    root first; generated tokens = the accepted nodes' tokens after the root, plus the bonus).
    """
    path = [0]
    while (nxt := tree.child(path[-1], argmax[path[-1]])) is not None:
        path.append(nxt)
    tokens = [tree.tokens[i] for i in path[1:]] + [argmax[path[-1]]]
    return path, tokens


def accept_sampled(
    tree: TokenTree, logits: torch.Tensor, sampler: Sampler, context: list[int]
) -> tuple[list[int], list[int]]:
    """Exact speculative sampling over a tree of drafts.

    logits[i] [V]: the target's logits after node i's path; `context`: the tokens so far, the root
    last. At each accepted node the sampler draws the next token from the target distribution
    (with the uniform number of that position); the child holding it, if any, is accepted and the
    walk goes on, otherwise the drawn token is the bonus. Every token is thus drawn exactly as in
    sequential sampling with the same seed (a child x is accepted with probability p(x): the
    multi-candidate rejection scheme for one-hot drafts, with its randomness fixed per position).
    Returns (path, tokens) like `accept_greedy`."""
    path, ctx = [0], list(context)
    while True:
        token = sampler.token(logits[path[-1]], ctx)
        nxt = tree.child(path[-1], token)
        if nxt is None:
            return path, [tree.tokens[i] for i in path[1:]] + [token]
        path.append(nxt)
        ctx.append(token)
