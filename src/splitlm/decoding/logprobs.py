"""Log-probabilities of the emitted tokens (the OpenAI API's `logprobs` / `top_logprobs`).

The decoding loops hand a `LogprobRecorder` each emitted token together with the fp32 logits row it
was chosen from (the row of the position before it); the recorder keeps the token's log-softmax over
the whole vocabulary and the `top` likeliest tokens. What is recorded is the model's own
distribution at that position: before temperature, top-p / top-k, the repetition penalty and any
grammar mask (what OpenAI reports). Speculative and sequential decoding emit each token from the
same position's logits, so their records agree within fp32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # the likeliest (id, logprob), likeliest first


class LogprobRecorder:
    """Collects a `TokenLogprob` per emitted token, in order; `top`: how many likeliest tokens each keeps."""

    def __init__(self, top: int = 0):
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
        self.top = top
        self.tokens: list[TokenLogprob] = []

    def record(self, tokens: list[int], rows: torch.Tensor) -> None:
        """`tokens` [n] were chosen from the logits `rows` [n, V] (row i: the distribution of tokens[i])."""
        if not tokens:
            return
        lp = torch.log_softmax(rows.float(), dim=-1)  # [n, V]
        chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()  # [n]
        if self.top:
            values, ids = lp.topk(self.top, dim=-1)  # [n, top], sorted
            tops = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
        else:
            tops = [[] for _ in tokens]
        self.tokens += [TokenLogprob(t, c, k) for t, c, k in zip(tokens, chosen, tops, strict=True)]
