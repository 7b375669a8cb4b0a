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

Two drafters share the request's drafting memory: the *learning* one drafts every step sent on the
verified context and learns from its verification as a direct flow's does (its context only
ever grows, so the step it learns from is always its latest proposal); the *betting* one drafts the
steps sent on a bet, on a context that may be dropped, and learns nothing itself (what it reads of
the memory — retrieval, the recycled table, the calibrations — the learning one keeps up to date).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from splitlm.decoding.request import Plan, Reply
from splitlm.decoding.speculative import build_step
from splitlm.decoding.step import StepInput, StepResult
from splitlm.decoding.tree import TokenTree

if TYPE_CHECKING:
    from splitlm.decoding.budget import StepBudget
    from splitlm.decoding.drafters import Drafter
    from splitlm.decoding.request import Run, Speculation
    from splitlm.decoding.shapes import PlainShape


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
    learns: bool = False  # drafted by the learning drafter on the verified context: it learns from the reply

    def block_keep(self, path: list[int]) -> list[int]:
        """Indices into this step's block of the tree nodes `path`."""
        return list(path) if self.root_sent else [i - 1 for i in path[1:]]


def sync_drafter(drafter: Drafter, context: list[int]) -> None:
    """Bring the drafter's context to `context`: extend it, or, where it holds tokens `context` does
    not (a bet that failed), start it afresh on `context`."""
    cur = drafter.context
    n = 0
    limit = min(len(cur), len(context))
    while n < limit and cur[n] == context[n]:
        n += 1
    if n < len(cur):
        drafter.reset(context)
    elif n < len(context):
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
    children = tree.kids()
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


class PipelinedFlow:
    """The loop's flow part for pipelined requests: the steps in flight (at most two) and what the
    session must still be told.

    Each round `next` sends a step on the verified context when none that stands is in flight
    (`fill`), bets on it (`bet`: the next step sent as a continuation of its likeliest path), then
    hands the oldest step that stands to the loop; once verified, `settle` settles the bet
    (the next step stands, or is void and every cache rolls back). A bet is placed when
    it is expected to pay: its chance p to hold (the budget's calibrated acceptance) times the round
    trip it saves exceeds (1 - p) times what a stale step delays the retry (its compute less a round
    trip, so at a long RTT nothing); `always_bet` bets whenever there is a path to bet on (tests)."""

    def __init__(self, spec: Speculation, shape: PlainShape):
        """`spec.bet_drafter` (another drafter of the same mode and memory) drafts the steps sent on a bet,
        and `spec.drafter` learns from the others (`shape.drafter`); without it `spec.drafter` drafts both
        and learns nothing."""
        self.drafter, self.budget, self.stats = spec.drafter, spec.budget, spec.stats
        self.bet_drafter = spec.bet_drafter or spec.drafter
        self.shape, self.always_bet = shape, spec.always_bet
        self.learning = shape.drafter is not None
        self.flight: deque[Step] = deque()
        self.keep_next: list[int] | None = None  # the last block's keep, for the next send (or the final settle)
        self.last: tuple[Step, list[int]] | None = None  # the last verified step and its true keep
        self.verifying: Step | None = None  # the step handed to the loop

    @staticmethod
    def learner(spec: Speculation) -> Drafter | None:
        """The drafter that learns from verified steps: `spec.drafter`, when bets have a drafter of their
        own; else bets move the one drafter ahead and it learns nothing (None)."""
        return spec.drafter if spec.bet_drafter is not None else None

    def start(self, run: Run, first: StepResult) -> None:
        self.run, self.session, self.cap = run, run.session, run.session.max_step_tokens
        self.drafter.reset(run.context)
        if self.bet_drafter is not self.drafter:
            self.bet_drafter.reset(run.context)
        if self.learning:
            self.drafter.verified(TokenTree.root_only(run.context[-2]), [0], [run.context[-1]], first)

    def propose(self, drafter: Drafter, ctx: list[int], exclude_root: bool) -> TokenTree:
        """`drafter`'s tree on `ctx`, pruned to what the budget affords."""
        sync_drafter(drafter, ctx)
        tree = drafter.propose()
        choice = self.budget.choose(tree)
        nodes = choice.nodes if self.cap is None else min(choice.nodes, self.cap + exclude_root)
        return tree.pruned(nodes, choice.reach)

    def send(self, step: Step, keep: list[int] | None) -> None:
        """Send `step`'s block (its tree, less the root where the step before sent it), settling the
        block before it with `keep`."""
        tree, base = step.tree, len(step.ctx) - 1
        if step.root_sent:
            tokens, positions, mask, rows = build_step(tree, None, base)
        else:
            tokens, positions = tree.tokens[1:], [base + d for d in tree.depths()[1:]]
            mask, rows = tree.mask()[1:, 1:], list(range(len(tree) - 1))
        extras = self.drafter.extras if step.learns else 0
        step.flight = self.session.send(StepInput(tokens, positions, mask, rows, keep, self.run.argmax, extras))
        self.flight.append(step)

    def fill(self) -> None:
        """Send a step on the verified context when none that stands is in flight; bet on the step
        in flight when it is alone."""
        if all(s.void for s in self.flight) and not self.run.done():
            context = self.run.context
            step = Step(self.propose(self.drafter, context, False), list(context), True, learns=self.learning)
            self.send(step, self.keep_next)
            self.keep_next = None
        if len(self.flight) == 1 and not self.flight[0].void:
            self.bet(self.flight[0])

    def pays(self, p: float, nodes: int) -> bool:
        """Whether a bet that holds with chance `p` on a step of `nodes` tokens is expected to pay."""
        # a stale step delays only the retry sent on the miss: the cloud started it half a round
        # trip before the miss was seen and the retry arrives half a round trip after, so the
        # delay is its compute less a round trip (edge compute counted too: an upper bound)
        wasted = max(0.0, self.budget.predict_compute(nodes) - self.budget.rtt_s)
        return self.always_bet or p * self.budget.rtt_s > (1 - p) * wasted

    def bet(self, prev: Step) -> None:
        """Send the next step as a continuation of `prev`'s likeliest path, where that is expected to
        pay and the path ends before an end token or the length limit."""
        bet = choose_bet(prev, self.budget)
        if bet is None:
            return
        path, p = bet
        tokens = [prev.tree.tokens[i] for i in path[1:]]
        request = self.run.request
        done = len(prev.ctx) + len(tokens) - len(request.prompt_ids)  # generated if the bet holds
        if not self.pays(p, len(prev.tree)) or done + 1 >= request.max_new_tokens or self.run.eos.intersection(tokens):
            return
        ctx = prev.ctx + tokens
        nxt = Step(self.propose(self.bet_drafter, ctx, True), ctx, False)
        if len(nxt.tree) > 1:
            prev.bet = path
            self.send(nxt, prev.block_keep(path))
            self.stats.pipelined += 1

    def next(self, run: Run) -> Reply | None:
        """Send and bet as the flight allows, then take the reply of the oldest step that stands (None:
        nothing is left in flight)."""
        while True:
            self.fill()
            if not self.flight:
                return None
            step = self.flight.popleft()
            if not step.void:
                break
            self.session.discard(step.flight)  # rolled back, or it guessed nothing
            self.stats.discarded += 1
        self.verifying = step
        info = self.session.receive(step.flight)
        logits = info.out  # [N, V] (greedy: [N] tokens); without the root's row when it went with the step before
        if not step.root_sent:
            logits = torch.cat([step.root_logits[None], logits])
        return Reply(Plan(step.tree, None), step.ctx, logits, info, step.root_sent, step.learns)

    def learn(self, reply: Reply, path: list[int], new: list[int], ids: list[int] | None) -> None:
        """What the drafter (a step it drafted on the verified context), the budget and the stats learn
        from a verified step."""
        if reply.learns:  # the learning drafter's latest proposal, on the context it still holds
            self.shape.learn(reply.plan, path, new, ids, reply.result)
        info = reply.result
        self.budget.observe_compute(info.tokens, info.compute_s, info.edge_s)
        if not info.overlapped:
            self.budget.observe_network(info.network_s)
        self.budget.observe_acceptance(reply.plan.tree, path)
        self.stats.verified(len(reply.plan.tree), len(path) - 1)

    def settle(self, reply: Reply, path: list[int], new: list[int], keep: list[int], stop: bool) -> None:
        """The verified step keeps `keep` of its block: the step sent on its bet stands (the bet held) or
        is void (every cache rolls back to the accepted path); with no step on a bet, `keep` goes with the
        next send."""
        step = self.verifying
        self.last = (step, keep)
        nxt = self.flight[0] if self.flight else None
        if nxt is None or step.bet is None:
            self.keep_next = keep
        elif not stop and path == step.bet:  # verification goes on into the next step when its reply arrives
            nxt.root_logits, nxt.known = reply.out[path[-1]], new[-1]
            if nxt.tree.child(0, new[-1]) is None:  # it guessed nothing right: drop its block
                nxt.void, self.keep_next = True, []
        else:
            self.session.rewind(step.flight, keep)
            nxt.void = True
            self.stats.missed += not stop

    def extend(self, reply: Reply, fresh: list[int]) -> None:
        """Nothing: the drafters are brought to the context when they propose (`sync_drafter`)."""

    def finish(self) -> None:
        """Decoding is over: take the rolled-back steps' replies, settle the last block."""
        for s in self.flight:  # only rolled-back steps are left
            self.session.discard(s.flight)
            self.stats.discarded += 1
        if self.keep_next is not None:
            self.session.settle(self.keep_next)

    def abandon(self) -> None:
        """The caller stopped early: undo the bets, take the replies."""
        if any(not s.void for s in self.flight) and self.last is not None:
            self.session.rewind(self.last[0].flight, self.last[1])
        elif self.keep_next is not None:
            self.session.settle(self.keep_next)
        for s in self.flight:
            self.session.discard(s.flight)
