"""A session's streamed prefill: whether to cut a causal run into chunks (`plan_for`), and running
it as pipelined chunks (`stream`). `splitlm.edge.prefill` holds the cost model and the planner;
this module applies them to one session (`session`: the `EdgeSession` the run belongs to; not imported
here, since session.py imports this module)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

import splitlm.edge.prefill as prefill
from splitlm.decoding.step import StepResult
from splitlm.transport.codecs import wire_nbytes


def bytes_per_token(session) -> tuple[float, float]:
    """Bytes per prompt token up (hidden states and a position) and down (tail-local: hidden states;
    split-head: none but for the last chunk's rows of logits)."""
    edge = session.edge
    d = wire_nbytes(session.wire_dtype, [1, edge.cfg.hidden_size])
    return d + 3.0, (0.0 if edge.split_head else float(d))


def plan_for(session, total: int, max_chunk: int) -> prefill.Plan | None:
    """The edge's plan for a causal run of `total` tokens: None = one forward."""
    edge = session.edge
    setting = edge.prefill_chunk
    if setting == 0:
        return None
    if setting != "auto":
        chunk = min(int(setting), max_chunk)
        return None if chunk >= total else prefill.Plan(chunk, None, None)
    p = prefill.plan(total, max_chunk, edge.prefill_costs.stages(*bytes_per_token(session)), session.length,
                     session.client.info.limits.pass_rows)
    if p.chunk >= total or p.predicted_s > (1 - prefill.MIN_GAIN) * p.unchunked_s:
        return None  # within the fits' error of one forward, which needs no overlap to go right
    return p


@torch.inference_mode()
def stream(session, ids: list[int], want: list[int], p: prefill.Plan, argmax: bool) -> StepResult:
    """Run `ids` (causal, after the session's committed tokens) as pipelined chunks of `p.chunk`;
    returns the logits (or greedy tokens, with `argmax`) of the rows `want`, as one forward would
    (the step's costs are the last chunk's, its network time the link's round trip)."""
    client, s = session.client, session.stats
    run = prefill.PrefillRun(len(ids), p.chunk, p.predicted_s, p.unchunked_s)
    start = time.perf_counter()
    flights, steps = [], []

    def take() -> None:
        f, sent_at, up = flights.pop(0)
        edge0, cloud0, down0, ser0 = s.edge_compute_s, s.cloud_compute_s, s.bytes_down, s.serialize_s
        steps.append(session._finish(f))
        cloud_s = s.cloud_compute_s - cloud0
        tail_s = s.edge_compute_s - edge0 - f.edge_s + (s.serialize_s - ser0 - f.serialize_s)
        run.chunks.append(prefill.ChunkRecord(len(f.ids), f.edge_s + f.serialize_s, tail_s, cloud_s, up,
                                              s.bytes_down - down0, sent_at, time.perf_counter() - start))

    for a in range(0, len(ids), p.chunk):
        part = [r - a for r in want if a <= r < a + p.chunk]
        session.settle()  # the chunk before stays whole: this request commits it
        up0 = s.bytes_up
        f = session._send(ids[a:a + p.chunk], None, None, part, argmax)
        flights.append((f, time.perf_counter() - start, s.bytes_up - up0))
        while flights and client.reply_waiting():  # tails of what already came back
            take()
    while flights:
        take()
    run.seconds = time.perf_counter() - start
    s.prefill_round_trips = len(run.chunks)
    session.last_prefill = run
    # a pipelined chunk's wait says nothing about the link: the next step's budget gets the RTT estimate
    return replace(steps[-1], out=torch.cat([step.out for step in steps]),
                   network_s=session.edge.prefill_costs.link.rtt_s)
