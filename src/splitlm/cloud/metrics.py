"""What the cloud counts, and the plain HTTP it answers on the WebSocket port: `GET /healthz` (`ok`
with the shard fingerprint, the device and the dtype) and `GET /metrics` (the Prometheus text format)."""

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


class CloudMetrics:
    """What `GET /metrics` reports (no label carries a key, a session id or any tensor data); a
    `prometheus_client` registry of its own, so that servers in one process never share counts."""

    def __init__(self):
        self.stats = ServerStats()
        r = self.registry = CollectorRegistry()
        self.connections = Counter("splitlm_cloud_connections_total", "WebSocket connections accepted.", registry=r)
        self.requests = Counter("splitlm_cloud_requests_total", "Requests answered, by message type.", ["type"],
                                registry=r)
        self.round_trips = Counter("splitlm_cloud_round_trips_total",
                                   "FORWARD requests computed (one per edge round trip).", registry=r)
        self.tokens = Counter("splitlm_cloud_tokens_total", "Token positions run through the middle layers.", registry=r)
        self.tokens_per_round_trip = Histogram("splitlm_cloud_tokens_per_round_trip",
                                               "Token positions per FORWARD (trees and windows included).",
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.errors = Counter("splitlm_cloud_errors_total", "ERROR frames sent, by error code.", ["code"], registry=r)
        self.compute_seconds = Histogram("splitlm_cloud_compute_seconds", "Compute time of one FORWARD.",
                                         buckets=SECOND_BUCKETS, registry=r)
        self.request_seconds = Histogram("splitlm_cloud_request_seconds",
                                         "Time from a request's arrival to its reply being sent, by type.",
                                         ["type"], buckets=SECOND_BUCKETS, registry=r)
        self.sessions = Gauge("splitlm_cloud_sessions", "Open sessions.", registry=r)
        self.kv_reserved = Gauge("splitlm_cloud_kv_reserved_bytes", "KV cache bytes the open sessions reserve.",
                                 registry=r)
        self.kv_budget = Gauge("splitlm_cloud_kv_budget_bytes", "The KV memory budget (CAPACITY beyond it).", registry=r)
        self.batch_size = Histogram("splitlm_cloud_batch_size", "Requests (sessions) per pass of the scheduler.",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.batch_rows = Histogram("splitlm_cloud_batch_rows", "Token rows per pass of the scheduler.",
                                    buckets=TOKEN_BUCKETS, registry=r)
        self.pass_seconds = Histogram("splitlm_cloud_pass_seconds", "Compute time of one pass of the scheduler.",
                                      buckets=SECOND_BUCKETS, registry=r)
        self.queue_seconds = Histogram("splitlm_cloud_queue_seconds", "Time a FORWARD waited for a pass.",
                                       buckets=SECOND_BUCKETS, registry=r)

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

    def count_forward(self, tokens: int, compute_s: float, queue_s: float) -> None:
        """A FORWARD of `tokens` new positions computed (compute_s includes queue_s)."""
        self.stats.forwards += 1
        self.stats.tokens += tokens
        self.round_trips.inc()
        self.tokens.inc(tokens)
        self.tokens_per_round_trip.observe(tokens)
        self.compute_seconds.observe(compute_s)
        self.queue_seconds.observe(queue_s)

    def on_pass(self, sessions: int, rows: int, seconds: float) -> None:
        self.batch_size.observe(sessions)
        self.batch_rows.observe(rows)
        self.pass_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def http_response(connection: ServerConnection, request: Request, health: Callable[[], str],
                  scrape: Callable[[], bytes]) -> Response | None:
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
