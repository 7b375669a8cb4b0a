"""Recycled drafts (Token Recycling): every verification pass already computes, for each tree node,
the target's likeliest next tokens; the edge keeps the top k of each token's latest pass in a table
[V, k] and drafts a tree from it by best-first expansion from the root.

The table is updated every step, kept across requests (one per speculative mode on an edge, a few
MB at most) and never sent; before the first pass it holds the warm-up corpus's commonest successors.
Node scores are each drafter rank's observed acceptance rate (`KeyedCalibration`, keyed by rank
and depth)."""

from __future__ import annotations

import heapq

import numpy as np
import torch

from splitlm.decoding.drafters import Drafter, KeyedCalibration
from splitlm.decoding.tree import TokenTree

RANK_PRIOR = (0.45, 0.15, 0.08, 0.05, 0.04, 0.03, 0.02, 0.02)  # acceptance guesses before any step


class RecycleTable:
    """next[x]: the k likeliest successors of token x in its latest verification pass."""

    def __init__(self, k: int = 8):
        self.k = k
        self.next: dict[int, list[int]] = {}
        self.calibration = KeyedCalibration()  # shared by the requests that share the table

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

    def update(self, tokens: list[int], topk: torch.Tensor) -> None:
        """tokens [N] and their passes' top ids [N, >= k]."""
        for tok, row in zip(tokens, topk[:, : self.k].tolist(), strict=True):
            self.next[tok] = row


class RecycledDrafter(Drafter):
    name = "recycle"

    def __init__(self, table: RecycleTable, max_nodes: int = 80, max_depth: int = 8):
        self.table, self.max_nodes, self.max_depth = table, max_nodes, max_depth
        self.extras = table.k
        self.last: TokenTree | None = None

    def propose(self) -> TokenTree:
        nxt, cal = self.table.next, self.table.calibration
        tree = TokenTree.root_only(self.context[-1])
        frontier = [(-1.0, 0, self.context[-1], 0)]  # (-reach, node, token, depth)
        while frontier and len(tree) < self.max_nodes:
            neg, node, tok, depth = heapq.heappop(frontier)
            if depth >= self.max_depth:
                continue
            for rank, succ in enumerate(nxt.get(tok, ())):
                if len(tree) >= self.max_nodes:
                    break
                key = (rank, min(depth, 3))
                p = cal.p(key, RANK_PRIOR[min(rank, len(RANK_PRIOR) - 1)])
                n_before = len(tree)
                child = tree.add(node, succ, p, key)
                if child == n_before:
                    heapq.heappush(frontier, (neg * p, child, succ, depth + 1))
        self.last = tree
        return tree

    def verified(self, tree: TokenTree, path: list[int], new: list[int], step: dict) -> None:
        topk = step.get("topk")
        if topk is not None:
            self.table.update(tree.tokens, topk[: len(tree)])  # rows past the tree: a lookahead window's
        if self.last is not None:
            self.table.calibration.learn(self.last, new)
            self.last = None
