"""What serve-edge's `GET /metrics` reports (Prometheus, a registry per server)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from splitlm.edge.runtime import GenerationResult

disable_created_metrics()  # no *_created series
SECOND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKENS_PER_ROUND_TRIP = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


class EdgeMetrics:
    """What `GET /metrics` reports, in a `prometheus_client` registry of this server's own."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("splitlm_edge_requests_total", "HTTP API requests by route and status.",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("splitlm_edge_requests_in_flight", "Generation requests in progress.", registry=r)
        self.prompt_tokens = Counter("splitlm_edge_prompt_tokens_total", "Prompt tokens of generation requests.",
                                     registry=r)
        self.completion_tokens = Counter("splitlm_edge_completion_tokens_total", "Generated tokens.", registry=r)
        self.round_trips = Counter("splitlm_edge_round_trips_total", "Cloud round trips (prefill included).",
                                   registry=r)
        self.tokens_per_round_trip = Histogram("splitlm_edge_tokens_per_round_trip",
                                               "Per request: generated tokens per decoding round trip.",
                                               buckets=TOKENS_PER_ROUND_TRIP, registry=r)
        self.bytes = Counter("splitlm_edge_bytes_total", "Bytes exchanged with the cloud.", ["direction"], registry=r)
        self.errors = Counter("splitlm_edge_errors_total", "Failed requests by error type.", ["type"], registry=r)
        self.latency = Histogram("splitlm_edge_request_seconds", "Generation request duration.", ["endpoint"],
                                 buckets=SECOND_BUCKETS, registry=r)
        self.ttft = Histogram("splitlm_edge_time_to_first_token_seconds", "Prompt in to first token out.",
                              buckets=SECOND_BUCKETS, registry=r)

    def finished(self, endpoint: str, result: GenerationResult, seconds: float) -> None:
        s = result.stats
        self.prompt_tokens.inc(len(result.prompt_ids))
        self.completion_tokens.inc(len(result.token_ids))
        self.round_trips.inc(s.round_trips)
        if s.decode_round_trips:
            self.tokens_per_round_trip.observe(s.tokens_per_round_trip)
        self.bytes.labels(direction="up").inc(s.bytes_up)
        self.bytes.labels(direction="down").inc(s.bytes_down)
        self.latency.labels(endpoint=endpoint).observe(seconds)
        self.ttft.observe(s.prefill_s)
