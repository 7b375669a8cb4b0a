"""How many candidates to send per step, from the measured link and compute.

A step with T input tokens takes about `rtt + e(T) + c(T) + d`: the network's round trip, the
edge's compute (its head and tail layers and LM head on T rows), the cloud's (its layers on T rows)
and the edge's drafting and bookkeeping around the pass. Edge and cloud are fitted apart, each from
what the step measured (the edge times its own layers; the cloud's share is the step's compute less
the edge's), so a slow edge, whose LM head and layers grow with T, gets smaller trees than a fast one
with the same link and cloud. The step
yields `1 + Σ p(node)` tokens in expectation, p(node) being the calibrated chance that the
target accepts the node. The budget finds the tree size that maximises tokens per second, then sends
the largest tree whose predicted rate is within `lean` (5 %) of that best: near the optimum the rate
curve is flat and its prediction noisy, while tokens per round trip is the figure that carries over
to a faster cloud, so ties go to the bigger tree.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from splitlm.decoding.tree import TokenTree


@dataclass
class CostBucket:
    """The mean compute of the passes whose T fell in one bucket."""

    tokens: float  # mean T
    seconds: float  # mean compute
    count: int = 0
    last: int = 0  # the number of the last sample added to it


class ComputeFit:
    """Compute seconds per step as a function of its tokens T, measured: a least-squares line
    c0 + c1·T over the recent steps, and the mean cost seen in each bucket of T (half octaves).

    Where buckets were seen, the prediction interpolates between them (on an Intel Xeon with AMX a
    16-token pass cost about what an 8-token one did, which no line through small passes shows); beyond them
    it extends the line from the last one. It never decreases with T."""

    # half-octave buckets: matrix kernels block rows by 4, 6, 8 or 12, and the cost steps where a block
    # fills (AMD EPYC, oneDNN, the 30 layers: 12 rows 51 ms, 13 rows 62; Intel's AMX: 16 rows as 8)
    EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)

    def __init__(self, window: int = 64, c0: float = 0.02, c1: float = 0.002, stale_after: int = 64):
        self.samples: deque[tuple[int, float]] = deque(maxlen=window)
        self.c0, self.c1 = c0, c1  # priors until the data can speak
        self.buckets: dict[int, CostBucket] = {}
        self.added, self.stale_after = 0, stale_after

    @classmethod
    def bucket(cls, tokens: int) -> int:
        return next((b for b, e in enumerate(cls.EDGES) if tokens <= e), len(cls.EDGES))

    def add(self, tokens: int, seconds: float) -> None:
        self.added += 1
        b = self.buckets.setdefault(self.bucket(tokens), CostBucket(float(tokens), seconds))
        w = max(0.1, 1.0 / (b.count + 1))  # a running mean, then an EMA
        b.tokens += w * (tokens - b.tokens)
        b.seconds += w * (seconds - b.seconds)
        b.count += 1
        b.last = self.added
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

    def explored(self, tokens: int) -> bool:
        """Whether T's bucket has been measured enough, and recently: a mean taken while the machine was
        busier would otherwise keep trees out of that bucket for good (it is updated only when sent)."""
        b = self.buckets.get(self.bucket(tokens))
        return b is not None and b.count >= 3 and self.added - b.last < self.stale_after

    def predict(self, tokens: int) -> float:
        pts = sorted((b.tokens, b.seconds) for b in self.buckets.values() if b.count >= 2)
        if not pts:
            return self.c0 + self.c1 * tokens
        best, prev = 0.0, None
        for t, s in pts:  # the running max keeps the curve non-decreasing
            best = max(best, s)
            if tokens <= t:
                if prev is None:
                    return max(0.0, best - self.c1 * (t - tokens))
                t0, s0 = prev
                return s0 + (best - s0) * (tokens - t0) / max(t - t0, 1e-9)
            prev = (t, best)
        return prev[1] + self.c1 * (tokens - prev[0])


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


@dataclass(frozen=True)
class LinkEstimate:
    """What a step budget has measured of the link and the pass (`StepBudget.estimate`): the round
    trip, the pass's fixed and per-token compute, and the edge's own overhead per step."""

    rtt_s: float
    compute_c0_s: float  # the cloud's pass
    compute_c1_s: float
    overhead_s: float
    edge_c0_s: float = 0.0  # the edge's layers and LM head
    edge_c1_s: float = 0.0


@dataclass
class BudgetChoice:
    nodes: int  # tree nodes sent, root included
    expected_tokens: float
    predicted_step_s: float
    reach: list[float]  # per node of the proposed tree: estimated chance it is accepted

    @property
    def rate(self) -> float:
        """Predicted tokens per second."""
        return self.expected_tokens / self.predicted_step_s


COST_MODELS = ("measured", "zero")


class StepBudget:
    """`cost` "zero" prices every extra token of a pass at nothing (a GPU cloud, emulated here: the
    tree grows to `max_nodes`); "measured" uses the fitted cost curve, and every `explore_every`
    steps tries the next size bucket up while it is not yet measured, or not in the last 64 steps."""

    def __init__(
        self,
        max_nodes: int = 64,
        fixed_nodes: int | None = None,
        rtt_prior_s: float = 0.05,
        cost: str = "measured",
        explore_every: int = 8,
        lean: float = 0.05,
    ):
        if cost not in COST_MODELS:
            raise ValueError(f"unknown cost model {cost!r} (choose from {', '.join(COST_MODELS)})")
        self.max_nodes, self.fixed_nodes, self.cost = max_nodes, fixed_nodes, cost
        self.explore_every, self.steps = explore_every, 0
        self.lean = lean  # the share of the best predicted rate given up for a bigger tree
        self.compute = ComputeFit()  # the cloud's pass (with no edge time reported: the whole step's compute)
        self.edge = ComputeFit(c0=0.0, c1=0.0)  # the edge's layers and LM head; nothing until measured
        self.calibration = Calibration()
        self.rtt_s = rtt_prior_s
        self.rtt_seen = False
        self.overhead_s = 0.0  # drafting and bookkeeping per step, outside the pass (about constant in T)

    def observe_step(
        self, tokens: int, compute_s: float, network_s: float, overhead_s: float = 0.0, edge_s: float = 0.0
    ) -> None:
        """A verified step of `tokens` tokens: its compute (edge + cloud), of which `edge_s` the edge's
        layers and LM head, its network time and the edge's overhead around it."""
        self.observe_compute(tokens, compute_s, edge_s)
        self.observe_network(network_s)
        self.overhead_s += 0.2 * (overhead_s - self.overhead_s)

    def observe_compute(self, tokens: int, compute_s: float, edge_s: float = 0.0) -> None:
        edge_s = min(max(edge_s, 0.0), compute_s)
        self.compute.add(tokens, compute_s - edge_s)
        self.edge.add(tokens, edge_s)

    def predict_compute(self, tokens: int) -> float:
        """Predicted edge + cloud compute of a T-token step (measured, whatever the cost model)."""
        return self.edge.predict(tokens) + self.compute.predict(tokens)

    def estimate(self) -> LinkEstimate:
        c, e = self.compute, self.edge
        return LinkEstimate(
            round(self.rtt_s, 4),
            round(c.c0, 5),
            round(c.c1, 6),
            round(self.overhead_s, 5),
            round(e.c0, 5),
            round(e.c1, 6),
        )

    def observe_network(self, network_s: float) -> None:
        self.rtt_s = network_s if not self.rtt_seen else 0.8 * self.rtt_s + 0.2 * network_s
        self.rtt_seen = True

    def observe_acceptance(self, tree: TokenTree, path: list[int]) -> None:
        accepted = set(path)
        for i in range(1, len(tree)):
            # only nodes whose parent was accepted were really tested (a forced node is certain)
            if tree.parents[i] in accepted and not tree.certain(i):
                self.calibration.add(tree.scores[i], i in accepted)

    def reach(self, tree: TokenTree) -> list[float]:
        """[N] each node's calibrated chance to be reached and accepted (a forced node's is its parent's)."""
        reach = [1.0] * len(tree)
        for i in range(1, len(tree)):
            reach[i] = reach[tree.parents[i]] * (1.0 if tree.certain(i) else self.calibration.p(tree.scores[i]))
        return reach

    def choose(self, tree: TokenTree, extra_tokens: int = 0) -> BudgetChoice:
        """The tree size (and which nodes) to send: the largest within `lean` of the best expected
        tokens per second.

        Calibrated scores are acceptance chances given the parent was accepted, so a node's chance
        to be reached and accepted is the product along its path; a parent's is never below its
        child's, so the best k nodes by that product always form a subtree."""
        reach = self.reach(tree)
        limit = min(len(tree), self.max_nodes if self.fixed_nodes is None else self.fixed_nodes)
        ranked = sorted(reach[1:], reverse=True)[: limit - 1]
        sizes = [BudgetChoice(1, 1.0, self.step_time(1 + extra_tokens), reach)]
        for k, r in enumerate(ranked, start=2):
            sizes.append(BudgetChoice(k, sizes[-1].expected_tokens + r, self.step_time(k + extra_tokens), reach))
        if self.fixed_nodes is not None:
            best = sizes[-1]
        else:
            floor = (1.0 - self.lean) * max(c.rate for c in sizes)
            best = next(c for c in reversed(sizes) if c.rate >= floor)
        self.steps += 1
        if self.fixed_nodes is None and self.cost == "measured" and self.steps % self.explore_every == 0:
            # measure the next size bucket up once in a while: the curve is only known where it was tried
            up = ComputeFit.EDGES[min(ComputeFit.bucket(best.nodes) + 1, len(ComputeFit.EDGES) - 1)]
            if not self.compute.explored(up + extra_tokens) and len(sizes) >= up:
                best = sizes[up - 1]
        return best

    def window_width(
        self, current: int, max_width: int, levels: int, gain_tokens: float, tokens_per_step: float
    ) -> int:
        """Grow or shrink the lookahead window by one column: keep it while the tokens that only its
        pool proposed (`gain_tokens` per step) save more time than its `levels` tokens per column cost.
        It may shrink to nothing; switched off, it comes back only if what its pool still proposes
        pays for one column."""
        c1 = self.compute.c1 + self.edge.c1
        if self.fixed_nodes is not None or c1 <= 0:
            return max_width
        step = self.step_time(1 + current * levels)
        saved_s = gain_tokens * step / max(tokens_per_step, 1.0)
        cost_s = max(current, 1) * levels * c1
        if saved_s > 1.1 * cost_s:
            return min(max_width, current + 1)
        if saved_s < 0.9 * cost_s:
            return max(0, current - 1)
        return current

    def step_time(self, tokens: int) -> float:
        """Predicted seconds of a T-token step: round trip, overhead, the edge's and the cloud's compute
        ("zero" prices both at T = 1: the trees' limit, for tokens per round trip)."""
        t = 1 if self.cost == "zero" else tokens
        return max(1e-6, self.rtt_s + self.overhead_s + self.edge.predict(t) + self.compute.predict(t))
