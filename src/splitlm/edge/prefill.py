"""Streamed, pipelined prefill: the prompt's head-layer outputs go up in chunks, and the cloud runs
one chunk while the next is on the wire and the edge computes the one after.

A chunk of n prompt tokens passes five stages, each a resource of its own (the edge's head and
tail share the edge's compute):

    edge head ─► uplink ─► cloud (causal over every earlier chunk) ─► downlink ─► edge tail

Each chunk is an ordinary FORWARD whose block the next one commits (no `keep`: every entry stays),
so the protocol is unchanged: the cloud answers a connection's requests in order, each seeing the
cache the earlier ones left. The edge sends every chunk as soon as its head layers ran and, between
chunks, runs the tail on the replies that have already arrived; once every chunk is up it takes the
rest as they come. Unchunked, the stages run one after another (head, up, cloud, down, tail);
streamed, the prompt takes about the slowest stage's total plus one chunk through the others.

The chunk size comes from what the edge measured (`PrefillCosts`): its own head and tail compute,
the cloud's compute (`compute_s` of every RESULT), each as seconds = a + b·n + g·past (a per
request, b per token, g per entry already cached: attention, and the cache's copies, grow with the
context, so many small chunks of a long prompt cost more than their tokens), the round-trip time
and the link's bandwidth (round trips that were alone in flight). For each candidate size the plan simulates the chunks
through the stages (`simulate`) and takes the fastest; a prompt it predicts no faster in chunks
goes in one forward.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field

import torch

MIN_CHUNK = 32  # the plan never cuts a prompt into chunks smaller than this
FRAME_OVERHEAD = 256  # bytes of header, metadata and authentication tag per frame (about)
MIN_GAIN = 0.05  # stream only when the plan predicts at least this share of the time saved
PRIOR_WEIGHT = 0.01  # of each of a fit's three pseudo-forwards, against 1 for a measured one
SMALL_FRAME = 32 * 1024  # round trips below this many bytes measure the RTT, larger ones the bandwidth


class LinkEstimate:
    """The round-trip time and seconds per byte (each direction) from round trips alone on the link."""

    def __init__(self, rtt_s: float = 0.05, mbps: float = 100.0):
        self.rtt_s, self.s_per_byte = rtt_s, 8 / (mbps * 1e6)  # priors until measured
        self.rtt_seen = self.rate_seen = False

    def add(self, nbytes: int, network_s: float) -> None:
        """One round trip carrying `nbytes` (request and reply) that took `network_s` on the network."""
        if nbytes < SMALL_FRAME:
            self.rtt_s = network_s if not self.rtt_seen else 0.8 * self.rtt_s + 0.2 * network_s
            self.rtt_seen = True
            return
        rate = max(network_s - self.rtt_s, 0.0) / nbytes
        self.s_per_byte = rate if not self.rate_seen else 0.7 * self.s_per_byte + 0.3 * rate
        self.rate_seen = True


class StageFit:
    """seconds = a + b·n + g·past over a stage's recent forwards (n new tokens after `past` cached
    entries): least squares, pulled toward the priors by three pseudo-forwards, coefficients >= 0."""

    def __init__(self, prior: tuple[float, float, float], window: int = 128):
        self.coef = prior
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._pseudo = [
            (n, past, prior[0] + prior[1] * n + prior[2] * past) for n, past in ((1, 0), (256, 0), (1, 2048))
        ]

    def add(self, n: int, past: int, seconds: float) -> None:
        self.samples.append((n, past, seconds))
        rows = [*self._pseudo, *self.samples]
        w = torch.tensor([PRIOR_WEIGHT] * len(self._pseudo) + [1.0] * len(self.samples), dtype=torch.float64).sqrt()
        x = torch.tensor([[1.0, n, p] for n, p, _ in rows], dtype=torch.float64) * w[:, None]  # [S, 3]
        y = torch.tensor([t for *_, t in rows], dtype=torch.float64) * w  # [S]
        scale = x.abs().amax(0)  # columns of similar size for the solve
        coef = torch.linalg.lstsq(x / scale, y[:, None]).solution[:, 0] / scale
        self.coef = tuple(max(float(c), 0.0) for c in coef)

    def predict(self, n: int, past: int = 0) -> float:
        a, b, g = self.coef
        return a + b * n + g * past


class PrefillCosts:
    """What an edge measured of each stage, for all its sessions (thread-safe): `StageFit`s of the
    head (with encoding), the tail (with decoding) and the cloud; the link."""

    def __init__(self):
        self.head = StageFit((0.002, 0.0003, 1e-6))
        self.tail = StageFit((0.002, 0.0003, 1e-6))
        self.cloud = StageFit((0.005, 0.003, 1e-5))
        self.link = LinkEstimate()
        self._lock = threading.Lock()

    def observe(
        self, tokens: int, past: int, head_s: float, tail_s: float, cloud_s: float, nbytes: int, network_s: float | None
    ) -> None:
        """One forward of `tokens` new tokens after `past` cached entries; `network_s` only when it
        was alone on the link."""
        with self._lock:
            self.head.add(tokens, past, head_s)
            self.tail.add(tokens, past, tail_s)
            self.cloud.add(tokens, past, cloud_s)
            if network_s is not None:
                self.link.add(nbytes, network_s)

    def stages(self, up_per_token: float, down_per_token: float) -> Stages:
        """The stage costs now, with the link's bytes per token up and down."""
        with self._lock:
            s = self.link.s_per_byte
            return Stages(
                self.head.coef,
                (s * FRAME_OVERHEAD, s * up_per_token, 0.0),
                self.cloud.coef,
                (s * FRAME_OVERHEAD, s * down_per_token, 0.0),
                self.tail.coef,
                self.link.rtt_s,
            )


@dataclass
class Stages:
    """Seconds per chunk of n tokens after `past` cached entries, a + b·n + g·past, of each stage;
    and the round trip's latency."""

    head: tuple[float, float, float]
    up: tuple[float, float, float]
    cloud: tuple[float, float, float]
    down: tuple[float, float, float]
    tail: tuple[float, float, float]
    rtt_s: float

    @staticmethod
    def t(stage: tuple[float, float, float], n: int, past: int = 0) -> float:
        return stage[0] + stage[1] * n + stage[2] * past


def simulate(chunks: list[int], st: Stages, start: int = 0) -> float:
    """Predicted seconds from the first head pass to the last tail pass when `chunks` (token counts,
    after `start` cached entries) stream through the stages: each stage takes one chunk at a time,
    in order; half the RTT on the way up, half on the way down; the edge runs every head before the
    tails (its tail work fills the waits, so the order matters little)."""
    head = up = cloud = down = 0.0
    arrivals, past = [], start
    for n in chunks:
        head += st.t(st.head, n, past)
        up = max(up, head) + st.t(st.up, n)
        cloud = max(cloud, up + st.rtt_s / 2) + st.t(st.cloud, n, past)
        down = max(down, cloud) + st.t(st.down, n)
        arrivals.append(down + st.rtt_s / 2)
        past += n
    edge, past = head, start
    for n, arrival in zip(chunks, arrivals, strict=True):
        edge = max(edge, arrival) + st.t(st.tail, n, past)
        past += n
    return edge


def split(total: int, chunk: int) -> list[int]:
    return [min(chunk, total - a) for a in range(0, total, chunk)]


@dataclass
class Plan:
    chunk: int  # tokens per chunk (the last may be shorter); `total` = one forward
    predicted_s: float | None  # None: a fixed chunk size
    unchunked_s: float | None  # predicted for one forward (inf: the limits allow none)


def candidates(total: int, max_chunk: int, pass_rows: int | None = None) -> list[int]:
    """Chunk sizes to try, each splitting `total` into K nearly equal chunks: K = 1 … 16, then up by
    a quarter each, down to chunks of MIN_CHUNK (or as few as `max_chunk` allows). A chunk longer
    than the cloud's `pass_rows` is rounded up to whole passes (a remainder would cost a pass of its own)."""
    least = -(-total // max_chunk)
    most = max(least, total // MIN_CHUNK)
    ks, k = {*range(1, 17), least}, 16
    while k < most:
        k = max(k + 1, int(k * 1.25))
        ks.add(min(k, most))
    sizes = {-(-total // k) for k in ks if least <= k <= most}
    if pass_rows:
        sizes = {min(-(-n // pass_rows) * pass_rows, max_chunk, total) if n > pass_rows else n for n in sizes}
    return sorted(sizes, reverse=True)


def plan(total: int, max_chunk: int, st: Stages, start: int = 0, pass_rows: int | None = None) -> Plan:
    """The chunk size (at most `max_chunk`) predicted to bring `total` tokens (after `start` cached
    entries) through the stages soonest."""
    single = simulate([total], st, start) if max_chunk >= total else math.inf
    best = None
    for n in candidates(total, max_chunk, pass_rows):
        t = simulate(split(total, n), st, start)
        if best is None or t < best.predicted_s:
            best = Plan(n, t, single)
    return best


@dataclass
class ChunkRecord:
    tokens: int
    head_s: float  # the edge's head layers and the request's encoding
    tail_s: float  # the reply's decoding and the edge's tail layers (+ LM head rows)
    cloud_s: float  # the cloud's compute (`compute_s` of the RESULT)
    bytes_up: int
    bytes_down: int
    sent_at: float  # seconds after the prefill began
    done_at: float  # its tail pass finished


@dataclass
class PrefillRun:
    """How one prompt went through (`EdgeSession.last_prefill`)."""

    tokens: int
    chunk: int
    predicted_s: float | None  # the plan's prediction (None: a fixed chunk size)
    unchunked_predicted_s: float | None
    seconds: float = 0.0
    chunks: list[ChunkRecord] = field(default_factory=list)
