"""The decoding loop: one generator decodes every request, step by step, through a session.

    prefill ─► emit ─► ┌ plan ─► send ─► accept ─► learn ─► stop/close ─► settle ─► emit ┐ ─► finish
                       └────────────────────────────── until done ───────────────────────┘

What differs between requests is in the parts it is given (`DecodeParts`, built from the request by
`DecodeParts.of`): the *shape* plans each step's tree and its masks (`PlainShape`, `GrammarShape`,
`SequentialShape`), the *acceptance* verifies it (`Acceptance`: greedy or exact speculative sampling)
and the *flow* sends it (`DirectFlow`: one step at a time; `PipelinedFlow`: the next step sent on a
bet while this one is in flight). docs/step.md draws it."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass

from splitlm.decoding.grammar_decode import GrammarShape, close_at
from splitlm.decoding.pipeline import PipelinedFlow
from splitlm.decoding.request import DecodeRequest, GrammarStats, Reply, Run, Speculation
from splitlm.decoding.shapes import Acceptance, PlainShape, SequentialShape
from splitlm.decoding.speculative import stop_at
from splitlm.decoding.step import StepResult, StepSession

Shape = PlainShape | GrammarShape | SequentialShape


class DirectFlow:
    """Each step is sent once the one before is verified. With a budget, the step's timing and
    acceptance are what it learns from (`observe_step`, with the edge's own overhead) and `stats`
    counts the step; sequential steps learn nothing."""

    def __init__(self, spec: Speculation, shape: Shape):
        self.shape, self.budget, self.stats = shape, spec.budget, spec.stats

    def start(self, run: Run, first: StepResult | None) -> None:
        self.session = run.session
        if first is not None:
            self.shape.start(run.context, first)

    def next(self, run: Run) -> Reply:
        started = time.perf_counter()
        plan = self.shape.plan(run)
        if plan.step is None:
            return Reply(plan, run.context, None, None)
        sent = time.perf_counter()
        result = run.session.forward(plan.step)
        returned = time.perf_counter()
        return Reply(plan, run.context, result.out, result, started=started, sent=sent, returned=returned)

    def learn(self, reply: Reply, path: list[int], new: list[int], ids: list[int] | None) -> None:
        plan, result = reply.plan, reply.result
        self.shape.learn(plan, path, new, ids, result)
        if self.budget is None:
            return
        self.budget.observe_acceptance(plan.tree, path)
        overhead = (reply.sent - reply.started) + (time.perf_counter() - reply.returned)
        self.budget.observe_step(len(plan.step.ids), result.compute_s, result.network_s, overhead, result.edge_s)
        self.stats.verified(len(plan.tree), len(path) - 1)
        self.stats.window_tokens += 0 if plan.window is None else len(plan.window.tokens())
        self.stats.expected_tokens += plan.expected
        self.stats.choices.append(len(plan.tree))

    def settle(self, reply: Reply, path: list[int], new: list[int], keep: list[int], stop: bool) -> None:
        if reply.plan.settles:  # the cache keeps the context up to, not including, the last token
            self.session.settle(keep)

    def extend(self, reply: Reply, fresh: list[int]) -> None:
        self.shape.extend(reply.plan, fresh)

    def finish(self) -> None:
        """Nothing is left in flight."""

    def abandon(self) -> None:
        """Nothing is left in flight."""


Flow = DirectFlow | PipelinedFlow


@dataclass
class DecodeParts:
    shape: Shape
    acceptance: Acceptance
    flow: Flow

    @staticmethod
    def of(request: DecodeRequest, run: Run) -> DecodeParts:
        """The parts `request` asks for: a grammar's shape or the plain one (the root alone without a
        drafter), greedy or sampled acceptance, a pipelined flow or a direct one."""
        spec = request.speculation
        if spec.drafter is None:
            shape = SequentialShape(request.grammar_stats or GrammarStats())
        elif request.grammar is not None:
            gstats = request.grammar_stats or GrammarStats()
            shape = GrammarShape(spec.drafter, spec.budget, request.grammar, gstats)
        elif spec.pipeline:
            shape = PlainShape(PipelinedFlow.learner(spec), spec.budget, spec.stats)
        else:
            shape = PlainShape(spec.drafter, spec.budget, spec.stats)
        flow = PipelinedFlow(spec, shape) if spec.pipeline and spec.drafter is not None else DirectFlow(spec, shape)
        return DecodeParts(shape, Acceptance(run.sampler), flow)


def decode(session: StepSession, request: DecodeRequest, parts: DecodeParts | None = None) -> Iterator[list[int]]:
    """Yield the new tokens of each step (the first chunk comes from the prefill) of `request`.

    After every step the session is told which of its entries to keep (`settle`; the cloud hears it
    piggy-backed on the next request), so at any point it holds the context except its last token.
    Greedy output is token-identical to sequential decoding, and seeded sampling to sequential sampling
    with that seed, whatever the parts drafted; with a grammar every token is one it allows."""
    run = Run(session, request)
    parts = parts or DecodeParts.of(request, run)
    shape, flow, logprobs = parts.shape, parts.flow, request.logprobs
    first, ended = yield from prefill(run, shape)
    if ended:
        return
    flow.start(run, first)
    try:
        while not run.done():
            reply = flow.next(run)  # plan and send as the flow allows; the oldest standing step's reply
            if reply is None:
                break
            if reply.plan.free is not None:  # the request ends inside the grammar's forced chain
                yield run.emit(reply.plan.free)
                return
            path, new, ids = parts.acceptance.accept(reply)
            flow.learn(reply, path, new, ids)
            fresh, keep, stop, closing = rules(run, reply, path, new)
            flow.settle(reply, path, new, reply.block_keep(keep), stop)
            if logprobs is not None:  # fresh[i] is new[skip + i], chosen at node path[skip + i]
                skip = len(run.context) - len(reply.ctx)
                logprobs.record(fresh, reply.out[path[skip : skip + len(fresh)]])
            shape.emitted(reply.plan, path, fresh)
            if closing is not None:  # no room to complete the output after `fresh`: complete it now
                yield run.emit(fresh + closing)
                return
            flow.extend(reply, fresh)
            if fresh:
                yield run.emit(fresh)
            if stop:
                break
        flow.finish()
    except GeneratorExit:  # the caller stopped early
        flow.abandon()
        raise


def closes(run: Run, tokens: list[int]) -> tuple[int, list[int]] | None:
    """With a grammar and no logprobs: where the output must close inside `tokens` (`close_at`)."""
    if run.state is None or run.request.logprobs is not None:
        return None
    return close_at(run.state, tokens, run.produced, run.request.max_new_tokens)


def prefill(run: Run, shape: Shape) -> Generator[list[int], None, tuple[StepResult | None, bool]]:
    """Emit the prefill's tokens (none where the first step carries the prompt); returns the prefill's
    step (for the drafter) and whether the request ended there."""
    opening = shape.prefill(run)
    if opening is None:
        return None, False
    tokens, first = opening
    if (cut := closes(run, tokens)) is not None:
        yield run.emit(tokens[: cut[0]] + cut[1])  # no room to complete the output after the prefill
        return first, True
    yield run.emit(tokens)
    return first, False


def rules(
    run: Run, reply: Reply, path: list[int], new: list[int]
) -> tuple[list[int], list[int], bool, list[int] | None]:
    """The stop and close rules of a verified step: the tokens it adds to the context (a pipelined step's
    first tokens may be known already), cut at an end token or the length limit; the accepted path's
    nodes the caches keep; whether decoding stops; and, with a grammar near the limit, the closing
    emitted instead of the rest."""
    limit = run.request.max_new_tokens
    skip = len(run.context) - len(reply.ctx)
    fresh, keep = new[skip:], path
    n = stop_at(fresh, run.produced, limit, run.eos)
    if n is not None:
        fresh, keep = fresh[:n], path[: skip + n]  # the cache keeps the context up to, not including, the last token
    closing = None
    if (cut := closes(run, fresh)) is not None:
        fresh, keep, closing = fresh[: cut[0]], path[: max(cut[0], 1)], cut[1]
    return fresh, keep, n is not None, closing
