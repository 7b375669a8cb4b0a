"""What the decoding loop (`splitlm.decoding.loop.decode`) is asked for, and what its parts pass each
other: a request, its speculation settings, the plan of one step, the reply verified, and the state
of the request as it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitlm.decoding.sampling import Sampler, SamplingConfig
from splitlm.decoding.speculative import SpecStats
from splitlm.decoding.step import StepInput, StepResult, StepSession
from splitlm.decoding.tree import TokenTree

if TYPE_CHECKING:
    from splitlm.decoding.budget import StepBudget
    from splitlm.decoding.drafters import Drafter, Window
    from splitlm.decoding.grammar import GrammarState
    from splitlm.decoding.logprobs import LogprobRecorder


@dataclass
class Speculation:
    """How a request drafts. Without a drafter it is decoded one token per round trip, nothing drafted
    and nothing learned (sequential decoding: the reference)."""

    drafter: Drafter | None = None
    budget: StepBudget | None = None  # what a step may cost; needed with a drafter
    stats: SpecStats = field(default_factory=SpecStats)
    pipeline: bool = False  # send the next step while this one is in flight (bets; no lookahead window)
    bet_drafter: Drafter | None = None  # pipelined: drafts the steps sent on a bet (then `drafter` learns)
    always_bet: bool = False  # pipelined: bet whenever there is a path to bet on (tests)


@dataclass
class GrammarStats:
    """What the grammar did to the trees of one request."""

    rejected_drafts: int = 0  # drafted nodes pruned before they were sent
    forced_tokens: int = 0  # emitted tokens that the grammar forced
    forced_free: int = 0  # forced tokens emitted without a round trip (the request's last)
    choice_nodes: int = 0  # nodes added to trees because their state allowed only a few tokens
    value_end_nodes: int = 0  # nodes added to trees to close a string where a drafted word ends (chains included)
    mask_steps: int = 0  # masks computed (one per tree node sent or walked)
    mask_s: float = 0.0  # time spent walking trees and computing masks

    def to_dict(self) -> dict:
        return {
            "rejected_drafts": self.rejected_drafts,
            "forced_tokens": self.forced_tokens,
            "forced_free": self.forced_free,
            "choice_nodes": self.choice_nodes,
            "value_end_nodes": self.value_end_nodes,
            "mask_steps": self.mask_steps,
            "mask_s": round(self.mask_s, 6),
            "mask_us_per_step": round(1e6 * self.mask_s / max(self.mask_steps, 1), 1),
        }


@dataclass
class DecodeRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    eos: set[int] = field(default_factory=set)  # tokens that end the request (emitted)
    cached: int = 0  # the first `cached` prompt tokens are already in the session's caches
    sampling: SamplingConfig | None = None  # None: greedy
    logprobs: LogprobRecorder | None = None  # records each emitted token with the logits row it was chosen from
    grammar: GrammarState | None = None  # every emitted token is one it allows; the request ends with it
    grammar_stats: GrammarStats | None = None  # what the grammar did (with `grammar`)
    speculation: Speculation = field(default_factory=Speculation)


@dataclass
class Plan:
    """One step as its shape planned it."""

    tree: TokenTree
    step: StepInput | None  # what is sent (None: nothing is, see `free`)
    allowed: torch.Tensor | None = None  # [N, V] bool, each node's allowed tokens (a grammar's)
    window: Window | None = None  # the lookahead window riding along
    expected: float = 0.0  # the budget's expected tokens
    chain: int = 0  # forced tokens after the root: the drafter hears of the tree past them
    settles: bool = True  # the session is told which entries to keep (sequential steps keep all)
    free: list[int] | None = None  # the request ends with these tokens, without a round trip


@dataclass
class Reply:
    """A sent step with its reply, to be verified."""

    plan: Plan
    ctx: list[int]  # the tokens up to and including the tree's root (what the step assumed)
    out: torch.Tensor  # [R, V] logits, or [R] greedy ids, from the root's row on
    result: StepResult  # as the session returned it (what the drafter learns from)
    root_sent: bool = True  # the root is in this step's block (False: it went with the step before)
    learns: bool = True  # the drafter learns from it
    started: float = 0.0  # perf_counter when planning began, when sent, when the reply came back
    sent: float = 0.0
    returned: float = 0.0

    def block_keep(self, path: list[int]) -> list[int]:
        """Indices into this step's block of the tree nodes `path`."""
        return list(path) if self.root_sent else [i - 1 for i in path[1:]]


class Run:
    """One request as it runs: the verified context, the tokens produced, how tokens are chosen."""

    def __init__(self, session: StepSession, request: DecodeRequest):
        self.session, self.request = session, request
        cfg = request.sampling
        self.sampler = Sampler(cfg) if cfg is not None and not cfg.plain_greedy else None
        self.argmax = self.sampler is None and request.logprobs is None  # greedy ids come back, not logits
        self.state = request.grammar
        self.eos = set(request.eos) if self.state is None else request.eos | set(self.state.eos)
        self.context = list(request.prompt_ids)  # the prompt and the emitted tokens
        self.produced = 0

    def done(self) -> bool:
        return self.produced >= self.request.max_new_tokens or (self.produced > 0 and self.context[-1] in self.eos)

    def emit(self, tokens: list[int]) -> list[int]:
        """`tokens`, once the request (and its grammar) moved past them."""
        if self.state is not None:
            for t in tokens:
                self.state.advance(t)
        self.produced += len(tokens)
        self.context.extend(tokens)
        return tokens
