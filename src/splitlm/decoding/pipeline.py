"""Pipelined speculation: while one step's verification is in flight, draft and send the next.

The edge bets that the step in flight will accept one root-to-leaf path of its tree (the leaf with
the highest estimated chance of being reached) and sends the next step as a continuation of that
path: its root is the bet's leaf (already sent), its first level guesses the in-flight step's
bonus token, and it settles the in-flight block by keeping the bet path. When the in-flight
step's logits arrive they are verified as usual, on the true context:

- accepted path == bet: the next step stands; its root's logits are the leaf's, so verification
  goes on into it when its reply arrives (if the bonus token is none of its first-level guesses it
  yields nothing and its block is dropped with the next request's keep);
- otherwise the next step is stale: its reply is discarded and every cache rolls back to the
  accepted path (`EdgeSession.rewind`: a crop, plus the accepted nodes the bet dropped, re-sent
  as context rows).

Every token is still chosen by verifying the target's logits on its true context (argmax, or the
sampler's draw with the uniform of that position), so greedy output equals sequential decoding
and seeded sampling equals sequential sampling with that seed. At most two steps are in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from splitlm.decoding.budget import StepBudget
from splitlm.decoding.drafters import Drafter
from splitlm.decoding.sampling import SamplingConfig
from splitlm.decoding.speculative import SpecStats, build_step, prefill, stop_at
from splitlm.decoding.step import StepResult
from splitlm.decoding.tree import TokenTree, accept_greedy, accept_sampled


class PipeSession(Protocol):
    """What pipelining needs from a session (`splitlm.edge.session.EdgeSession`)."""

    def forward(self, ids: list[int], positions: list[int] | None = None, mask: torch.Tensor | None = None,
                keep: list[int] | None = None, rows: list[int] | None = None,
                argmax: bool = False) -> StepResult: ...

    def send(self, ids: list[int], positions: list[int], mask: torch.Tensor | None = None,
             rows: list[int] | None = None, keep: list[int] | None = None, argmax: bool = False) -> object: ...

    def receive(self, flight) -> StepResult: ...

    def discard(self, flight) -> None: ...

    def rewind(self, flight, keep: list[int]) -> None: ...

    def settle(self, keep: list[int] | None = None) -> None: ...


@dataclass
class Step:
    tree: TokenTree
    ctx: list[int]  # the tokens up to and including the tree's root (what the step assumes)
    root_sent: bool  # the root is in this step's block (False: it is the leaf of the bet before)
    flight: object = None
    bet: list[int] | None = None  # the path of `tree` the next step assumes
    root_logits: torch.Tensor | None = None  # [V] (greedy: [] token) when the root was not sent: from the step before
    known: int | None = None  # the token after the root, once the step before is verified
    void: bool = False

    def block_keep(self, path: list[int]) -> list[int]:
        """Indices into this step's block of the tree nodes `path`."""
        return list(path) if self.root_sent else [i - 1 for i in path[1:]]


def sync_drafter(drafter: Drafter, context: list[int]) -> None:
    """Bring the drafter's context to `context`: extend it, or cut it back (`truncate` where the
    drafter has one, else `reset`) and extend."""
    cur = drafter.context
    n = 0
    limit = min(len(cur), len(context))
    while n < limit and cur[n] == context[n]:
        n += 1
    if n < len(cur):
        truncate = getattr(drafter, "truncate", None)
        if truncate is None or n == 0:
            drafter.reset(context)
            return
        truncate(n)
    if n < len(context):
        drafter.extend(context[n:])


def choose_bet(step: Step, budget: StepBudget) -> tuple[list[int], float] | None:
    """The root-to-leaf path the next step bets on, and its estimated chance to be the accepted
    path; None when there is nothing to bet on."""
    tree = step.tree
    path = [0]
    if not step.root_sent:
        child = None if step.known is None else tree.child(0, step.known)
        if child is None:
            return None
        path.append(child)
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    reach = {path[-1]: 1.0}
    best, best_p = path[-1], -1.0
    stack = [path[-1]]
    while stack:
        node = stack.pop()
        kids = children.get(node, [])
        if not kids and reach[node] > best_p:
            best, best_p = node, reach[node]
        for k in kids:
            reach[k] = reach[node] * budget.calibration.p(tree.scores[k])
            stack.append(k)
    if best == 0:
        return None
    tail = []
    while best != path[-1]:
        tail.append(best)
        best = tree.parents[best]
    return path + tail[::-1], best_p


def pipelined_decode(session: PipeSession, prompt_ids: list[int], max_new_tokens: int, eos: set[int],
                     drafter: Drafter, budget: StepBudget, stats: SpecStats, cached: int = 0,
                     sampling: SamplingConfig | None = None, always_bet: bool = False) -> Iterator[list[int]]:
    """Like `splitlm.decoding.speculative.speculative_decode` (no lookahead window), with up to two
    steps in flight. Yields the new tokens of each verified step.

    A bet is placed when it is expected to pay: its chance p to hold (the budget's calibrated
    acceptance) times the round trip it saves exceeds (1 - p) times what a stale step delays the
    retry (its compute less a round trip, so at a long RTT nothing);
    `always_bet` bets whenever there is a path to bet on (tests)."""
    sampler, root, _ = prefill(session, prompt_ids, cached, budget, sampling)
    yield [root]
    produced = 1
    context = list(prompt_ids) + [root]
    drafter.reset(context)
    cap = getattr(session, "max_step_tokens", None)
    flight: deque[Step] = deque()
    keep_next: list[int] | None = None  # the last block's keep, for the next send (or the final settle)
    last: tuple[Step, list[int]] | None = None  # the last verified step and its true keep

    def propose(ctx: list[int], exclude_root: bool) -> TokenTree:
        sync_drafter(drafter, ctx)
        tree = drafter.propose()
        choice = budget.choose(tree)
        nodes = choice.nodes if cap is None else min(choice.nodes, cap + exclude_root)
        return tree.pruned(nodes, choice.reach)

    def send(step: Step, keep: list[int] | None) -> None:
        tree, base = step.tree, len(step.ctx) - 1
        if step.root_sent:
            tokens, positions, mask, rows = build_step(tree, None, base)
        else:
            tokens, positions = tree.tokens[1:], [base + d for d in tree.depths()[1:]]
            mask, rows = tree.mask()[1:, 1:], list(range(len(tree) - 1))
        step.flight = session.send(tokens, positions, mask, rows, keep, argmax=sampler is None)
        flight.append(step)

    try:
        while True:
            live = [s for s in flight if not s.void]
            if not live and produced < max_new_tokens and context[-1] not in eos:
                send(Step(propose(context, False), list(context), True), keep_next)
                keep_next = None
                live = [flight[-1]]
            if len(flight) == 1 and live:
                prev = flight[-1]
                bet = choose_bet(prev, budget)
                if bet is not None:
                    path, p = bet
                    tokens = [prev.tree.tokens[i] for i in path[1:]]
                    done = len(prev.ctx) + len(tokens) - len(prompt_ids)  # generated if the bet holds
                    nodes = len(prev.tree)
                    # a stale step delays only the retry sent on the miss: the cloud started it half a round
                    # trip before the miss was seen and the retry arrives half a round trip after, so the
                    # delay is its compute less a round trip (edge compute counted too: an upper bound)
                    wasted = max(0.0, budget.compute.predict(nodes) - budget.rtt_s)
                    pays = always_bet or p * budget.rtt_s > (1 - p) * wasted
                    if pays and done + 1 < max_new_tokens and not eos.intersection(tokens):
                        nxt = Step(TokenTree.root_only(tokens[-1]), prev.ctx + tokens, False)
                        nxt.tree = propose(nxt.ctx, True)
                        if len(nxt.tree) > 1:
                            prev.bet = path
                            send(nxt, prev.block_keep(path))
                            stats.pipelined += 1
            if not flight:
                break
            step = flight.popleft()
            if step.void:
                session.discard(step.flight)
                stats.discarded += 1
                continue
            info = session.receive(step.flight)
            logits = info.out
            if not step.root_sent:
                logits = torch.cat([step.root_logits[None], logits])
            if sampler:
                path, new = accept_sampled(step.tree, logits, sampler, step.ctx)
            else:
                path, new = accept_greedy(step.tree, logits.tolist())  # greedy steps return tokens
            drafter.accepted(new[:-1])
            budget.compute.add(info.tokens, info.compute_s)
            if not info.overlapped:
                budget.observe_network(info.network_s)
            budget.observe_acceptance(step.tree, path)
            stats.steps += 1
            stats.tree_nodes += len(step.tree)
            stats.accepted_drafts += len(path) - 1
            verified = step.ctx + new
            fresh = verified[len(context):]  # a pipelined step's first token was the step before's bonus
            keep_len = len(path)
            n = stop_at(fresh, produced, max_new_tokens, eos)
            stop = n is not None
            if stop:
                fresh = fresh[:n]
                # the cache keeps the context up to, not including, the last token
                keep_len = len(context) - len(step.ctx) + n
            keep = step.block_keep(path[:keep_len])
            nxt = flight[0] if flight else None
            last = (step, keep)
            if nxt is not None and step.bet is not None:
                if not stop and path == step.bet:
                    nxt.root_logits, nxt.known = logits[path[-1]], new[-1]
                    if nxt.tree.child(0, new[-1]) is None:  # it guessed nothing right: drop its block
                        nxt.void, keep_next = True, []
                else:
                    session.rewind(step.flight, keep)
                    nxt.void = True
                    stats.missed += not stop
            else:
                keep_next = keep
            produced += len(fresh)
            context.extend(fresh)
            if fresh:
                yield fresh
            if stop:
                break
        for s in flight:  # only rolled-back steps are left
            session.discard(s.flight)
            stats.discarded += 1
        if keep_next is not None:
            session.settle(keep_next)
    except GeneratorExit:  # the caller stopped early: undo the bets, take the replies
        if any(not s.void for s in flight) and last is not None:
            session.rewind(last[0].flight, last[1])
        elif keep_next is not None:
            session.settle(keep_next)
        for s in flight:
            session.discard(s.flight)
        raise
