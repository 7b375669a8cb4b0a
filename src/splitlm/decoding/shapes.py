"""Two parts of the decoding loop (`splitlm.decoding.loop`): how a step's tree is shaped (`PlainShape`:
the drafter's tree, pruned to the budget, with its lookahead window riding along; `SequentialShape`:
the root alone, one token per round trip) and how a step is accepted (`Acceptance`: greedy, or exact
speculative sampling; a grammar's masks applied). The grammar's shape is
`splitlm.decoding.grammar_decode.GrammarShape`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from splitlm.decoding.layer_head import RING
from splitlm.decoding.request import Plan
from splitlm.decoding.speculative import SpecStats, build_step, greedy_ids
from splitlm.decoding.step import StepInput, StepResult
from splitlm.decoding.tree import TokenTree, accept_greedy, accept_sampled

if TYPE_CHECKING:
    from splitlm.decoding.budget import BudgetChoice, StepBudget
    from splitlm.decoding.drafters import Drafter, Window
    from splitlm.decoding.request import GrammarStats, Reply, Run
    from splitlm.decoding.sampling import Sampler


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


class PlainShape:
    """The drafter's tree, pruned to what the budget affords, with the drafter's lookahead window (one
    that `adapts_window` is resized every step to what the measured link and compute afford).
    `drafter` None: a pipelined request whose drafter learns nothing (the flow drafts its trees)."""

    def __init__(self, drafter: Drafter | None, budget: StepBudget, stats: SpecStats):
        self.drafter, self.budget, self.stats = drafter, budget, stats
        self.la = None  # the window to resize
        self.max_width = 0

    def prefill(self, run: Run) -> tuple[list[int], StepResult]:
        """Run the uncached prompt tokens: the first token and the prefill's step."""
        prompt, cached = run.request.prompt_ids, run.request.cached
        extras = 0 if self.drafter is None else self.drafter.extras
        n = len(prompt) - cached
        features = list(range(max(0, n - RING), n)) if self.drafter is not None and self.drafter.features else None
        step = run.session.forward(
            StepInput(prompt[cached:], rows=[n - 1], argmax=run.argmax, extras=extras, feature_rows=features)
        )
        # the prefill's network time is a round trip like any other; its compute (a long causal pass,
        # cheaper per token than a decoding step's) would bias the per-token cost, so it is not fitted
        self.budget.observe_network(step.network_s)
        root = run.sampler.token(step.out[-1], prompt) if run.sampler else greedy_ids(step.out)[-1]
        if run.request.logprobs is not None:
            run.request.logprobs.record([root], step.out[-1:])
        return [root], step

    def start(self, context: list[int], first: StepResult) -> None:
        """The drafter starts on `context` and hears of the prefill's step."""
        if self.drafter is None:
            return
        self.drafter.reset(context)
        self.drafter.verified(TokenTree.root_only(context[-2]), [0], [context[-1]], first)
        self.la = self.drafter.lookahead if self.drafter.adapts_window else None
        self.max_width = 0 if self.la is None else self.la.width

    def plan(self, run: Run) -> Plan:
        drafter, la, stats = self.drafter, self.la, self.stats
        if la is not None:
            tau = (run.produced - 1) / stats.steps if stats.steps else 1.0
            la.set_width(self.budget.window_width(la.width, self.max_width, la.n - 1, drafter.window_gain, tau))
        tree, window, choice = plan_step(drafter, self.budget, run.session.max_step_tokens)
        tokens, positions, mask, rows = build_step(tree, window, len(run.context) - 1)
        features = list(range(len(tree))) if drafter.features else None
        step = StepInput(
            tokens, positions, mask, rows=rows, argmax=run.argmax, extras=drafter.extras, feature_rows=features
        )
        return Plan(tree, step, window=window, expected=choice.expected_tokens)

    def learn(self, plan: Plan, path: list[int], new: list[int], ids: list[int] | None, result: StepResult) -> None:
        """The drafter hears of the verified step (`ids`: every row's greedy token)."""
        if self.drafter is None:
            return
        self.drafter.accepted(new[:-1])
        self.drafter.verified(plan.tree, path, new, result)
        if plan.window is not None:
            self.drafter.lookahead.observe(ids[len(plan.tree) :])

    def emitted(self, plan: Plan, path: list[int], fresh: list[int]) -> None:
        """Nothing to count."""

    def extend(self, plan: Plan, fresh: list[int]) -> None:
        self.drafter.extend(fresh)


class SequentialShape:
    """The root alone: one token per round trip, the best the grammar (`state`, if any) allows. Nothing
    is drafted or learned and the session keeps every entry."""

    drafter = None

    def __init__(self, gstats: GrammarStats | None = None):
        self.gstats = gstats

    def prefill(self, run: Run) -> None:
        """None: the first step carries the prompt."""

    def start(self, context: list[int], first: StepResult) -> None:
        """Nothing to start."""

    def plan(self, run: Run) -> Plan:
        allowed = None
        if (state := run.state) is not None:
            t0 = time.perf_counter()
            allowed = state.allowed()[None]  # [1, V]
            self.gstats.mask_s += time.perf_counter() - t0
            self.gstats.mask_steps += 1
            self.gstats.forced_tokens += state.forced() is not None
        prompt, cached = run.request.prompt_ids, run.request.cached
        if run.produced == 0:  # the prefill (maybe streamed in chunks) returns logits
            step = StepInput(prompt[cached:], rows=[len(prompt) - cached - 1])
        elif run.argmax:
            step = StepInput([run.context[-1]], argmax=True, allowed=allowed)
        else:
            step = StepInput([run.context[-1]])
        return Plan(TokenTree.root_only(run.context[-1]), step, allowed=allowed, settles=False)

    def learn(self, plan: Plan, path: list[int], new: list[int], ids: list[int] | None, result: StepResult) -> None:
        """Nothing learns."""

    def emitted(self, plan: Plan, path: list[int], fresh: list[int]) -> None:
        """Nothing to count (forced tokens are counted as planned)."""

    def extend(self, plan: Plan, fresh: list[int]) -> None:
        """No drafter."""


class Acceptance:
    """Verifies a step's tree on its reply: greedy (each row's argmax among its allowed tokens), or exact
    speculative sampling (`sampler`: the masked logits' draw at each position)."""

    def __init__(self, sampler: Sampler | None):
        self.sampler = sampler

    def accept(self, reply: Reply) -> tuple[list[int], list[int], list[int] | None]:
        """The accepted path, the new tokens (accepted and the bonus) and, where the plan has a window
        (whose rows follow the tree's), every row's greedy token."""
        tree, out, allowed = reply.plan.tree, reply.out, reply.plan.allowed
        n = len(tree)
        if out.dim() == 2 and allowed is not None:
            out = out.masked_fill(~allowed, -torch.inf)  # [N, V]
        if self.sampler is not None:
            path, new = accept_sampled(tree, out[:n], self.sampler, reply.ctx)
            return path, new, (out.argmax(-1).tolist() if reply.plan.window is not None else None)
        ids = greedy_ids(out)  # [R] (greedy steps return tokens, or logits when logprobs are recorded)
        path, new = accept_greedy(tree, ids[:n])
        return path, new, ids
