"""Grammar-aware token trees: a drafter's tree walked through the request's grammar before it is sent.

From the root (the grammar state after the last emitted token) every node's state gives the tokens
allowed after it (a packed mask row, which also goes with the step: verification picks the best
*allowed* token at each node):

- a drafted child the grammar rejects is pruned with its subtree (counted in `rejected`): it could
  never be accepted, and would cost the pass a row;
- where the state forces its next token (`GrammarState.forced`), the child holding it is kept (or
  added) as a *certain* node (key `FORCED`, score 1): it will be emitted whatever the model says,
  so the budget counts it with probability 1, and the chain goes on while the grammar keeps forcing
  (`max_forced` nodes per chain). Its own row is still computed: the token after it needs the
  model's logits at its position, and the cache needs its entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from splitlm.decoding.grammar import GrammarState, allows, mask_words, unpack_masks
from splitlm.decoding.tree import FORCED, TokenTree


@dataclass
class ConstrainedTree:
    """A tree every node of which the grammar allows, and each node's allowed next tokens."""

    tree: TokenTree
    rows: list[np.ndarray] = field(default_factory=list)  # [N] packed masks [W] int32: the tokens allowed after node i
    rejected: int = 0  # drafted nodes pruned (subtrees included)
    forced: int = 0  # forced nodes the drafter had not proposed

    def allowed(self, nodes: list[int], vocab_size: int) -> torch.Tensor:
        """[len(nodes), V] bool: the tokens allowed after each of `nodes`."""
        return unpack_masks(np.stack([self.rows[i] for i in nodes]), vocab_size)


def subtree_size(children: dict[int, list[int]], node: int) -> int:
    return 1 + sum(subtree_size(children, c) for c in children.get(node, []))


class Walk:
    """One depth-first walk of a drafter's tree through the grammar (the state moves with the walk and
    ends where it began)."""

    def __init__(self, tree: TokenTree, state: GrammarState, max_forced: int):
        self.src, self.state, self.max_forced = tree, state, max_forced
        self.children: dict[int, list[int]] = {}
        for i in range(1, len(tree)):
            self.children.setdefault(tree.parents[i], []).append(i)
        self.words = mask_words(state.vocab_size)
        root_key = FORCED if tree.certain(0) else tree.keys[0]
        self.out = ConstrainedTree(TokenTree([tree.tokens[0]], [-1], [1.0], [root_key]))

    def visit(self, src: int | None, node: int, chain: int) -> None:
        """Node `node` of the output tree (from `src` of the drafter's, None for a forced node it lacks):
        record its mask, then keep its allowed children (or its forced one) and visit them. `chain`:
        forced nodes added in a row up to here."""
        row = np.zeros(self.words, dtype=np.int32)
        self.out.rows.append(row)
        forced = self.state.fill_mask(row)
        kids = [] if src is None else self.children.get(src, [])
        if forced is not None:
            self.follow_forced(kids, node, forced, chain)
            return
        for k in kids:
            tok = self.src.tokens[k]
            if not allows(row, tok):
                self.out.rejected += subtree_size(self.children, k)
                continue
            self.descend(k, node, tok, self.src.scores[k], self.src.keys[k], 0)

    def follow_forced(self, kids: list[int], node: int, forced: int, chain: int) -> None:
        """The state forces `forced`: keep the drafted child holding it, else add it (while the chain is
        short enough); every other child is rejected."""
        match = None
        for k in kids:
            if self.src.tokens[k] == forced and match is None:
                match = k
            else:
                self.out.rejected += subtree_size(self.children, k)
        if match is None and chain >= self.max_forced:
            return
        self.out.forced += match is None
        self.descend(match, node, forced, 1.0, FORCED, chain + 1)

    def descend(self, src: int | None, parent: int, tok: int, score: float, key, chain: int) -> None:
        node = self.out.tree.add(parent, tok, score, key)
        if tok in self.state.eos:  # nothing follows an end token (its row, never read, allows one more)
            row = np.zeros(self.words, dtype=np.int32)
            row[tok >> 5] = np.uint32(1 << (tok & 31)).view(np.int32)
            self.out.rows.append(row)
            return
        self.state.advance(tok)
        try:
            self.visit(src, node, chain)
        finally:
            self.state.rollback(1)


def constrain(tree: TokenTree, state: GrammarState, max_forced: int = 16) -> ConstrainedTree:
    """`tree` (rooted at the last emitted token; `state`: the grammar after it) less the nodes the
    grammar rejects, plus the nodes it forces; with every node's mask row."""
    walk = Walk(tree, state, max_forced)
    walk.visit(0, 0, 0)
    return walk.out
