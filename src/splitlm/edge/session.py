"""An edge session: one cloud session plus the edge's own head and tail caches.

It runs the head layers, sends hidden states, runs the tail and LM head on what comes back (both
through the edge's back end, `splitlm.edge.backends`), one request or two in flight. Its cloud side
(`splitlm.edge.link.CloudLink`) keeps track of what the cloud holds (committed entries, piggy-backed
keep and crop, context rows re-sent under cache policies that keep nothing); when it reports the cloud
lost, the session replays what the cloud held to another cloud (`splitlm.edge.replay`). Its head and
tail layers, their caches and the blocks between them are an `EdgeLayers`; a long prompt may go up
in pipelined chunks (planned and recorded by `splitlm.edge.stream_prefill`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import splitlm.edge.replay as replay
import splitlm.edge.stream_prefill as stream_prefill
from splitlm import SplitLMError
from splitlm.decoding.step import StepInput, StepResult
from splitlm.edge.backends import EdgeBackend, TailOut
from splitlm.edge.link import CloudLink, Flight, Reply
from splitlm.edge.prefill import Plan, PrefillCosts, PrefillRun
from splitlm.edge.results import GenerationStats
from splitlm.edge.session_setup import SessionSetup
from splitlm.transport.client import CloudError, lost
from splitlm.transport.messages import Result
from splitlm.transport.policy import CachePolicy

SPEC_HEADROOM = 128  # cache entries a verification pass may add beyond the committed tokens (tree + window)


class EdgeSession:
    """One cloud session (`link`: a connection of its own for the session's lifetime, taken from the
    edge's pool, so sessions in different threads never share one) together with the edge's own layers
    and KV caches for its head and tail (`layers`)."""

    def __init__(self, setup: SessionSetup, cache_policy: str | CachePolicy | None = None):
        try:
            policy = CachePolicy.parse(cache_policy) if cache_policy else setup.cache_policy
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        self.backend = setup.backend
        self.prefill_chunk, self.prefill_costs = setup.prefill_chunk, setup.prefill_costs
        self.link = CloudLink(setup.connections, setup.backend, policy, setup.wire_dtype, setup.split, setup.observer)
        self.layers = EdgeLayers(setup.backend)
        self.last_prefill: PrefillRun | None = None  # the last streamed prefill
        self.interrupt: Callable[[], bool] | None = None  # asked between a prefill's chunks: True stops it

    @property
    def policy(self) -> CachePolicy:
        return self.link.policy

    @property
    def stats(self) -> GenerationStats:
        """The costs of the current request (each request of `Edge.generate_ids` sets a new one)."""
        return self.link.stats

    @stats.setter
    def stats(self, stats: GenerationStats) -> None:
        self.link.stats = stats

    @property
    def length(self) -> int:
        return self.layers.length

    @property
    def max_step_tokens(self) -> int | None:
        """The most new tokens one step may carry (a window policy caps it at N; in split-head the
        frame limit caps the rows of logits a RESULT may hold)."""
        caps = [c for c in (self.policy.window, self.backend.max_logit_rows) if c is not None]
        return min(caps) if caps else None

    @property
    def pipelines(self) -> bool:
        """Whether several forwards may be in flight: the cloud must hold the whole context (a
        `session` or `sealed` policy), so that a rolled-back step is undone with a crop."""
        return self.policy.retention > 0 and self.policy.window is None

    def settle(self, keep: list[int] | None = None) -> None:
        """Resolve the last forward's tokens: keep only `keep` (all if None) in every cache. The tail
        cache applies it once it has run the block (a pipelined block's reply may still be in flight)."""
        settled = self.layers.settle(keep)
        if settled is not None:
            self.link.commit(settled.h, settled.positions, settled.keep)

    def _idle(self) -> None:
        """Require no step in flight, and settle the last one everywhere."""
        if self.link.flights:
            raise SplitLMError("a forward is still in flight on this session")
        self.settle()
        self.layers.settle_tail()

    def crop(self, n: int) -> None:
        """Truncate the conversation to its first n committed tokens (edge and cloud)."""
        self._idle()
        length = self.length
        self.layers.crop(n)
        self.link.crop(n, length)

    def abandon(self, n: int) -> None:
        """Stop where the session stands and go back to its first n committed tokens: the replies of
        the steps still in flight are taken and dropped, then edge and cloud are cropped to n (an
        interrupted conversation turn: the next one sees the session as if it never happened)."""
        self.link.void_flights()
        while self.link.flights:
            self._finish(self.link.flights[0])
        if self.link.client.in_flight:  # interrupted between sending a request and recording it: out of step
            self.failover(lost("a request was interrupted half-way"))
        self.crop(n)

    def revoke(self) -> None:
        """Wipe the cloud's cache of this session now; later requests re-send the history they need."""
        self._idle()
        self._twice(self.link.revoke)

    def tighten(self, cache_policy: str | CachePolicy) -> None:
        """Switch to a tighter cache policy for the rest of the session (the cloud refuses a looser one).

        `none` and `sealed` take effect on the cloud now; `window:N` with the next request's
        control tuple (after that request's keep, so the pending block stays intact)."""
        self._twice(lambda: self.link.tighten(cache_policy))

    @torch.inference_mode()
    def forward(self, step: StepInput) -> StepResult:
        """Run T new tokens through edge head -> cloud -> edge tail; the step's `out` holds logits
        [len(rows) or T, V] (with `argmax`: each row's greedy token, [len(rows) or T], through the
        screened LM head). With `extras` = k > 0 it also holds each row's k likeliest ids (`topk`,
        [R, k]) and final-normed hidden state (`hidden`, [R, D]; None in the split-head topology):
        what edge-side drafters learn from. They stay on the edge. `allowed` [R, V] bool: with `argmax`,
        each row's greedy token among its allowed ones (a grammar's mask, `splitlm.decoding.grammar`).

        `keep` first retains only those entries of the previous call's new tokens, in both the
        edge's caches and (piggy-backed on this request) the cloud's. A causal run longer than a
        window policy allows is sent in chunks.
        """
        if self.link.flights:
            raise SplitLMError("a forward is still in flight on this session")
        self.settle(step.keep)
        ids, positions, mask = step.ids, step.positions, step.mask
        want = list(range(len(ids))) if step.rows is None else step.rows
        limit = self.link.step_limit(len(ids), len(want), self.length)
        if mask is None and positions is None and self.pipelines and not self.link.context_rows(self.length):
            p = stream_prefill.plan_for(
                self.prefill_chunk, self.prefill_costs, self.link, len(ids), limit or len(ids), self.length
            )
            if p is not None:
                return self._stream(ids, want, p, step.argmax)
        if limit is not None and mask is None:
            if positions is not None:
                raise SplitLMError("a chunked forward takes default positions")
            return self._chunked(ids, want, limit, step.argmax)
        if limit is not None:
            raise self.link.too_long(len(ids), len(want))
        return self._finish(self.send_block(step))

    def _stream(self, ids: list[int], want: list[int], p: Plan, argmax: bool) -> StepResult:
        """Run `ids` (causal, after the committed tokens) as pipelined chunks of `p.chunk`; the logits (or
        greedy tokens, with `argmax`) of the rows `want`, as one forward's (the costs the last chunk's)."""
        recorder = stream_prefill.StreamRecorder(len(ids), p, self.stats)
        for chunk in stream_prefill.chunks(ids, want, p.chunk):
            self.settle()  # the chunk before stays whole: this request commits it
            # the caller (abandoning the session) takes the replies in flight
            stream_prefill.check_interrupt(self.interrupt)
            recorder.sent(recorder.mark(), self.send_block(chunk.step(argmax)))  # arguments: left to right
            while recorder.oldest is not None and self.link.client.reply_waiting():  # tails of what came back
                recorder.taken(recorder.mark(), self.receive(recorder.oldest))
        while recorder.oldest is not None:
            recorder.taken(recorder.mark(), self.receive(recorder.oldest))
        step = recorder.finish(self.prefill_costs.link.rtt_s)  # the next step's budget gets the RTT estimate
        self.stats.prefill_round_trips = len(recorder.run.chunks)
        self.last_prefill = recorder.run
        return step

    def _chunked(self, ids: list[int], want: list[int], limit: int, argmax: bool) -> StepResult:
        """Run `ids` (causal, after the committed tokens) in forwards of `limit` tokens, one after another;
        the rows `want` of them all (the costs the last chunk's)."""
        steps = []
        for chunk in stream_prefill.chunks(ids, want, limit):
            stream_prefill.check_interrupt(self.interrupt)
            steps.append(self.receive(self.send_block(chunk.step(argmax))))
            self.settle()
        self.stats.prefill_round_trips = len(steps)
        return stream_prefill.joined(steps)

    # -- pipelined steps: up to two forwards in flight ------------------------------------------
    @torch.inference_mode()
    def send(self, step: StepInput) -> Flight:
        """Settle the last block with `step.keep` and send `step` without waiting for its reply (take it
        with `receive`, oldest first; as `forward`'s). Its tokens see the context once `keep` applies."""
        if len(self.link.flights) >= 2:
            raise SplitLMError("at most two forwards may be in flight")
        if self.link.flights and not self.pipelines:
            raise SplitLMError(f"cache policy {self.policy} does not allow pipelined steps")
        self.settle(step.keep)
        return self.send_block(step)

    @torch.inference_mode()
    def receive(self, f: Flight) -> StepResult:
        """Step `f`'s result (the oldest in flight): its logits, or greedy tokens if sent with `argmax`."""
        step = self._finish(f)
        if step is None:
            raise SplitLMError("a rolled-back step's reply is taken with discard")
        return step

    def discard(self, f: Flight) -> None:
        """Take the reply of a rolled-back step `f` (the oldest in flight) and drop it."""
        f.roll_back()
        self._finish(f)

    @torch.inference_mode()
    def rewind(self, f: Flight, keep: list[int]) -> None:
        """Step `f` (received) was settled with a guess; really keep `keep` of its block, and drop
        every step sent after it (their replies must still be taken with `discard`).

        Entries of `keep` that the guess dropped are recomputed by the head and re-sent to the cloud
        as context rows with the next request; the tail ran the whole block and keeps them."""
        redo = self.layers.rewind(f, keep)
        self.stats.edge_compute_s += redo.seconds
        self.link.rewind(redo.n, redo.h, redo.positions)  # the re-computed entries go up with the next request

    def send_block(self, step: StepInput) -> Flight:
        """Run the head on a block of new tokens and send it now (no checks, nothing settled: `step.keep`
        is not applied; failing over if the cloud is gone); its reply is taken with `receive` or
        `discard`, oldest first."""
        c = self.link.context_rows(self.length)
        f = self.layers.head(step, overlapped=bool(self.link.flights))
        try:
            self.link.send(f, c)
        except CloudError as e:
            self._recover(e)  # the replay re-sends `f`
        return f

    def failover(self, error: CloudError) -> None:
        """Reconnect, open a new cloud session and replay into it every request still owed a reply
        (`splitlm.edge.replay.failover`); the one call after a retryable `CloudError` of the session's client."""
        replay.failover(self.link, error)

    def _recover(self, error: CloudError) -> None:
        """The cloud side raised `error`: fail over if it is recoverable, else raise it."""
        if not error.recoverable:
            raise error
        self.failover(error)

    def _twice(self, request: Callable[[], None]) -> None:
        """Run a POLICY `request`, and once more after a failover if the cloud is gone."""
        try:
            request()
        except CloudError as e:
            self._recover(e)
            request()

    def _take(self, f: Flight) -> Reply:
        """Step `f`'s reply (the oldest in flight), failing over (which re-sends `f` and the blocks after
        it) while the cloud is gone."""
        while True:
            try:
                return self.link.take(f)
            except CloudError as e:
                self._recover(e)

    def _finish(self, f: Flight) -> StepResult | None:
        """Take step `f`'s reply (the oldest in flight), run the tail on it and count its costs; None
        for a rolled-back (void) step, whose reply is dropped."""
        reply = self._take(f)
        t2 = time.perf_counter()
        self.stats.failover_stall_s += f.stall_s(t2)
        if reply.result is not None and f is self.layers.pending and self.policy.retention > 0:
            self.link.cloud.counted(reply.result.cache_len)
        tail = None if f.void else self.layers.tail(f, reply.result)
        tail_s = time.perf_counter() - t2
        self.stats.edge_compute_s += f.edge_s + tail_s
        alone = not f.overlapped and not self.link.flights  # nothing else was on the link: its wait is the network's
        observe(self.prefill_costs, f, reply, tail_s, alone)
        return None if tail is None else step_result(f, reply, tail, tail_s)

    def close(self) -> None:
        """End the cloud session; its connection goes back to the pool (or is dropped if it failed)."""
        self.link.close()


def observe(costs: PrefillCosts, f: Flight, reply: Reply, tail_s: float, alone: bool) -> None:
    """What step `f` cost (its reply `reply`, the tail `tail_s` seconds), for the streamed prefill's
    cost model; its network time only if it was `alone` on the link."""
    costs.observe(
        len(f.ids),
        f.start,
        f.edge_s + f.serialize_s,
        tail_s + reply.serialize_s,
        reply.compute_s,
        f.bytes_up + reply.bytes_down,
        reply.network_s if alone else None,
    )


def step_result(f: Flight, reply: Reply, tail: TailOut, tail_s: float) -> StepResult:
    """Step `f`'s result: the tail's output of its reply, and what it cost (the tail `tail_s` seconds)."""
    return StepResult(
        tail.out,
        len(f.ids),
        reply.network_s,
        f.edge_s + tail_s + reply.compute_s,
        f.overlapped,
        tail.topk,
        tail.hidden,
        edge_s=f.edge_s + tail_s,
        features=tail.features,
    )


@dataclass
class Settled:
    """A settled block's kept entries, to commit on the cloud side."""

    h: torch.Tensor  # [K, D] their head outputs
    positions: list[int]
    keep: list[int] | None  # None: the whole block


@dataclass
class Redo:
    """A rewind: back to the first `n` committed entries, then the entries the guess dropped, recomputed
    by the head (`h` [R, D] at `positions`; None when there are none), to go up as context rows."""

    n: int
    h: torch.Tensor | None
    positions: list[int]
    seconds: float  # the head's compute


class EdgeLayers:
    """The head and tail layers of one session (through the edge's back end) and their caches."""

    def __init__(self, backend: EdgeBackend):
        self.backend = backend
        self.head_cache, self.tail_cache = backend.new_caches()
        self.pending: Flight | None = None  # the last forward's block, not yet settled
        self.tail_block: Flight | None = None  # the last block run through the tail whose keep is not applied there

    @property
    def length(self) -> int:
        return self.head_cache.length

    def head(self, step: StepInput, overlapped: bool) -> Flight:
        """Run the head on a block of new tokens (after the committed ones); it becomes the pending block."""
        positions = step.positions
        if positions is None:
            positions = list(range(self.length, self.length + len(step.ids)))
        n = self.length
        t0 = time.perf_counter()
        h = self.backend.head(step.ids, positions, step.mask, self.head_cache)  # [T, D]
        self.pending = Flight(
            list(step.ids),
            h,
            list(positions),
            step.mask,
            step.rows,
            n,
            step.argmax,
            step.extras,
            allowed=step.allowed,
            feature_rows=step.feature_rows,
            edge_s=time.perf_counter() - t0,
            overlapped=overlapped,
        )
        return self.pending

    def tail(self, f: Flight, result: Result) -> TailOut:
        """Run the tail and LM head on block `f`'s reply; its keep applies at the next tail pass (a
        guessed keep may still be rewound)."""
        if self.tail_block is not None:  # the block before this one, settled since
            self.settle_tail()
        out = self.backend.finish(result, f, self.tail_cache)
        self.tail_block = f
        return out

    def settle(self, keep: list[int] | None) -> Settled | None:
        """Resolve the pending block: keep only `keep` (all if None) in the head cache now, in the tail
        cache once it has run the block (a pipelined block's reply may still be in flight); None when
        nothing is pending."""
        f = self.pending
        if f is None:
            return None
        self.pending = None
        f.settle(keep)
        h, pos = f.h, f.positions
        if keep is not None:
            self.head_cache.keep(keep)
            h, pos = h[keep], [pos[i] for i in keep]
        if self.tail_block is f:
            self.settle_tail()
        return Settled(h, pos, keep)

    def settle_tail(self) -> None:
        """Apply the keep of the last block the tail ran, if it has one."""
        f, self.tail_block = self.tail_block, None
        if f is not None and f.keep is not None:
            self.tail_cache.keep(f.keep)

    def crop(self, n: int) -> None:
        """Truncate both caches to their first n committed entries."""
        if not 0 <= n <= self.length:
            raise SplitLMError(f"cannot crop to {n} tokens: the session holds {self.length}")
        self.head_cache.crop(n)
        self.tail_cache.crop(n)

    def rewind(self, f: Flight, keep: list[int]) -> Redo:
        """Block `f` (received) was settled with a guess; really keep `keep` of it. The head cache goes
        back to where guess and `keep` part, and the entries of `keep` past it are recomputed by the
        head; the tail ran the whole block and keeps them."""
        if self.tail_block is not f or not f.settled or self.pending is f:
            raise SplitLMError("rewind needs the received, settled step before the in-flight ones")
        guess = list(range(len(f.ids))) if f.keep is None else f.keep
        common = 0
        while common < min(len(guess), len(keep)) and guess[common] == keep[common]:
            common += 1
        f.settle(keep)
        self.settle_tail()
        self.pending = None
        n = f.start + common
        self.head_cache.crop(n)
        redo = keep[common:]
        pos = [f.positions[i] for i in redo]
        if not redo:
            return Redo(n, None, pos, 0.0)
        t0 = time.perf_counter()
        h = self.backend.head([f.ids[i] for i in redo], pos, None, self.head_cache)  # [R, D]
        return Redo(n, h, pos, time.perf_counter() - t0)
