"""What the cloud counts, and the plain HTTP it answers on the WebSocket port: `GET /healthz` (`ok`
with the shard fingerprint, the device and the dtype) and `GET /metrics` (the Prometheus text format).

The quantities vLLM exports have `splitlm_cloud_` counterparts (requests running and waiting, KV cache
use, preemptions, queue time, tokens): docs/api.md lists each with its vLLM name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from splitlm.transport.errors import ErrorCode
from splitlm.transport.frames import MsgType

disable_created_metrics()  # no *_created series: the counters' start times are noise on a dashboard
SECOND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass
class ServerStats:
    """Running totals of one server (tests and logs read them; `/metrics` has the same and more)."""

    connections: int = 0  # WebSocket connections accepted
    forwards: int = 0  # FORWARD requests computed
    tokens: int = 0  # token positions they ran through the layers
    errors: int = 0  # ERROR frames sent
    preemptions: int = 0  # sessions freed to make room for others
    idle_evictions: int = 0  # sessions freed after the idle timeout
    replays: int = 0  # OPENs by a client key that was told PREEMPTED (its edge replaying a context)
    malloc_trims: int = 0  # times the freed host memory was given back to the system (`cloud.memory`)


@dataclass
class PassTiming:
    """One pass of the scheduler, for the metrics: its size and where its time went. On a GPU the
    layers' kernels run asynchronously: `layers_s` is mostly their launching, and `finish_s` (the
    outputs copied to host memory) includes the wait for them."""

    sessions: int
    rows: int
    begin_s: float  # steps begun: caches restored, cropped and kept, rows moved to the device
    layers_s: float  # the layers run over the pass's rows
    finish_s: float  # finished steps' policies applied and outputs brought to host memory

    @property
    def seconds(self) -> float:
        return self.begin_s + self.layers_s + self.finish_s


class CloudMetrics:
    """What `GET /metrics` reports (no label carries a key, a session id or any tensor data); a
    `prometheus_client` registry of its own, so that servers in one process never share counts."""

    def __init__(self):
        self.stats = ServerStats()
        r = self.registry = CollectorRegistry()
        self.connections = Counter("splitlm_cloud_connections_total", "WebSocket connections accepted.", registry=r)
        self.requests = Counter(
            "splitlm_cloud_requests_total", "Requests answered, by message type.", ["type"], registry=r
        )
        self.round_trips = Counter(
            "splitlm_cloud_round_trips_total", "FORWARD requests computed (one per edge round trip).", registry=r
        )
        self.tokens = Counter(
            "splitlm_cloud_tokens_total", "Token positions run through the middle layers.", registry=r
        )
        self.rows = Counter(
            "splitlm_cloud_rows_total",
            "Rows run through the middle layers: new token positions "
            "and re-sent context rows (prompt and generated tokens alike).",
            registry=r,
        )
        self.context_rows = Counter(
            "splitlm_cloud_context_rows_total",
            "Context rows re-sent by edges (replays after a preemption or a failover, sessions that keep no cache).",
            registry=r,
        )
        self.tokens_per_round_trip = Histogram(
            "splitlm_cloud_tokens_per_round_trip",
            "Token positions per FORWARD (trees and windows included).",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.errors = Counter("splitlm_cloud_errors_total", "ERROR frames sent, by error code.", ["code"], registry=r)
        self.compute_seconds = Histogram(
            "splitlm_cloud_compute_seconds", "Compute time of one FORWARD.", buckets=SECOND_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "splitlm_cloud_request_seconds",
            "Time from a request's arrival to its reply being sent, by type.",
            ["type"],
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        self.sessions = Gauge("splitlm_cloud_sessions", "Open sessions.", registry=r)
        self.kv_reserved = Gauge(
            "splitlm_cloud_kv_reserved_bytes", "KV cache bytes the open sessions reserve.", registry=r
        )
        self.kv_budget = Gauge(
            "splitlm_cloud_kv_budget_bytes", "The KV memory budget (preemption, then CAPACITY beyond it).", registry=r
        )
        self.kv_usage = Gauge(
            "splitlm_cloud_kv_cache_usage_perc",
            "KV cache bytes reserved as a fraction of the budget (0 to 1).",
            registry=r,
        )
        self.running = Gauge("splitlm_cloud_num_requests_running", "FORWARDs in a pass of the layers now.", registry=r)
        self.waiting = Gauge("splitlm_cloud_num_requests_waiting", "FORWARDs queued for their first pass.", registry=r)
        self.preemptions = Counter(
            "splitlm_cloud_num_preemptions_total",
            "Idle sessions freed to make room for another (their edges replay).",
            registry=r,
        )
        self.idle_evictions = Counter(
            "splitlm_cloud_idle_evictions_total",
            "Sessions freed after the idle timeout (their edges replay if they come back).",
            registry=r,
        )
        self.malloc_trims = Counter(
            "splitlm_cloud_malloc_trims_total",
            "Times the allocator's free host memory was given back to the system (malloc_trim).",
            registry=r,
        )
        self.replays = Counter(
            "splitlm_cloud_replays_total",
            "OPENs by a client that was told PREEMPTED (an edge re-opening to replay its context).",
            registry=r,
        )
        self.batch_size = Histogram(
            "splitlm_cloud_batch_size",
            "Requests (sessions) per pass of the scheduler.",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_rows = Histogram(
            "splitlm_cloud_batch_rows", "Token rows per pass of the scheduler.", buckets=TOKEN_BUCKETS, registry=r
        )
        self.pass_seconds = Histogram(
            "splitlm_cloud_pass_seconds",
            "Compute time of one pass of the scheduler.",
            buckets=SECOND_BUCKETS,
            registry=r,
        )
        phase = "Time the scheduler's passes spent {} (over splitlm_cloud_pass_seconds_count: the mean)."
        self.pass_begin_seconds = Counter(
            "splitlm_cloud_pass_begin_seconds",
            phase.format("beginning steps (caches restored, cropped, kept; rows to the device)"),
            registry=r,
        )
        self.pass_layers_seconds = Counter(
            "splitlm_cloud_pass_layers_seconds",
            phase.format("running the layers (on a GPU: launching their kernels)"),
            registry=r,
        )
        self.pass_finish_seconds = Counter(
            "splitlm_cloud_pass_finish_seconds",
            phase.format("finishing steps (policies; outputs to host memory, on a GPU after the kernels)"),
            registry=r,
        )
        self.queue_seconds = Histogram(
            "splitlm_cloud_queue_seconds", "Time a FORWARD waited for a pass.", buckets=SECOND_BUCKETS, registry=r
        )

    def count_connection(self) -> None:
        self.stats.connections += 1
        self.connections.inc()

    def count_error(self, code: ErrorCode) -> None:
        self.stats.errors += 1
        self.errors.labels(code=code.name).inc()

    def count_request(self, msg_type: MsgType, seconds: float) -> None:
        """A request answered, `seconds` after it arrived."""
        self.requests.labels(type=msg_type.name).inc()
        self.request_seconds.labels(type=msg_type.name).observe(seconds)

    def count_forward(self, tokens: int, context: int, compute_s: float, queue_s: float) -> None:
        """A FORWARD of `tokens` new positions after `context` context rows computed (compute_s includes queue_s)."""
        self.stats.forwards += 1
        self.stats.tokens += tokens
        self.round_trips.inc()
        self.tokens.inc(tokens)
        self.rows.inc(tokens + context)
        self.context_rows.inc(context)
        self.tokens_per_round_trip.observe(tokens)
        self.compute_seconds.observe(compute_s)
        self.queue_seconds.observe(queue_s)

    def count_trim(self) -> None:
        self.stats.malloc_trims += 1
        self.malloc_trims.inc()

    def count_preemption(self, idle: bool) -> None:
        """A session freed: after the idle timeout (`idle`), else to make room for another."""
        if idle:
            self.stats.idle_evictions += 1
            self.idle_evictions.inc()
        else:
            self.stats.preemptions += 1
            self.preemptions.inc()

    def count_replay(self) -> None:
        self.stats.replays += 1
        self.replays.inc()

    def set_load(self, running: int, waiting: int, kv_reserved: int, kv_budget: int) -> None:
        """The gauges read at a scrape: FORWARDs computing and queued, KV bytes reserved and the budget."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_reserved.set(kv_reserved)
        self.kv_budget.set(kv_budget)
        self.kv_usage.set(kv_reserved / kv_budget if kv_budget else 0.0)

    def on_pass(self, timing: PassTiming) -> None:
        self.batch_size.observe(timing.sessions)
        self.batch_rows.observe(timing.rows)
        self.pass_seconds.observe(timing.seconds)
        self.pass_begin_seconds.inc(timing.begin_s)
        self.pass_layers_seconds.inc(timing.layers_s)
        self.pass_finish_seconds.inc(timing.finish_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def http_response(
    connection: ServerConnection, request: Request, health: Callable[[], str], scrape: Callable[[], bytes]
) -> Response | None:
    """The answer to a plain HTTP request (websockets' `process_request`): `/healthz` -> `health()`,
    `/metrics` -> `scrape()`; None for anything else (the WebSocket handshake goes on)."""
    if request.path == "/healthz":
        return connection.respond(HTTPStatus.OK, health())
    if request.path == "/metrics":
        response = connection.respond(HTTPStatus.OK, scrape().decode())
        del response.headers["Content-Type"]  # Headers is a multi-dict: replace, not add
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response
    return None
