"""What one step takes (`StepInput`) and gives back to the decoding loop (`StepResult`: the asked rows'
outputs, and the step's cost and extras that the step budget and the drafters learn from), and what a
session offers the loop (`StepSession`, `PipeSession`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

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
    edge_s: float = 0.0  # of compute_s, the edge's own layers and LM head (0: not measured apart)
    features: torch.Tensor | None = None  # [F, 3, D] the `feature_rows`' hidden states after the edge's head
    # layers, from the cloud and final-normed (what `splitlm.decoding.layer_head` reads; None: not asked or none)

    def rows_from(self, k: int) -> StepResult:
        """The same step with its rows from `k` on (out, topk, hidden): what a part of its tree sees."""
        return replace(
            self,
            out=self.out[k:],
            topk=None if self.topk is None else self.topk[k:],
            hidden=None if self.hidden is None else self.hidden[k:],
            features=None if self.features is None else self.features[k:],
        )


@dataclass
class StepInput:
    """What one step sends: T new tokens and how the session runs them."""

    ids: list[int]  # [T] the new tokens
    positions: list[int] | None = None  # [T] absolute positions (None: right after the session's tokens)
    mask: torch.Tensor | None = None  # [T, T] bool, which new tokens each sees (None: causal)
    rows: list[int] | None = None  # the new tokens whose outputs come back (None: all T)
    keep: list[int] | None = None  # first keep only these entries of the previous step's tokens (None: all)
    argmax: bool = False  # each row's greedy id [R] comes back instead of its logits [R, V]
    extras: int = 0  # k > 0: each row's top-k ids and final-normed hidden state come back (the drafter's)
    allowed: torch.Tensor | None = None  # [R, V] bool: with `argmax`, each row's greedy id among its allowed
    feature_rows: list[int] | None = None  # the new tokens whose three hidden states come back (`features`):
    # an edge-side drafter's, computed on the edge anyway; nothing more crosses the wire


class StepSession(Protocol):
    """What the loop needs from a session: `forward` runs a step and returns a `StepResult`,
    `settle` keeps only the accepted entries of the last forward's tokens and `crop` the first n of the
    session's."""

    def forward(self, step: StepInput) -> StepResult: ...

    def settle(self, keep: list[int] | None = None) -> None: ...

    def crop(self, n: int) -> None:
        """Keep the first n committed tokens (a prefill's guesses the model did not take go)."""

    @property
    def max_step_tokens(self) -> int | None:
        """The most new tokens one step may carry (a cloud cache window caps them), or None."""


class PipeSession(StepSession, Protocol):
    """What pipelining needs beyond that (`splitlm.edge.session.EdgeSession`): up to two steps in flight."""

    def send(self, step: StepInput) -> object:
        """Settle the last block with `step.keep` and send `step` without waiting for its reply."""

    def receive(self, flight) -> StepResult: ...

    def discard(self, flight) -> None: ...

    def rewind(self, flight, keep: list[int]) -> None: ...
