"""Sampling a token from logits: temperature, top-k, top-p (nucleus), a per-request seeded generator.

`token_distribution` is the filtered distribution itself (what exact speculative sampling needs as
the target), `sample_token` draws from it. Both are pure: same logits, config and generator state,
same token. Temperature 0 means greedy (argmax).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # 0 = no limit
    seed: int | None = None  # None = a random seed per request

    def __post_init__(self):
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self) -> torch.Generator:
        """A CPU generator seeded with `seed` (or a fresh random seed): one per request."""
        return torch.Generator().manual_seed(self.seed if self.seed is not None else secrets.randbits(63))


def token_distribution(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Probabilities [V] after temperature, top-k and top-p; logits [V]. Greedy: one-hot at the argmax."""
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


def sample_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """One token id from logits [V]."""
    if cfg.greedy:
        return int(logits.argmax())
    return int(torch.multinomial(token_distribution(logits, cfg), 1, generator=generator))


def sample_decode(session, prompt_ids: list[int], max_new_tokens: int, eos: set[int],
                  cfg: SamplingConfig, cached: int = 0) -> Iterator[list[int]]:
    """Sequential decoding with sampling, one token (one round trip) per step; `session` is a
    `splitlm.decoding.speculative.StepSession` whose caches already hold the first `cached` prompt
    tokens. Yields [token] per step."""
    generator = cfg.generator()
    logits = session.forward(prompt_ids[cached:], rows=[len(prompt_ids) - cached - 1])  # [1, V]
    for produced in range(1, max_new_tokens + 1):
        token = sample_token(logits[-1], cfg, generator)
        yield [token]
        if token in eos or produced == max_new_tokens:
            return
        logits = session.forward([token])
