"""A session's prefill in chunks: whether to cut a causal run into chunks (`plan_for`), the chunks
(`chunks`), and what a streamed prefill's chunks cost (`StreamRecorder`, which makes the
`PrefillRun`). `splitlm.edge.prefill` holds the cost model and the planner;
`splitlm.edge.session.EdgeSession.forward` runs the chunks, as pipelined forwards (a streamed
prefill) or one after another where the cloud's limits demand it, and records them here."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

import splitlm.edge.prefill as prefill
from splitlm import SplitLMError
from splitlm.decoding.step import StepInput, StepResult
from splitlm.edge.link import CloudLink, Flight
from splitlm.edge.results import GenerationStats
from splitlm.transport.codecs import wire_nbytes


class Interrupted(SplitLMError):
    """A prefill stopped between its chunks on its caller's word (`EdgeSession.interrupt`)."""


def check_interrupt(interrupt: Callable[[], bool] | None) -> None:
    """Raise `Interrupted` if the caller's `interrupt` (asked between chunks) says to stop."""
    if interrupt is not None and interrupt():
        raise Interrupted("the request was interrupted during its prefill")


def bytes_per_token(link: CloudLink) -> tuple[float, float]:
    """Bytes per prompt token up (hidden states and a position) and down (tail-local: hidden states;
    split-head: none but for the last chunk's rows of logits)."""
    d = wire_nbytes(link.wire_dtype, [1, link.backend.cfg.hidden_size])
    return d + 3.0, (float(d) if link.backend.hidden_down else 0.0)


def plan_for(
    setting: int | str, costs: prefill.PrefillCosts, link: CloudLink, total: int, max_chunk: int, past: int
) -> prefill.Plan | None:
    """The edge's plan (`setting`: auto, N tokens, or 0 = one forward; `costs`: what each stage of a
    streamed prefill costs, as the edge measured) for a causal run of `total` tokens after `past`
    committed ones on `link`: None = one forward."""
    if setting == 0:
        return None
    if setting != "auto":
        chunk = min(int(setting), max_chunk)
        return None if chunk >= total else prefill.Plan(chunk, None, None)
    p = prefill.plan(total, max_chunk, costs.stages(*bytes_per_token(link)), past, link.client.info.limits.pass_rows)
    if p.chunk >= total or p.predicted_s > (1 - prefill.MIN_GAIN) * p.unchunked_s:
        return None  # within the fits' error of one forward, which needs no overlap to go right
    return p


@dataclass
class Chunk:
    """One chunk of a causal run, to go up as a forward of its own."""

    ids: list[int]
    rows: list[int]  # the rows of the run asked for that fall in the chunk, counted from its first token

    def step(self, argmax: bool) -> StepInput:
        return StepInput(self.ids, rows=self.rows, argmax=argmax)


def chunks(ids: list[int], want: list[int], size: int) -> list[Chunk]:
    """`ids` in chunks of `size` tokens, each with its share of the rows `want`."""
    return [Chunk(ids[a : a + size], [r - a for r in want if a <= r < a + size]) for a in range(0, len(ids), size)]


def joined(steps: list[StepResult]) -> StepResult:
    """The chunks' steps as one forward's: their outputs in a row, the costs the last chunk's."""
    return replace(steps[-1], out=torch.cat([step.out for step in steps]))


@dataclass
class Mark:
    """The session's counters at one moment (what a chunk cost is the difference of two)."""

    edge_s: float
    cloud_s: float
    serialize_s: float
    bytes_up: int
    bytes_down: int


@dataclass
class SentChunk:
    f: Flight
    sent_at: float  # seconds into the prefill
    bytes_up: int


class StreamRecorder:
    """What each chunk of a streamed prefill cost (`PrefillRun`), read off the session's stats around
    each send and each reply taken, and the chunks' steps. Its caller sends and takes:
    `recorder.sent(recorder.mark(), send(...))`, `recorder.taken(recorder.mark(), receive(recorder.oldest))`
    (the mark, the first argument, is taken first)."""

    def __init__(self, total: int, p: prefill.Plan, stats: GenerationStats):
        self.run = prefill.PrefillRun(total, p.chunk, p.predicted_s, p.unchunked_s)
        self.stats = stats
        self.start = time.perf_counter()
        self.in_flight: deque[SentChunk] = deque()  # oldest first
        self.steps: list[StepResult] = []

    def mark(self) -> Mark:
        s = self.stats
        return Mark(s.edge_compute_s, s.cloud_compute_s, s.serialize_s, s.bytes_up, s.bytes_down)

    @property
    def oldest(self) -> Flight | None:
        """The oldest chunk whose reply is not yet taken (None: none)."""
        return self.in_flight[0].f if self.in_flight else None

    def sent(self, before: Mark, f: Flight) -> None:
        """Chunk `f` went up (`before`: the mark just before it was sent)."""
        self.in_flight.append(SentChunk(f, time.perf_counter() - self.start, self.stats.bytes_up - before.bytes_up))

    def taken(self, before: Mark, step: StepResult) -> None:
        """The oldest chunk's reply was taken, as `step` (`before`: the mark just before it was taken)."""
        c, now = self.in_flight.popleft(), self.mark()
        f = c.f
        self.steps.append(step)
        tail_s = now.edge_s - before.edge_s - f.edge_s + (now.serialize_s - before.serialize_s - f.serialize_s)
        self.run.chunks.append(
            prefill.ChunkRecord(
                len(f.ids),
                f.edge_s + f.serialize_s,
                tail_s,
                now.cloud_s - before.cloud_s,
                c.bytes_up,
                now.bytes_down - before.bytes_down,
                c.sent_at,
                time.perf_counter() - self.start,
            )
        )

    def finish(self, rtt_s: float) -> StepResult:
        """The prefill is done: its run's seconds, and the chunks' steps as one forward's (its network time
        `rtt_s`: a pipelined chunk's wait says nothing about the link)."""
        self.run.seconds = time.perf_counter() - self.start
        return replace(joined(self.steps), network_s=rtt_s)
