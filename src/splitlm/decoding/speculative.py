"""Speculative steps: what a verification pass carries (`build_step`), where a request's tokens end
(`stop_at`) and what the steps did (`SpecStats`). The loop itself is `splitlm.decoding.loop.decode`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitlm.decoding.drafters import Window
    from splitlm.decoding.tree import TokenTree


@dataclass
class SpecStats:
    steps: int = 0
    tree_nodes: int = 0  # sum over steps, root included
    window_tokens: int = 0
    accepted_drafts: int = 0  # drafted tokens accepted (bonus tokens excluded)
    expected_tokens: float = 0.0
    choices: list[int] = field(default_factory=list)  # tree size chosen per step
    pipelined: int = 0  # steps sent while the step before was in flight (pipelined mode)
    discarded: int = 0  # of those, steps whose reply was dropped (the bet failed, or it guessed nothing)
    missed: int = 0  # of those, steps dropped because the bet failed
    drafts: int = 0  # steps whose tree carried at least one drafted token (vLLM's num_drafts)
    draft_tokens: int = 0  # drafted tokens verified: tree nodes less the roots (lookahead windows excluded)
    accepted_per_position: list[int] = field(default_factory=list)  # [depth - 1]: steps whose path reached it

    def verified(self, tree_nodes: int, accepted: int) -> None:
        """Count one verified step: its tree's size (root included) and the drafted tokens accepted."""
        self.steps += 1
        self.tree_nodes += tree_nodes
        self.accepted_drafts += accepted
        self.drafts += tree_nodes > 1
        self.draft_tokens += tree_nodes - 1
        grow = accepted - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(0, grow)
        for d in range(accepted):
            self.accepted_per_position[d] += 1

    def to_dict(self) -> dict:
        s = max(self.steps, 1)
        return {
            "steps": self.steps,
            "tree_nodes": self.tree_nodes,
            "window_tokens": self.window_tokens,
            "mean_tree_nodes": round(self.tree_nodes / s, 2),
            "mean_window_tokens": round(self.window_tokens / s, 2),
            "mean_accepted_drafts": round(self.accepted_drafts / s, 3),
            "mean_expected_tokens": round(self.expected_tokens / s, 3),
            "pipelined_steps": self.pipelined,
            "discarded_steps": self.discarded,
            "missed_bets": self.missed,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_per_position": list(self.accepted_per_position),
        }


def build_step(tree: TokenTree, window: Window | None, base: int):
    """Tokens, absolute positions, [T, T] mask and logit rows of one verification pass."""
    n = len(tree)
    tokens = list(tree.tokens)
    positions = [base + d for d in tree.depths()]
    if window is None:
        return tokens, positions, (tree.mask() if n > 1 else None), list(range(n))
    wt = window.tokens()
    total = n + len(wt)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:n, :n] = tree.mask()
    mask[n:, 0] = True  # the window continues from the root
    mask[n:, n:] = window.mask()
    tokens += wt
    positions += [base + r for r in window.rel_positions()]
    rows = list(range(n)) + [n + r for r in window.output_rows()]
    return tokens, positions, mask, rows


def greedy_ids(out: torch.Tensor) -> list[int]:
    """Each row's greedy token from a step's `out`: greedy ids [R] already, or logits [R, V]."""
    return (out if out.dim() == 1 else out.argmax(-1)).tolist()


def stop_at(tokens: list[int], produced: int, max_new_tokens: int, eos: set[int]) -> int | None:
    """How many of a step's new `tokens` to emit when an end token or the length limit falls
    inside them (None: all of them, decoding goes on)."""
    for i, tok in enumerate(tokens):
        if tok in eos or produced + i + 1 >= max_new_tokens:
            return i + 1
    return None
