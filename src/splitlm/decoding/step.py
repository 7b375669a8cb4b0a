"""What one forward of new tokens gives back to the decoding loop: the asked rows' outputs, and the
step's cost and extras that the step budget and the drafters learn from."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class StepResult:
    """One step session forward (`splitlm.edge.session.EdgeSession.forward` / `receive`, and the
    in-process sessions of tests, audits and offline benchmarks).

    R is the number of rows asked for (all T new tokens when no rows were named)."""

    out: torch.Tensor  # [R, V] the rows' logits, or with argmax each row's greedy id [R]
    tokens: int = 0  # T: new tokens sent (the step's size, for the compute fit)
    network_s: float = 0.0  # round trip less the cloud's compute and the edge's (de)serialisation
    compute_s: float = 0.0  # edge + cloud
    overlapped: bool = False  # sent while an earlier step was in flight: its wait says nothing about the link
    topk: torch.Tensor | None = None  # [R, k] each row's k likeliest ids (asked for with `extras` = k), else None
    hidden: torch.Tensor | None = None  # [R, D] each row's final-normed hidden state (with `extras`; None in
    # the split-head topology and under ONNX Runtime, whose tail graph ends in the LM head)

    def rows_from(self, k: int) -> StepResult:
        """The same step with its rows from `k` on (out, topk, hidden): what a part of its tree sees."""
        return replace(
            self,
            out=self.out[k:],
            topk=None if self.topk is None else self.topk[k:],
            hidden=None if self.hidden is None else self.hidden[k:],
        )
