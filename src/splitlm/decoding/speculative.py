"""The decoding loop: draft a tree, verify it in one pass through the split model, keep the
accepted path. Greedy output is token-identical to sequential decoding."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitlm.decoding.budget import BudgetChoice, StepBudget
from splitlm.decoding.drafters import Drafter, Window
from splitlm.decoding.logprobs import LogprobRecorder
from splitlm.decoding.sampling import Sampler, SamplingConfig
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree, accept_greedy, accept_sampled


class StepSession(Protocol):
    """What the loop needs from a session: one forward of new tokens, returning a `StepResult` whose
    `out` holds the asked rows' logits (with `argmax`: only each row's greedy token), `settle` to keep
    only the accepted entries of the last forward's tokens and `crop` to keep the first n of the
    session's. With `argmax` and `allowed` [R, V] bool (a grammar's masks), each row's greedy token is
    chosen among its allowed ones."""

    def forward(
        self,
        ids: list[int],
        positions: list[int] | None = None,
        mask: torch.Tensor | None = None,
        keep: list[int] | None = None,
        rows: list[int] | None = None,
        argmax: bool = False,
        allowed: torch.Tensor | None = None,
    ) -> StepResult: ...

    def settle(self, keep: list[int] | None = None) -> None: ...

    def crop(self, n: int) -> None:
        """Keep the first n committed tokens (a prefill's guesses the model did not take go)."""

    @property
    def max_step_tokens(self) -> int | None:
        """The most new tokens one step may carry (a cloud cache window caps them), or None."""


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


def extras(drafter: Drafter) -> dict:
    """The forward's keyword for what the drafter learns from a pass (nothing for drafters that need none)."""
    return {"extras": drafter.extras} if drafter.extras else {}


def greedy_ids(out: torch.Tensor) -> list[int]:
    """Each row's greedy token from a step's `out`: greedy ids [R] already, or logits [R, V]."""
    return (out if out.dim() == 1 else out.argmax(-1)).tolist()


def prefill(
    session: StepSession,
    prompt_ids: list[int],
    cached: int,
    budget: StepBudget,
    sampling: SamplingConfig | None,
    drafter: Drafter | None = None,
    logprobs: LogprobRecorder | None = None,
) -> tuple[Sampler | None, int, StepResult]:
    """Run the uncached prompt tokens; returns the sampler (None for greedy), the first token and the
    prefill's step. With `logprobs` every step asks for logits (greedy too) and the first token's goes there."""
    sampler = Sampler(sampling) if sampling is not None and not sampling.plain_greedy else None
    step = session.forward(
        prompt_ids[cached:],
        rows=[len(prompt_ids) - cached - 1],
        argmax=sampler is None and logprobs is None,
        **({} if drafter is None else extras(drafter)),
    )
    # the prefill's network time is a round trip like any other; its compute (a long causal pass,
    # cheaper per token than a decoding step's) would bias the per-token cost, so it is not fitted
    budget.observe_network(step.network_s)
    root = sampler.token(step.out[-1], prompt_ids) if sampler else greedy_ids(step.out)[-1]
    if logprobs is not None:
        logprobs.record([root], step.out[-1:])
    return sampler, root, step


def stop_at(tokens: list[int], produced: int, max_new_tokens: int, eos: set[int]) -> int | None:
    """How many of a step's new `tokens` to emit when an end token or the length limit falls
    inside them (None: all of them, decoding goes on)."""
    for i, tok in enumerate(tokens):
        if tok in eos or produced + i + 1 >= max_new_tokens:
            return i + 1
    return None


def speculative_decode(
    session: StepSession,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos: set[int],
    drafter: Drafter,
    budget: StepBudget,
    stats: SpecStats,
    cached: int = 0,
    sampling: SamplingConfig | None = None,
    logprobs: LogprobRecorder | None = None,
) -> Iterator[list[int]]:
    """Yield the new tokens of each step (the first chunk comes from the prefill). A drafter that
    `adapts_window` has its lookahead window resized every step to what the measured link and
    compute afford.

    `cached`: the first `cached` prompt tokens are already in the session's caches (a later turn of
    a conversation). After every step the session is told which of its entries to keep
    (`settle`; the cloud hears it piggy-backed on the next request), so at any point it holds the
    context except its last token. `logprobs` records each emitted token with the logits row it was
    chosen from (`splitlm.decoding.logprobs`)."""
    sampler, root, first_step = prefill(session, prompt_ids, cached, budget, sampling, drafter, logprobs)
    yield [root]
    produced = 1
    context = list(prompt_ids) + [root]
    drafter.reset(context)
    drafter.verified(TokenTree.root_only(prompt_ids[-1]), [0], [root], first_step)
    la = drafter.lookahead if drafter.adapts_window else None  # the window to resize
    max_width = 0 if la is None else la.width
    while produced < max_new_tokens and root not in eos:
        started = time.perf_counter()
        if la is not None:
            tau = (produced - 1) / stats.steps if stats.steps else 1.0
            la.set_width(budget.window_width(la.width, max_width, la.n - 1, drafter.window_gain, tau))
        tree, window, choice = plan_step(drafter, budget, session.max_step_tokens)
        tokens, positions, mask, rows = build_step(tree, window, len(context) - 1)
        sent = time.perf_counter()
        step = session.forward(
            tokens, positions, mask, rows=rows, argmax=sampler is None and logprobs is None, **extras(drafter)
        )
        returned = time.perf_counter()
        path, new, argmax = accept(tree, step, sampler, context)
        drafter.accepted(new[:-1])
        drafter.verified(tree, path, new, step)
        if window is not None:
            drafter.lookahead.observe(argmax[len(tree) :])
        budget.observe_acceptance(tree, path)
        budget.observe_step(
            len(tokens), step.compute_s, step.network_s, (sent - started) + (time.perf_counter() - returned)
        )
        record(stats, tree, window, path, choice)
        keep = path
        if (n := stop_at(new, produced, max_new_tokens, eos)) is not None:
            new = new[:n]
            keep = path[:n]  # the cache keeps the context up to, not including, the last token
        session.settle(keep)
        if logprobs is not None:
            logprobs.record(new, step.out[path[: len(new)]])  # new[i] was chosen at node path[i]
        produced += len(new)
        context.extend(new)
        drafter.extend(new)
        root = new[-1]
        yield new


def plan_step(drafter: Drafter, budget: StepBudget, cap: int | None) -> tuple[TokenTree, Window | None, BudgetChoice]:
    """The step's tree (pruned to what the budget affords), the lookahead window riding along (None
    when the drafter runs none, or when `cap`, the most tokens a step may carry, leaves no room for
    it) and the budget's choice."""
    window = None if drafter.lookahead is None else drafter.lookahead.window()
    extra = 0 if window is None else len(window.tokens())
    if cap is not None and extra >= cap:
        window, extra = None, 0
    tree = drafter.propose()
    choice = budget.choose(tree, extra)
    if cap is not None:
        choice.nodes = min(choice.nodes, cap - extra)
    return tree.pruned(choice.nodes, choice.reach), window, choice


def accept(
    tree: TokenTree, step: StepResult, sampler: Sampler | None, context: list[int]
) -> tuple[list[int], list[int], list[int]]:
    """Verify `tree` against the pass's rows: the accepted path, the new tokens (accepted and the
    bonus) and every row's greedy token (the window's rows follow the tree's)."""
    if sampler:
        logits = step.out  # [R, V]
        path, new = accept_sampled(tree, logits[: len(tree)], sampler, context)
        return path, new, logits.argmax(-1).tolist()
    argmax = greedy_ids(step.out)  # [R] (greedy steps return tokens, or logits when logprobs are recorded)
    path, new = accept_greedy(tree, argmax[: len(tree)])
    return path, new, argmax


def record(stats: SpecStats, tree: TokenTree, window: Window | None, path: list[int], choice: BudgetChoice) -> None:
    """Count one verified step."""
    stats.verified(len(tree), len(path) - 1)
    stats.window_tokens += 0 if window is None else len(window.tokens())
    stats.expected_tokens += choice.expected_tokens
    stats.choices.append(len(tree))
