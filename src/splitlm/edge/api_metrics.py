"""What serve-edge's `GET /metrics` reports (Prometheus, a registry per server).

The names are vLLM's with `vllm:` replaced by `splitlm_edge_` wherever vLLM exports the same quantity
(docs/api.md lists each with its counterpart), so a vLLM dashboard ports by renaming."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from splitlm.edge.runtime import GenerationResult

if TYPE_CHECKING:
    from splitlm.edge.prefix_pool import PrefixPool

disable_created_metrics()  # no *_created series
SECOND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_SECOND_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TOKENS_PER_ROUND_TRIP = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


@dataclass
class RequestClock:
    """One generation request's way through serve-edge's workers: waiting from its arrival until a
    worker starts it (`EdgeMetrics.started`), running until it ends; a request whose job is cancelled
    before a worker takes it never starts (`EdgeMetrics.left`)."""

    arrived: float = field(default_factory=time.perf_counter)
    queue_s: float = 0.0  # arrival -> a worker took it
    waiting: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop_waiting(self) -> bool:
        """Whether it was still waiting (the first call only: the worker and the job's end may race)."""
        with self.lock:
            was, self.waiting = self.waiting, False
        return was


class EdgeMetrics:
    """What `GET /metrics` reports, in a `prometheus_client` registry of this server's own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "splitlm_edge_requests_total", "HTTP API requests by route and status.", ["endpoint", "status"], registry=r
        )
        self.running = Gauge(
            "splitlm_edge_num_requests_running", "Generation requests a worker is running.", registry=r
        )
        self.waiting = Gauge(
            "splitlm_edge_num_requests_waiting",
            "Generation requests accepted and waiting for a worker (--max-concurrent).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "splitlm_edge_prompt_tokens_total", "Prompt tokens of finished requests.", registry=r
        )
        self.generation_tokens = Counter(
            "splitlm_edge_generation_tokens_total", "Generated tokens of finished requests.", registry=r
        )
        self.round_trips = Counter(
            "splitlm_edge_round_trips_total", "Cloud round trips (prefill included).", registry=r
        )
        self.tokens_per_round_trip = Histogram(
            "splitlm_edge_tokens_per_round_trip",
            "Per request: generated tokens per decoding round trip.",
            buckets=TOKENS_PER_ROUND_TRIP,
            registry=r,
        )
        self.bytes = Counter("splitlm_edge_bytes_total", "Bytes exchanged with the cloud.", ["direction"], registry=r)
        self.errors = Counter("splitlm_edge_errors_total", "Failed requests by error type.", ["type"], registry=r)
        self.e2e = Histogram(
            "splitlm_edge_e2e_request_latency_seconds",
            "Arrival to the last token out.",
            ["endpoint"],
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "splitlm_edge_request_queue_time_seconds",
            "Arrival to a worker taking it.",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "splitlm_edge_time_to_first_token_seconds",
            "Arrival to the first token out (queue, cloud session's OPEN and prefill).",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "splitlm_edge_time_per_output_token_seconds",
            "Per request: decoding time per output token after the first.",
            buckets=TOKEN_SECOND_BUCKETS,
            registry=r,
        )
        self.drafts = Counter(
            "splitlm_edge_spec_decode_num_drafts_total", "Verification steps that carried drafted tokens.", registry=r
        )
        self.draft_tokens = Counter(
            "splitlm_edge_spec_decode_num_draft_tokens_total", "Drafted tokens verified.", registry=r
        )
        self.accepted_tokens = Counter(
            "splitlm_edge_spec_decode_num_accepted_tokens_total", "Drafted tokens accepted.", registry=r
        )
        self.accepted_per_pos = Counter(
            "splitlm_edge_spec_decode_num_accepted_tokens_per_pos_total",
            "Drafted tokens accepted, by depth in the draft (0: the first).",
            ["position"],
            registry=r,
        )

    # -- a request's way through the workers -------------------------------------------------------
    def arrived(self) -> RequestClock:
        """A generation request handed to the workers: it waits."""
        self.waiting.inc()
        return RequestClock()

    def started(self, clock: RequestClock) -> None:
        """A worker took it (call `ended` when the worker is done with it)."""
        if clock.stop_waiting():
            self.waiting.dec()
        clock.queue_s = time.perf_counter() - clock.arrived
        self.queue_time.observe(clock.queue_s)
        self.running.inc()

    def ended(self) -> None:
        self.running.dec()

    def left(self, clock: RequestClock) -> None:
        """Its job is done; if no worker ever took it (cancelled while waiting), it waits no more."""
        if clock.stop_waiting():
            self.waiting.dec()

    # -- a finished request ------------------------------------------------------------------------
    def finished(self, endpoint: str, result: GenerationResult, clock: RequestClock) -> None:
        s = result.stats
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.generation_tokens.inc(len(result.token_ids))
        self.round_trips.inc(s.round_trips)
        if s.decode_round_trips:
            self.tokens_per_round_trip.observe(s.tokens_per_round_trip)
        self.bytes.labels(direction="up").inc(s.bytes_up)
        self.bytes.labels(direction="down").inc(s.bytes_down)
        self.e2e.labels(endpoint=endpoint).observe(time.perf_counter() - clock.arrived)
        self.ttft.observe(clock.queue_s + s.setup_s + s.prefill_s)
        if s.new_tokens > 1:
            self.tpot.observe(s.decode_s / (s.new_tokens - 1))
        self.drafts.inc(s.drafts)
        self.draft_tokens.inc(s.draft_tokens)
        self.accepted_tokens.inc(s.accepted_tokens)
        for position, n in enumerate(s.accepted_per_position):
            self.accepted_per_pos.labels(position=str(position)).inc(n)


class PrefixPoolCollector(Collector):
    """The prefix pool's figures (`splitlm.edge.prefix_pool`), read at each scrape: vLLM's
    `prefix_cache_queries` / `prefix_cache_hits` (in tokens), and what the pooled states hold."""

    def __init__(self, pool: PrefixPool):
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        c, u = self.pool.counters, self.pool.usage()
        yield CounterMetricFamily(
            "splitlm_edge_prefix_cache_queries",
            "Prompt tokens of requests that looked for a pooled prefix.",
            c.queried_tokens,
        )
        yield CounterMetricFamily(
            "splitlm_edge_prefix_cache_hits",
            "Prompt tokens reused from pooled states (not prefilled again).",
            c.hit_tokens,
        )
        yield CounterMetricFamily(
            "splitlm_edge_prefix_pool_evictions",
            "Pooled states closed for the pool's limits or idle time.",
            c.evictions,
        )
        yield GaugeMetricFamily("splitlm_edge_prefix_pool_sessions", "Conversation states in the pool.", u.sessions)
        held = GaugeMetricFamily(
            "splitlm_edge_prefix_pool_bytes",
            "Memory the pooled states hold, by side (the cloud's: its K/V entries, estimated).",
            labels=["side"],
        )
        held.add_metric(["edge"], u.edge_bytes)
        held.add_metric(["cloud"], u.cloud_bytes)
        yield held
