"""How many candidates to send per step, from the measured link and compute.

A step with T input tokens takes about `rtt + c0 + c1·T` (network + edge and cloud compute) and
yields `1 + Σ p(node)` tokens in expectation, p(node) being the calibrated chance that the
target accepts the node. The budget picks the tree size that maximises tokens per second.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitlm.decoding.tree import TokenTree


class ComputeFit:
    """Least-squares fit of compute seconds = c0 + c1·T over the most recent steps."""

    def __init__(self, window: int = 64, c0: float = 0.02, c1: float = 0.002):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.c0, self.c1 = c0, c1  # priors until the data can speak

    def add(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        xs = [t for t, _ in self.samples]
        if len(set(xs)) < 2:
            return
        n = len(xs)
        mx, my = sum(xs) / n, sum(s for _, s in self.samples) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        c1 = sum((x - mx) * (s - my) for x, s in self.samples) / sxx
        self.c1 = max(c1, 0.0)
        self.c0 = max(my - self.c1 * mx, 0.0)

    def predict(self, tokens: int) -> float:
        return self.c0 + self.c1 * tokens


class Calibration:
    """Observed acceptance frequency of drafted nodes, by score bin (scores are guesses of P(accept))."""

    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.bins = bins
        self.hits = [prior_weight * (b + 0.5) / bins for b in range(bins)]
        self.total = [prior_weight] * bins

    def bin(self, score: float) -> int:
        return min(self.bins - 1, max(0, int(score * self.bins)))

    def add(self, score: float, accepted: bool) -> None:
        b = self.bin(score)
        self.hits[b] += accepted
        self.total[b] += 1

    def p(self, score: float) -> float:
        b = self.bin(score)
        return self.hits[b] / self.total[b]


@dataclass
class BudgetChoice:
    nodes: int  # tree nodes sent, root included
    expected_tokens: float
    predicted_step_s: float


class StepBudget:
    def __init__(self, max_nodes: int = 64, fixed_nodes: int | None = None, rtt_prior_s: float = 0.05):
        self.max_nodes, self.fixed_nodes = max_nodes, fixed_nodes
        self.compute = ComputeFit()
        self.calibration = Calibration()
        self.rtt_s = rtt_prior_s
        self.rtt_seen = False

    def observe_step(self, tokens: int, compute_s: float, network_s: float) -> None:
        self.compute.add(tokens, compute_s)
        self.rtt_s = network_s if not self.rtt_seen else 0.8 * self.rtt_s + 0.2 * network_s
        self.rtt_seen = True

    def observe_acceptance(self, tree: TokenTree, path: list[int]) -> None:
        accepted = set(path)
        for i in range(1, len(tree)):
            # only nodes whose parent was accepted were really tested
            if tree.parents[i] in accepted:
                self.calibration.add(tree.scores[i], i in accepted)

    def choose(self, tree: TokenTree, extra_tokens: int = 0) -> BudgetChoice:
        limit = min(len(tree), self.max_nodes if self.fixed_nodes is None else self.fixed_nodes)
        # a parent scores at least as high as its children, so a prefix of this order is a subtree
        scores = sorted(tree.scores[1:], reverse=True)[: limit - 1]
        best = BudgetChoice(1, 1.0, self.step_time(1 + extra_tokens))
        expected = 1.0
        for k, s in enumerate(scores, start=2):
            expected += self.calibration.p(s)
            t = self.step_time(k + extra_tokens)
            if self.fixed_nodes is not None or expected / t > best.expected_tokens / best.predicted_step_s:
                best = BudgetChoice(k, expected, t)
        return best

    def window_width(self, max_width: int, levels: int, share: float = 0.15) -> int:
        """Lookahead columns affordable for `share` of a step's fixed cost (all of them when compute is
        cheap next to the round trip, none when every token costs as much as a round trip)."""
        if self.fixed_nodes is not None or self.compute.c1 <= 0:
            return max_width
        affordable = share * (self.rtt_s + self.compute.c0) / (self.compute.c1 * levels)
        return max(0, min(max_width, int(affordable)))

    def step_time(self, tokens: int) -> float:
        return self.rtt_s + self.compute.predict(tokens)
