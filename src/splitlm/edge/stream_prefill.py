"""A session's prefill in chunks: whether to cut a causal run into chunks (`plan_for`), running it as
pipelined chunks (`stream`), or in chunks one after another where the cloud's limits demand it
(`chunked`). `splitlm.edge.prefill` holds the cost model and the planner; this module applies them
to one session, through its public methods (`PrefillSession`: what it needs of a
`splitlm.edge.session.EdgeSession`, which calls it from `forward`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

import torch

import splitlm.edge.prefill as prefill
from splitlm import SplitLMError
from splitlm.decoding.step import StepInput, StepResult
from splitlm.edge.backends import EdgeBackend
from splitlm.edge.link import CloudLink, Flight
from splitlm.edge.results import GenerationStats
from splitlm.transport.codecs import wire_nbytes


class PrefillSession(Protocol):
    """What a prefill in chunks needs of a session."""

    link: CloudLink  # its cloud side
    backend: EdgeBackend
    stats: GenerationStats
    prefill_chunk: int | str  # the edge's setting: auto, N tokens, or 0 (one forward)
    prefill_costs: prefill.PrefillCosts  # what each stage of a streamed prefill costs, as the edge measured
    last_prefill: prefill.PrefillRun | None
    interrupt: Callable[[], bool] | None  # asked between chunks: True stops the prefill (`Interrupted`)

    @property
    def length(self) -> int: ...

    def settle(self, keep: list[int] | None = None) -> None: ...

    def send_block(self, step: StepInput) -> Flight: ...

    def receive(self, f: Flight) -> StepResult: ...


class Interrupted(SplitLMError):
    """A prefill stopped between its chunks on its caller's word (`PrefillSession.interrupt`)."""


def check_interrupt(session: PrefillSession) -> None:
    if session.interrupt is not None and session.interrupt():
        raise Interrupted("the request was interrupted during its prefill")


def bytes_per_token(session: PrefillSession) -> tuple[float, float]:
    """Bytes per prompt token up (hidden states and a position) and down (tail-local: hidden states;
    split-head: none but for the last chunk's rows of logits)."""
    d = wire_nbytes(session.link.wire_dtype, [1, session.backend.cfg.hidden_size])
    return d + 3.0, (float(d) if session.backend.hidden_down else 0.0)


def plan_for(session: PrefillSession, total: int, max_chunk: int) -> prefill.Plan | None:
    """The edge's plan for a causal run of `total` tokens: None = one forward."""
    setting = session.prefill_chunk
    if setting == 0:
        return None
    if setting != "auto":
        chunk = min(int(setting), max_chunk)
        return None if chunk >= total else prefill.Plan(chunk, None, None)
    p = prefill.plan(
        total,
        max_chunk,
        session.prefill_costs.stages(*bytes_per_token(session)),
        session.length,
        session.link.client.info.limits.pass_rows,
    )
    if p.chunk >= total or p.predicted_s > (1 - prefill.MIN_GAIN) * p.unchunked_s:
        return None  # within the fits' error of one forward, which needs no overlap to go right
    return p


@torch.inference_mode()
def stream(session: PrefillSession, ids: list[int], want: list[int], p: prefill.Plan, argmax: bool) -> StepResult:
    """Run `ids` (causal, after the session's committed tokens) as pipelined chunks of `p.chunk`;
    returns the logits (or greedy tokens, with `argmax`) of the rows `want`, as one forward would
    (the step's costs are the last chunk's, its network time the link's round trip)."""
    client, s = session.link.client, session.stats
    run = prefill.PrefillRun(len(ids), p.chunk, p.predicted_s, p.unchunked_s)
    start = time.perf_counter()
    flights, steps = [], []

    def take() -> None:
        f, sent_at, up = flights.pop(0)
        edge0, cloud0, down0, ser0 = s.edge_compute_s, s.cloud_compute_s, s.bytes_down, s.serialize_s
        steps.append(session.receive(f))
        cloud_s = s.cloud_compute_s - cloud0
        tail_s = s.edge_compute_s - edge0 - f.edge_s + (s.serialize_s - ser0 - f.serialize_s)
        run.chunks.append(
            prefill.ChunkRecord(
                len(f.ids),
                f.edge_s + f.serialize_s,
                tail_s,
                cloud_s,
                up,
                s.bytes_down - down0,
                sent_at,
                time.perf_counter() - start,
            )
        )

    for a in range(0, len(ids), p.chunk):
        part = [r - a for r in want if a <= r < a + p.chunk]
        session.settle()  # the chunk before stays whole: this request commits it
        check_interrupt(session)  # the caller (abandoning the session) takes the replies in flight
        up0 = s.bytes_up
        f = session.send_block(StepInput(ids[a : a + p.chunk], rows=part, argmax=argmax))
        flights.append((f, time.perf_counter() - start, s.bytes_up - up0))
        while flights and client.reply_waiting():  # tails of what already came back
            take()
    while flights:
        take()
    run.seconds = time.perf_counter() - start
    s.prefill_round_trips = len(run.chunks)
    session.last_prefill = run
    # a pipelined chunk's wait says nothing about the link: the next step's budget gets the RTT estimate
    return replace(steps[-1], out=torch.cat([step.out for step in steps]), network_s=session.prefill_costs.link.rtt_s)


def chunked(session: PrefillSession, ids: list[int], want: list[int], limit: int, argmax: bool) -> StepResult:
    """Run `ids` (causal, after the session's committed tokens) in forwards of `limit` tokens, one after
    another; the rows `want` of them all (the step's costs are the last chunk's)."""
    steps = []
    for a in range(0, len(ids), limit):
        check_interrupt(session)
        part = [r - a for r in want if a <= r < a + limit]
        steps.append(session.receive(session.send_block(StepInput(ids[a : a + limit], rows=part, argmax=argmax))))
        session.settle()
    session.stats.prefill_round_trips = -(-len(ids) // limit)
    return replace(steps[-1], out=torch.cat([step.out for step in steps]))
