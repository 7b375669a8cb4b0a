"""Sampling a token from logits: repetition penalty, temperature, top-k, top-p (nucleus), a
per-request seeded generator.

`token_distribution` is the filtered distribution itself (what exact speculative sampling needs as
the target), `sample_token` draws from it. Both are pure: same logits, context, config and generator
state, same token. Temperature 0 means greedy (argmax, after the repetition penalty), and so does any
below `GREEDY_BELOW` (vLLM's threshold): the limit such temperatures tend to, where dividing the
logits by them could overflow float32 into NaNs.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # a temperature under this is greedy: the limit it tends to, and no overflow on the way


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 = no limit
    seed: int | None = None  # None = a random seed per request
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context (CTRL-style)

    def __post_init__(self):
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: what the speculative loop's plain argmax acceptance computes."""
        return self.greedy and self.repetition_penalty == 1.0

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with `seed` (or a fresh random seed): one per request."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def penalize(logits: torch.Tensor, context: list[int] | None, penalty: float) -> torch.Tensor:
    """Divide positive (multiply negative) logits of tokens seen in `context` by `penalty`."""
    if penalty == 1.0 or not context:
        return logits
    seen = torch.tensor(sorted(set(context)), dtype=torch.long)
    seen = seen[seen < logits.shape[-1]]
    out = logits.float().clone()
    vals = out[seen]
    out[seen] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return out


def token_distribution(logits: torch.Tensor, cfg: SamplingConfig, context: list[int] | None = None) -> torch.Tensor:
    """Probabilities [V] after the repetition penalty (over `context`), temperature, top-k and top-p;
    logits [V]. Greedy: one-hot at the argmax."""
    logits = penalize(logits, context, cfg.repetition_penalty)
    if cfg.greedy:
        probs = torch.zeros(logits.shape[-1])
        probs[int(logits.argmax())] = 1.0
        return probs
    scores = logits.float() / cfg.temperature  # [V]
    if 0 < cfg.top_k < scores.shape[-1]:
        kth = torch.topk(scores, cfg.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if cfg.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
        sorted_probs[before >= cfg.top_p] = 0.0  # the first token is always kept (before = 0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs /= probs.sum()
    return probs


def sample_token(
    logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None, context: list[int] | None = None
) -> int:
    """One token id from logits [V] (`context`: the tokens so far, for the repetition penalty)."""
    if cfg.greedy:
        return int(penalize(logits, context, cfg.repetition_penalty).argmax())
    return int(torch.multinomial(token_distribution(logits, cfg, context), 1, generator=generator))


class Sampler:
    """Draws the token at each position from a uniform number fixed by (seed, position).

    The token at position n is the inverse CDF of its distribution at u_n, so the output depends
    only on the seed and the model, not on how many tokens a step verified: speculative sampling
    (`splitlm.decoding.tree.accept_sampled`) gives the same tokens as sequential sampling with the
    same seed, whatever trees the drafters and the budget chose."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)

    def uniform(self, position: int) -> float:
        g = torch.Generator().manual_seed((self.seed * 0x9E3779B97F4A7C15 + position) % 2**63)
        return float(torch.rand((), generator=g, dtype=torch.float64))

    def token(self, logits: torch.Tensor, context: list[int]) -> int:
        """The token following `context` (its position is len(context)); logits [V]."""
        if self.cfg.greedy:
            return sample_token(logits, self.cfg, None, context)
        probs = token_distribution(logits, self.cfg, context).double()
        cdf = torch.cumsum(probs, 0)
        u = self.uniform(len(context)) * float(cdf[-1])
        return min(
            int(torch.searchsorted(cdf, torch.tensor(u, dtype=torch.float64), right=True)), int(probs.nonzero()[-1])
        )
