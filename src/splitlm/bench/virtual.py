"""Virtual edges: sessions that replay a recorded step trace (`splitlm.bench.trace`) against a real
cloud, with random activations of the right shape and dtype and no model compute.

Each `VirtualEdge` is a thread with one `CloudClient` (a real encrypted WebSocket, through the WAN
emulator when the caller points it there). It loops over the trace's generations, starting at its
own offset: OPEN, the generation's FORWARDs as recorded (positions, tree mask, keep, crop, context,
control tuple; each sent once the session had taken as many replies as the real edge had, so
pipelined steps stay pipelined), CLOSE. The hidden states are rows of one random [R, D] tensor
made once: the cloud's cost does not depend on their values. Per reply it logs a `StepSample`
(send and arrival times, the tokens the real edge produced then, the cloud's queue and compute
times); a failed request is logged as an error, the connection dropped and a new one made.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from splitlm.bench.trace import PromptTrace, Trace, TracedStep
from splitlm.transport.client import ClientOptions, CloudClient, CloudError, PendingForward
from splitlm.transport.messages import Control, Forward, Open

log = logging.getLogger(__name__)

ERROR_PAUSE_S = 0.5  # after a failed request, before trying again (a refusing cloud is not hammered)
MAX_REPLY_ELEMENTS = 1 << 26


@dataclass
class StepSample:
    """One FORWARD's reply as a virtual edge took it."""

    sent: float  # perf_counter() at its send
    done: float  # at its reply
    accepted: int  # tokens the recorded edge produced once this reply came
    rows: int  # C + T rows sent
    queue_s: float  # the cloud's: waiting for a pass
    compute_s: float  # the cloud's: arrival at the scheduler to output (queue included)
    cache_len: int  # the cloud's cache entries after it
    prefill: bool = False  # a generation's first FORWARD (its prompt)

    @property
    def latency_s(self) -> float:
        return self.done - self.sent


@dataclass
class Target:
    """Where and as what the virtual edges connect: the cloud (or the emulator in front of it) and
    the edge shard whose cloud it serves."""

    url: str
    fingerprint: str  # the edge shard's (the cloud checks it in the handshake)
    hidden_size: int  # D of the target model (the trace may come from another model of the same split)
    split: int  # the control tuple's `split`: the cloud's first layer
    timeout_s: float = 120.0


@dataclass
class Prepared:
    """A traced step's request parts made once (positions and mask as tensors)."""

    step: TracedStep
    positions: torch.Tensor
    mask: torch.Tensor | None


def prepare(trace: Trace) -> list[list[Prepared]]:
    return [
        [Prepared(s, torch.tensor(s.positions, dtype=torch.long), s.mask_tensor()) for s in p.steps]
        for p in trace.prompts
    ]


@dataclass
class VirtualLog:
    """What one virtual edge saw."""

    samples: list[StepSample] = field(default_factory=list)
    errors: list[tuple[float, str]] = field(default_factory=list)  # (perf_counter(), message)
    generations: int = 0  # generations replayed to their end


class VirtualEdge:
    """One virtual session at a time, replaying `trace` from generation `offset` on, until `stop`."""

    def __init__(
        self,
        target: Target,
        trace: Trace,
        prepared: list[list[Prepared]],
        hidden: torch.Tensor,
        offset: int,
        stop: threading.Event,
    ):
        self.target, self.trace, self.prepared, self.hidden = target, trace, prepared, hidden  # hidden [R, D]
        self.offset, self.stop = offset, stop
        self.first: TracedStep | None = None  # the first step of the generation being replayed
        self.log = VirtualLog()
        self.thread = threading.Thread(target=self.run, name=f"virtual-edge-{offset}", daemon=True)

    def connect(self) -> CloudClient:
        t = self.target
        return CloudClient(t.url, t.fingerprint, ClientOptions(timeout_s=t.timeout_s))

    def run(self) -> None:
        client: CloudClient | None = None
        i = self.offset
        while not self.stop.is_set():
            try:
                client = client or self.connect()
                self.replay(
                    client, self.trace.prompts[i % len(self.trace.prompts)], self.prepared[i % len(self.prepared)]
                )
                i += 1
            except CloudError as e:
                self.log.errors.append((time.perf_counter(), str(e)))
                if client is not None:
                    client.close()
                client = None
                self.stop.wait(ERROR_PAUSE_S)
        if client is not None:
            client.close()

    def replay(self, client: CloudClient, prompt: PromptTrace, steps: list[Prepared]) -> None:
        """One generation: OPEN, its FORWARDs, CLOSE (cut short, replies taken, when `stop` is set)."""
        session = client.open(Open(self.trace.wire_dtype, self.trace.cache_policy)).session
        in_flight: deque[tuple[PendingForward, TracedStep]] = deque()
        taken = 0
        self.first = steps[0].step if steps else None
        for p in steps:
            if self.stop.is_set():
                break
            while taken < p.step.after and in_flight:
                self.take(client, *in_flight.popleft())
                taken += 1
            in_flight.append(
                (
                    client.send_forward(
                        session, self.request(p), p.step.dtype or self.trace.wire_dtype, MAX_REPLY_ELEMENTS
                    ),
                    p.step,
                )
            )
        while in_flight:
            self.take(client, *in_flight.popleft())
        client.close_session(session)
        self.log.generations += not self.stop.is_set()

    def request(self, p: Prepared) -> Forward:
        s = p.step
        control = Control(cache=s.cache, window=s.window, dtype=s.dtype, split=self.target.split)
        return Forward(self.hidden[: s.rows], p.positions, p.mask, s.keep, s.crop, s.context, control, s.logit_rows)

    def take(self, client: CloudClient, pending: PendingForward, step: TracedStep) -> None:
        result = client.receive_forward(pending)
        self.log.samples.append(
            StepSample(
                pending.sent_at,
                time.perf_counter(),
                step.accepted,
                step.rows,
                result.queue_s,
                result.compute_s,
                result.cache_len,
                step is self.first,
            )
        )


def random_hidden(trace: Trace, hidden_size: int, seed: int = 0) -> torch.Tensor:
    """[R, D] random activations (fp32, unit scale) for the longest FORWARD of `trace`."""
    rows = max((s.rows for p in trace.prompts for s in p.steps), default=1)
    return torch.randn(rows, hidden_size, generator=torch.Generator().manual_seed(seed))


def start_edges(target: Target, trace: Trace, n: int, stop: threading.Event) -> list[VirtualEdge]:
    """`n` virtual edges, started: edge i begins at generation i (they share the activations)."""
    prepared, hidden = prepare(trace), random_hidden(trace, target.hidden_size)
    edges = [VirtualEdge(target, trace, prepared, hidden, i, stop) for i in range(n)]
    for e in edges:
        e.thread.start()
    return edges


def join_edges(edges: list[VirtualEdge], timeout_s: float = 120.0) -> int:
    """Wait for the edges to stop (their `stop` set); returns how many did not in `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    for e in edges:
        e.thread.join(max(0.0, deadline - time.monotonic()))
    return sum(e.thread.is_alive() for e in edges)
