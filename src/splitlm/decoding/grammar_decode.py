"""Constrained decoding: every emitted token is one the request's grammar allows.

Sequential constrained decoding (`constrained_sequential`, spec mode `none`) is the reference: at
each step the best allowed token (argmax over the grammar's mask, or the sampler's draw from the
masked distribution), one token per round trip. A forced state allows one token only, so it is
emitted whatever the model says.

Grammar-aware speculation (`constrained_decode`, every other mode) gives the same tokens with fewer
round trips:

- the tokens the grammar forces before the first choice go up with the prompt (`constrained_prefill`),
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
  masks, `EdgeSession.forward(allowed=...)`; sampling masks the logits before the sampler), and the
  tree is verified as usual: the certain nodes are accepted whenever their parents are.

Where the forced chain itself ends the request (an end token, or the length limit) it is emitted
without a round trip.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
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
from splitlm.decoding.sampling import Sampler, SamplingConfig
from splitlm.decoding.speculative import SpecStats, StepSession, build_step, extras, stop_at
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import FORCED, TokenTree, accept_greedy, accept_sampled

if TYPE_CHECKING:
    from splitlm.decoding.logprobs import LogprobRecorder

MAX_ROOT_CHAIN = 32  # forced tokens put ahead of the drafter's tree in one step
MAX_TREE_CHAIN = 16  # forced tokens added after one drafted node
CLOSE_WINDOW = 64  # tokens before the length limit from which every token is checked for room to close
AFTER_ENDS = 4  # open ends inside a tree (where a forced chain or a small choice ends) the drafter drafts after
AFTER_MIN_REACH = 0.01  # the budget, not this, decides what is sent: steps reached ends it put below 0.05


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


def constrained_sequential(
    session: StepSession,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos: set[int],
    state: GrammarState,
    gstats: GrammarStats,
    cached: int = 0,
    sampling: SamplingConfig | None = None,
    logprobs: LogprobRecorder | None = None,
) -> Iterator[list[int]]:
    """One token per round trip, each the best the grammar allows (`state`: the grammar before the
    first; the request ends with it). Yields [token] per step."""
    sampler = Sampler(sampling) if sampling is not None and not sampling.plain_greedy else None
    argmax = sampler is None and logprobs is None
    eos = eos | set(state.eos)
    context = list(prompt_ids)
    ids, rows = prompt_ids[cached:], [len(prompt_ids) - cached - 1]
    for produced in range(1, max_new_tokens + 1):
        t0 = time.perf_counter()
        allowed = state.allowed()  # [V]
        gstats.mask_s += time.perf_counter() - t0
        gstats.mask_steps += 1
        gstats.forced_tokens += state.forced() is not None
        if argmax and produced > 1:  # the prefill (maybe streamed in chunks) returns logits
            token = int(session.forward(ids, argmax=True, allowed=allowed[None]).out[-1])
        else:
            logits = session.forward(ids, rows=rows).out  # [1, V]
            token = pick(logits[-1], allowed, sampler, context)
            if logprobs is not None:
                logprobs.record([token], logits[-1:])
        if logprobs is None and (cut := close_at(state, [token], produced - 1, max_new_tokens)) is not None:
            yield advance_all(
                state, cut[1]
            )  # no room left after this token to complete the output: complete it instead
            return
        state.advance(token)
        context.append(token)
        yield [token]
        if token in eos or produced == max_new_tokens:
            return
        ids, rows = [token], None


class ConstrainedRun:
    """One constrained speculative request after its prefill: the verified context, the grammar state
    after it, and what each step needs."""

    def __init__(
        self,
        session: StepSession,
        drafter: Drafter,
        budget: StepBudget,
        stats: SpecStats,
        state: GrammarState,
        gstats: GrammarStats,
        sampler: Sampler | None,
        logprobs: LogprobRecorder | None,
    ):
        self.session, self.drafter, self.budget, self.stats = session, drafter, budget, stats
        self.state, self.gstats, self.sampler, self.logprobs = state, gstats, sampler, logprobs
        self.argmax = sampler is None and logprobs is None  # else logits come back and the mask applies here
        self.last_nodes = 16  # the tree size the budget chose last

    def plan(self, context: list[int], chain: list[int]) -> tuple[ConstrainedTree, int]:
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
        cap = self.session.max_step_tokens
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

    def verify(self, tree: ConstrainedTree, context: list[int]) -> tuple[list[int], list[int], StepResult]:
        """Send the tree, choose each row's token among its allowed ones, walk the tree: the accepted
        path, the new tokens and the step."""
        tokens, positions, mask, rows = build_step(tree.tree, None, len(context) - 1)
        allowed = tree.allowed(list(range(len(tree.tree))), self.state.vocab_size)  # [N, V]
        step = self.session.forward(
            tokens,
            positions,
            mask,
            rows=rows,
            argmax=self.argmax,
            allowed=allowed if self.argmax else None,
            **extras(self.drafter),
        )
        if self.sampler is not None:
            path, new = accept_sampled(tree.tree, step.out.masked_fill(~allowed, -torch.inf), self.sampler, context)
        else:
            out = step.out if self.argmax else step.out.masked_fill(~allowed, -torch.inf).argmax(-1)
            path, new = accept_greedy(tree.tree, out.tolist())
        return path, new, step

    def learn(self, tree: TokenTree, k: int, path: list[int], new: list[int], step: StepResult) -> None:
        """The drafter hears of the step as of its own tree: the part after the `k` chain tokens."""
        self.drafter.accepted(new[k:-1])
        if len(path) > k:
            sub = TokenTree(tree.tokens[k:], [max(p - k, -1) for p in tree.parents[k:]], tree.scores[k:], tree.keys[k:])
            self.drafter.verified(sub, [p - k for p in path[k:]], new[k:], step.rows_from(k))


def constrained_prefill(
    session: StepSession, prompt_ids: list[int], cached: int, run: ConstrainedRun, max_new_tokens: int, eos: set[int]
) -> tuple[list[int], StepResult]:
    """Run the prompt followed by the tokens the grammar forces before its first choice (`{"name":`)
    and those it likely takes next (` "`: `GrammarState.expected_chain`), so that the prefill's logits
    give the first value's token. Returns the first tokens (those forced, the guesses the model took,
    then its best allowed token; the state is not advanced) and the prefill's step as the drafter sees
    it (the last emitted token's row). A guess the model did not take is cropped from the caches."""
    chain, certain = run.state.expected_chain(min(MAX_ROOT_CHAIN, max_new_tokens - 1))
    end = next((i for i, t in enumerate(chain) if t in eos), len(chain))  # the end token: picked
    chain, certain = chain[:end], min(certain, end)
    base = len(prompt_ids) - cached - 1  # the prompt's last token, among those sent
    top = base if run.logprobs is not None else base + certain  # the first row asked for
    step = session.forward(
        prompt_ids[cached:] + chain, rows=list(range(top, base + len(chain) + 1)), **extras(run.drafter)
    )
    run.budget.observe_network(step.network_s)
    context = list(prompt_ids) + advance_all(run.state, chain[:certain])
    run.gstats.forced_tokens += certain
    taken = certain
    while True:
        run.gstats.forced_tokens += run.state.forced() is not None
        root = pick(step.out[base + taken - top], run.state.allowed(), run.sampler, context)
        if taken == len(chain) or root != chain[taken]:
            break
        run.state.advance(root)
        context.append(root)
        taken += 1
    run.state.rollback(taken)
    if taken < len(chain):
        session.crop(len(prompt_ids) + taken)
    if run.logprobs is not None:
        run.logprobs.record(chain[:taken] + [root], step.out[: taken + 1])
    return chain[:taken] + [root], step.rows_from(base + taken - top)


def constrained_decode(
    session: StepSession,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos: set[int],
    drafter: Drafter,
    budget: StepBudget,
    stats: SpecStats,
    state: GrammarState,
    gstats: GrammarStats,
    cached: int = 0,
    sampling: SamplingConfig | None = None,
    logprobs: LogprobRecorder | None = None,
) -> Iterator[list[int]]:
    """Like `splitlm.decoding.speculative.speculative_decode` (no lookahead window), every token
    allowed by the grammar (`state`: before the first token); the same tokens as
    `constrained_sequential`. Yields the new tokens of each step; the request ends with the grammar."""
    eos = eos | set(state.eos)
    sampler = Sampler(sampling) if sampling is not None and not sampling.plain_greedy else None
    run = ConstrainedRun(session, drafter, budget, stats, state, gstats, sampler, logprobs)
    firsts, first = constrained_prefill(session, prompt_ids, cached, run, max_new_tokens, eos)
    if logprobs is None and (cut := close_at(state, firsts, 0, max_new_tokens)) is not None:
        yield advance_all(state, firsts[: cut[0]] + cut[1])
        return
    yield advance_all(state, firsts)
    root, produced, context = firsts[-1], len(firsts), list(prompt_ids) + firsts
    drafter.reset(context)
    drafter.verified(TokenTree.root_only(context[-2]), [0], [root], first)
    cap = session.max_step_tokens
    while produced < max_new_tokens and root not in eos:
        started = time.perf_counter()
        chain = state.forced_chain(MAX_ROOT_CHAIN if cap is None else min(MAX_ROOT_CHAIN, cap - 1))
        if logprobs is None and (n := stop_at(chain, produced, max_new_tokens, eos)) is not None:
            gstats.forced_tokens += n
            gstats.forced_free += n
            yield advance_all(state, chain[:n])  # the request ends inside the chain: no round trip needed
            return
        drafter.extend(chain)
        tree, expected = run.plan(context, chain)
        sent = time.perf_counter()
        path, new, step = run.verify(tree, context)
        returned = time.perf_counter()
        run.learn(tree.tree, len(chain), path, new, step)
        budget.observe_acceptance(tree.tree, path)
        budget.observe_step(
            len(tree.tree), step.compute_s, step.network_s, (sent - started) + (time.perf_counter() - returned)
        )
        stats.verified(len(tree.tree), len(path) - 1)
        stats.expected_tokens += expected
        stats.choices.append(len(tree.tree))
        keep = path
        if (n := stop_at(new, produced, max_new_tokens, eos)) is not None:
            new, keep = new[:n], path[:n]  # the cache keeps the context up to, not including, the last token
        closing = None
        if logprobs is None and (cut := close_at(state, new, produced, max_new_tokens)) is not None:
            new, keep, closing = new[: cut[0]], path[: max(cut[0], 1)], cut[1]
        session.settle(keep)
        if logprobs is not None:
            logprobs.record(new, step.out[path[: len(new)]])
        gstats.forced_tokens += sum(tree.tree.certain(i) for i in path[1 : len(new) + 1])
        if closing is not None:  # no room to complete the output after new[len(new)]: complete it now
            yield advance_all(state, new + closing)
            return
        advance_all(state, new)
        produced += len(new)
        context.extend(new)
        drafter.extend(new[len(chain) :])
        root = new[-1]
        yield new
