"""Constrained decoding: every emitted token is one the request's grammar allows.

Sequential constrained decoding (`splitlm.decoding.shapes.SequentialShape` with a grammar, spec mode
`none`) is the reference: at
each step the best allowed token (argmax over the grammar's mask, or the sampler's draw from the
masked distribution), one token per round trip. A forced state allows one token only, so it is
emitted whatever the model says.

Grammar-aware speculation (`GrammarShape`, the loop's shape part in every other mode) gives the same
tokens with fewer round trips:

- the tokens the grammar forces before the first choice go up with the prompt (`GrammarShape.prefill`),
  with the guess of what it fixes next where the tokenizer could split that more than one way (` "`
  opening a string: `GrammarState.expected_chain`): the prefill's logits check the guess and pick the
  first token the model chooses; a guess it does not take is cropped from the caches;
- the tokens the grammar forces after the last emitted one (`GrammarState.forced_chain`) are certain:
  the drafter's context is extended by them before it drafts, and the step's tree is that chain
  followed by the drafter's tree (the chain's nodes still ride in the pass: the cache needs their
  entries and the token after them needs the model's logits at their positions);
- the tree is walked through the grammar (`splitlm.decoding.grammar_tree.constrain`): rejected drafts
  are pruned before they are sent, forced continuations join as certain nodes, every node gets its
  mask;
- each row's token is chosen among its node's allowed tokens (the screened greedy head takes the
  masks, `StepInput.allowed`; sampling masks the logits before the sampler), and the
  tree is verified as usual: the certain nodes are accepted whenever their parents are.

Where the forced chain itself ends the request (an end token, or the length limit) it is emitted
without a round trip.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.grammar import GrammarState
from splitlm.decoding.grammar_tree import (
    CHOICE,
    ConstrainedTree,
    add_value_ends,
    constrain,
    graft,
    small_choice,
)
from splitlm.decoding.request import GrammarStats, Plan
from splitlm.decoding.speculative import build_step, stop_at
from splitlm.decoding.step import StepInput, StepResult
from splitlm.decoding.tree import FORCED, TokenTree

if TYPE_CHECKING:
    from splitlm.decoding.request import Run
    from splitlm.decoding.sampling import Sampler

MAX_ROOT_CHAIN = 32  # forced tokens put ahead of the drafter's tree in one step
MAX_TREE_CHAIN = 16  # forced tokens added after one drafted node
CLOSE_WINDOW = 64  # tokens before the length limit from which every token is checked for room to close
AFTER_ENDS = 4  # open ends inside a tree (where a forced chain or a small choice ends) the drafter drafts after
AFTER_MIN_REACH = 0.01  # the budget, not this, decides what is sent: steps reached ends it put below 0.05


def pick(logits: torch.Tensor, allowed: torch.Tensor, sampler: Sampler | None, context: list[int]) -> int:
    """The token after `context` from logits [V] among `allowed` [V]."""
    masked = logits.masked_fill(~allowed, -torch.inf)
    return sampler.token(masked, context) if sampler else int(masked.argmax())


def advance_all(state: GrammarState, tokens: list[int]) -> list[int]:
    """`tokens`, once `state` has moved past them (so that `yield advance_all(state, new)` emits them)."""
    for t in tokens:
        state.advance(t)
    return tokens


def close_at(
    state: GrammarState, tokens: list[int], produced: int, max_new_tokens: int
) -> tuple[int, list[int]] | None:
    """Whether the output must close inside `tokens` (the next ones to emit, after `produced` emitted) to
    end complete within `max_new_tokens`: (i, closing) to emit `tokens[:i]` and then the grammar's
    `closing` instead of the rest; None to emit them all. Near the limit (the last `CLOSE_WINDOW`
    tokens) a token is emitted only if the output can still be completed after it in the tokens left,
    else the closing from before it is. Sequential and speculative decoding apply it to every token,
    so they stay token-identical. The state is left where it was."""
    done = 0
    try:
        for i, tok in enumerate(tokens):
            left = max_new_tokens - produced - i  # tokens still allowed, this one's included
            if tok in state.eos:
                return None
            if left <= CLOSE_WINDOW and not state.accepting:
                state.advance(tok)
                fits = state.accepting or state.closing(left - 1) is not None
                state.rollback(1)
                if not fits and (closing := state.closing(left)) is not None:
                    return i, closing
            state.advance(tok)
            done += 1
        return None
    finally:
        state.rollback(done)


class GrammarShape:
    """The loop's shape part for a constrained request (`state`: the grammar after the emitted tokens):
    the forced chain after the root, then the drafter's tree drafted after it, walked through the
    grammar (pruned, forced continuations and value ends added, drafts after open ends), every node
    with its mask, cut to what the budget affords. Near the length limit the loop closes the output
    (`close_at`)."""

    def __init__(self, drafter: Drafter, budget: StepBudget, state: GrammarState, gstats: GrammarStats):
        self.drafter, self.budget, self.state, self.gstats = drafter, budget, state, gstats
        self.last_nodes = 16  # the tree size the budget chose last
        self.cap: int | None = None  # the most tokens a step may carry

    def prefill(self, run: Run) -> tuple[list[int], StepResult]:
        """Run the prompt followed by the tokens the grammar forces before its first choice (`{"name":`)
        and those it likely takes next (` "`: `GrammarState.expected_chain`), so that the prefill's logits
        give the first value's token. Returns the first tokens (those forced, the guesses the model took,
        then its best allowed token; the state is not advanced) and the prefill's step as the drafter sees
        it (the last emitted token's row). A guess the model did not take is cropped from the caches."""
        session, prompt_ids, cached = run.session, run.request.prompt_ids, run.request.cached
        logprobs = run.request.logprobs
        chain, certain = self.state.expected_chain(min(MAX_ROOT_CHAIN, run.request.max_new_tokens - 1))
        end = next((i for i, t in enumerate(chain) if t in run.eos), len(chain))  # the end token: picked
        chain, certain = chain[:end], min(certain, end)
        base = len(prompt_ids) - cached - 1  # the prompt's last token, among those sent
        top = base if logprobs is not None else base + certain  # the first row asked for
        step = session.forward(
            StepInput(
                prompt_ids[cached:] + chain, rows=list(range(top, base + len(chain) + 1)), extras=self.drafter.extras
            )
        )
        self.budget.observe_network(step.network_s)
        context = list(prompt_ids) + advance_all(self.state, chain[:certain])
        self.gstats.forced_tokens += certain
        taken = certain
        while True:
            self.gstats.forced_tokens += self.state.forced() is not None
            root = pick(step.out[base + taken - top], self.state.allowed(), run.sampler, context)
            if taken == len(chain) or root != chain[taken]:
                break
            self.state.advance(root)
            context.append(root)
            taken += 1
        self.state.rollback(taken)
        if taken < len(chain):
            session.crop(len(prompt_ids) + taken)
        if logprobs is not None:
            logprobs.record(chain[:taken] + [root], step.out[: taken + 1])
        return chain[:taken] + [root], step.rows_from(base + taken - top)

    def start(self, context: list[int], first: StepResult) -> None:
        self.drafter.reset(context)
        self.drafter.verified(TokenTree.root_only(context[-2]), [0], [context[-1]], first)

    def plan(self, run: Run) -> Plan:
        """The step: the forced chain and the drafter's tree walked through the grammar, or the chain's
        tokens alone (`free`) where they end the request."""
        self.cap = cap = run.session.max_step_tokens
        chain = self.state.forced_chain(MAX_ROOT_CHAIN if cap is None else min(MAX_ROOT_CHAIN, cap - 1))
        limit = run.request.max_new_tokens
        if run.request.logprobs is None and (n := stop_at(chain, run.produced, limit, run.eos)) is not None:
            self.gstats.forced_tokens += n
            self.gstats.forced_free += n
            return Plan(TokenTree.root_only(run.context[-1]), None, free=chain[:n])  # no round trip needed
        self.drafter.extend(chain)
        tree, expected = self.walk(run.context, chain)
        tokens, positions, mask, rows = build_step(tree.tree, None, len(run.context) - 1)
        allowed = tree.allowed(list(range(len(tree.tree))), self.state.vocab_size)  # [N, V]
        step = StepInput(
            tokens,
            positions,
            mask,
            rows=rows,
            argmax=run.argmax,
            extras=self.drafter.extras,
            allowed=allowed if run.argmax else None,  # else logits come back and the mask applies here
            feature_rows=list(range(len(tree.tree))) if self.drafter.features else None,
        )
        return Plan(tree.tree, step, allowed=allowed, expected=expected, chain=len(chain))

    def walk(self, context: list[int], chain: list[int]) -> tuple[ConstrainedTree, float]:
        """The step's tree: the forced `chain` after the root, then the drafter's tree (drafted on the
        context extended by the chain), walked through the grammar and cut to what the budget affords;
        and the budget's expected tokens."""
        tree = TokenTree(
            [context[-1]] + chain, list(range(-1, len(chain))), [1.0] * (len(chain) + 1), [None] + [FORCED] * len(chain)
        )
        sub = self.drafter.propose()  # rooted at the chain's end
        # walk about what the budget sent last time, with room for the drafts the grammar will reject
        sub = sub.pruned(min(self.budget.max_nodes, 2 * self.last_nodes + 8))
        tree.add_tree(sub, at=len(chain))
        t0 = time.perf_counter()
        walked = constrain(tree, self.state, MAX_TREE_CHAIN)
        walked_n = len(walked.tree)
        add_value_ends(walked, self.budget.reach(walked.tree), self.state, len(chain), MAX_TREE_CHAIN)
        self.gstats.value_end_nodes += len(walked.tree) - walked_n
        self.gstats.mask_s += time.perf_counter() - t0
        self.gstats.mask_steps += len(walked.tree)
        if self.drafter.drafts_after and (ends := self.open_ends(walked, len(chain))):
            walked = self.draft_after(walked, ends, len(chain))
        self.gstats.rejected_drafts += walked.rejected
        self.gstats.choice_nodes += walked.choices
        choice = self.budget.choose(walked.tree)
        self.last_nodes = choice.nodes
        cap = self.cap
        nodes = max(choice.nodes, len(chain) + 1)  # the chain is certain: always sent
        nodes = nodes if cap is None else max(min(nodes, cap), 1)
        kept = walked.tree.pruned(nodes, choice.reach)
        index = {p: i for i, p in enumerate(walked.tree.paths())}
        rows = [walked.rows[index[p]] for p in kept.paths()]
        return ConstrainedTree(kept, rows), choice.expected_tokens

    def open_ends(self, walked: ConstrainedTree, k: int) -> list[tuple[float, int]]:
        """The likeliest leaves (reach, node) of `walked` past its first `k` nodes (the root's chain)
        where what the grammar added ends (a forced chain, a small choice: ` ` or ` -` before a number)
        and the model's choice begins: a value's first token."""
        tree, reach = walked.tree, self.budget.reach(walked.tree)
        inner = set(tree.parents)
        ends = []
        for i in range(1, len(tree)):
            added = tree.certain(i) or tree.keys[i] is CHOICE  # no drafter's node: none drafted after it
            if (
                i > k
                and added
                and i not in inner
                and tree.tokens[i] not in self.state.eos
                and reach[i] >= AFTER_MIN_REACH
                and small_choice(walked.rows[i], 1) is None
            ):
                ends.append((reach[i], i))
        return sorted(ends, reverse=True)[:AFTER_ENDS]

    def draft_after(self, walked: ConstrainedTree, ends: list[tuple[float, int]], k: int) -> ConstrainedTree:
        """`walked` with the drafter's drafts after each of its open `ends` (walked through the grammar)."""
        paths = walked.tree.paths()
        after = self.drafter.propose_after([list(paths[i][k:]) for _, i in ends], [r for r, _ in ends])
        before = len(walked.tree)
        t0 = time.perf_counter()
        graft(walked, after, k, self.state, MAX_TREE_CHAIN)
        self.gstats.mask_s += time.perf_counter() - t0
        self.gstats.mask_steps += len(walked.tree) - before
        return walked

    def learn(self, plan: Plan, path: list[int], new: list[int], ids: list[int] | None, result: StepResult) -> None:
        """The drafter hears of the step as of its own tree: the part after the chain's tokens."""
        tree, k = plan.tree, plan.chain
        self.drafter.accepted(new[k:-1])
        if len(path) > k:
            sub = TokenTree(tree.tokens[k:], [max(p - k, -1) for p in tree.parents[k:]], tree.scores[k:], tree.keys[k:])
            self.drafter.verified(sub, [p - k for p in path[k:]], new[k:], result.rows_from(k))

    def emitted(self, plan: Plan, path: list[int], fresh: list[int]) -> None:
        """Count the forced tokens among those emitted."""
        self.gstats.forced_tokens += sum(plan.tree.certain(i) for i in path[1 : len(fresh) + 1])

    def extend(self, plan: Plan, fresh: list[int]) -> None:
        self.drafter.extend(fresh[plan.chain :])
