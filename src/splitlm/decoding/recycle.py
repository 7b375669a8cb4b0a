"""Recycled drafts (Token Recycling): every verification pass already computes, for each tree node,
the target's likeliest next tokens; the edge keeps the top k of each token's latest pass in a table
[V, k] and drafts a tree from it by best-first expansion from the root.

Next to it a second table is keyed by the node's token *and the one before it*: "x" after "a" and
after "b" are often followed differently, so where the pair has been seen its row is used; else the
single token's. The pair table keeps the most recently updated `max_pairs` pairs (a few MB).

The table is updated every step, kept across requests (one per speculative mode on an edge, a few
MB at most) and never sent; before the first pass it holds the warm-up corpus's commonest successors.
Node scores are each drafter rank's observed acceptance rate (`KeyedCalibration`, keyed by rank
and depth)."""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np
import torch

from splitlm.decoding.drafters import Drafter, KeyedCalibration
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree

RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)  # acceptance guesses before any step


class RecycleTable:
    """next[x]: the k likeliest successors of token x in its latest verification pass."""

    def __init__(self, k: int = 8, max_pairs: int = 65536):
        self.k, self.max_pairs = k, max_pairs
        self.next: dict[int, list[int]] = {}
        self.pairs: OrderedDict[tuple[int, int], list[int]] = OrderedDict()  # (token before, token) -> row
        self.calibration = KeyedCalibration()  # shared by the requests that share the table

    def row(self, before: int | None, tok: int) -> tuple[list[int], bool]:
        """The successors to draft after `tok` (preceded by `before`), and whether the pair table gave them."""
        row = self.pairs.get((before, tok)) if before is not None else None
        return (row, True) if row is not None else (self.next.get(tok, []), False)

    def seed(self, ids: np.ndarray) -> None:
        """Give tokens no pass has seen yet the commonest successors in a token array (bigrams; < 0: separators)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) < 2:
            return
        a, b = ids[:-1], ids[1:]
        ok = (a >= 0) & (b >= 0)
        v = int(ids.max()) + 1
        pairs, counts = np.unique(a[ok] * v + b[ok], return_counts=True)
        first, second = pairs // v, pairs % v
        order = np.lexsort((-counts, first))  # by first token, commonest successor first
        for tok, succ in zip(first[order].tolist(), second[order].tolist(), strict=True):
            row = self.next.setdefault(tok, [])
            if len(row) < self.k:
                row.append(succ)

    def update(self, tokens: list[int], topk: torch.Tensor, before: list[int | None] | None = None) -> None:
        """tokens [N], their passes' top ids [N, >= k], and the token before each (None: unknown)."""
        rows = topk[:, : self.k].tolist()
        for i, (tok, row) in enumerate(zip(tokens, rows, strict=True)):
            self.next[tok] = row
            if before is not None and before[i] is not None:
                key = (before[i], tok)
                self.pairs[key] = row
                self.pairs.move_to_end(key)
        while len(self.pairs) > self.max_pairs:
            self.pairs.popitem(last=False)


class RecycledDrafter(Drafter):
    name = "recycle"

    def __init__(self, table: RecycleTable, max_nodes: int = 80, max_depth: int = 8):
        self.table, self.max_nodes, self.max_depth = table, max_nodes, max_depth
        self.extras = table.k
        self.last: TokenTree | None = None

    def propose(self) -> TokenTree:
        cal = self.table.calibration
        tree = TokenTree.root_only(self.context[-1])
        before = self.context[-2] if len(self.context) > 1 else None
        frontier = [(-1.0, 0, self.context[-1], before, 0)]  # (-reach, node, token, token before, depth)
        while frontier and len(tree) < self.max_nodes:
            neg, node, tok, prev, depth = heapq.heappop(frontier)
            if depth >= self.max_depth:
                continue
            row, paired = self.table.row(prev, tok)
            for rank, succ in enumerate(row):
                if len(tree) >= self.max_nodes:
                    break
                key = (rank, min(depth, 3), paired)
                p = cal.p(key, RANK_PRIOR[min(rank, len(RANK_PRIOR) - 1)])
                n_before = len(tree)
                child = tree.add(node, succ, p, key)
                if child == n_before:
                    heapq.heappush(frontier, (neg * p, child, succ, tok, depth + 1))
        self.last = tree
        return tree

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: StepResult) -> None:
        topk = step.topk
        if topk is not None:  # rows past the tree: a lookahead window's
            # the root is the context's last token, or for the prefill's tree (proposed by no one: the
            # prompt's last token) the one before it, the context already holding the first generated one
            back = 2 if self.last is not None else 3
            root_before = self.context[-back] if len(self.context) >= back else None
            before = [tree.tokens[p] if p >= 0 else root_before for p in tree.parents]
            self.table.update(tree.tokens, topk[: len(tree)], before)
        if self.last is not None:
            self.table.calibration.learn(self.last, new)
            self.last = None
