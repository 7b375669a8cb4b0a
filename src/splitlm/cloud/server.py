"""The cloud server: asyncio + websockets, many sessions, compute off the event loop.

`CloudServer` puts the parts together: the layers it runs, its sessions and KV budget, the batching
scheduler (`cloud.scheduler`), the request handlers (`cloud.handlers`), the per-connection protocol
(`cloud.servicer`), plain HTTP `GET /healthz` and `GET /metrics` on the same port (`cloud.metrics`),
TLS, and draining on SIGTERM. `BackgroundServer` runs one in a thread (tests, demo, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from splitlm import SplitLMError, __version__
from splitlm.cloud.budget import KVBudget
from splitlm.cloud.handlers import SessionRequests
from splitlm.cloud.memory import malloc_trim, trim_available
from splitlm.cloud.metrics import CloudMetrics, http_response
from splitlm.cloud.scheduler import BatchConfig, Scheduler
from splitlm.cloud.servicer import Caller, CodecPool, HandshakeConfig, RequestTable, Servicer, answer
from splitlm.cloud.sessions import ServerLimits, SessionTable
from splitlm.model.device import describe, dtype_name, resolve_device, resolve_dtype
from splitlm.model.kv_cache import BLOCK
from splitlm.model.paged_kv import BLOCK_SIZE, BlockPool
from splitlm.model.shards import CloudModel, load_cloud
from splitlm.transport.crypto import RekeyPolicy
from splitlm.transport.frames import Frame
from splitlm.transport.hello import Limits, ServerInfo
from splitlm.transport.keys import AllowedClients, Identity, resolve_identity

log = logging.getLogger(__name__)


def tls_context(cert: str | Path | None, key: str | Path | None) -> ssl.SSLContext | None:
    """The server's TLS context (wss://), or None without a certificate and key."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise SplitLMError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    # No TLS 1.3 session tickets: edges never resume a TLS session, and with tickets sent after the
    # handshake, a loaded server now and then never got the upgrade request and dropped the connection
    # at its open timeout (connection stress test: 6 of 19 runs of 320 connections each hit it; without: 0 of 20).
    context.num_tickets = 0
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise SplitLMError(f"cannot load the TLS certificate {cert} / key {key}: {e}") from None
    return context


@dataclass
class ServerSettings:
    """How a `CloudServer` runs and whom it serves (its limits are `ServerLimits`).

    device, dtype: where the middle layers run and in which precision (`splitlm.model.device`;
        default auto: CUDA in bf16 where present, else the CPU in fp32).
    identity: the server's static key (`Identity` or .key path); None = the one kept in the config
        dir (``cloud.key``, created on first use).
    allowed_clients: a file of allowed client public keys (or a list of keys / fingerprints);
        None = any client may connect (still encrypted; a warning is logged).
    tls_cert, tls_key: serve wss:// with this certificate chain and key (on top of the encryption).
    rekey: when this side's sending keys rotate.
    batch: the scheduler's limits per pass (`BatchConfig`; max_batch=1: one request at a time).
    """

    device: str = "auto"
    dtype: str = "auto"
    identity: Identity | str | Path | None = None
    allowed_clients: str | Path | list | AllowedClients | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    rekey: RekeyPolicy | None = None
    batch: BatchConfig | None = None


class CloudServer:
    """The cloud: the shard of `shard_dir` served within `limits`, as `settings` say."""

    def __init__(
        self, shard_dir: str | Path, limits: ServerLimits | None = None, settings: ServerSettings | None = None
    ):
        settings = settings or ServerSettings()
        device, batch, allowed_clients = settings.device, settings.batch, settings.allowed_clients
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(settings.dtype, self.device)
        self.model = self.load_model(shard_dir)
        self.manifest = self.model.manifest
        self.limits = limits or ServerLimits()
        kv_block = BLOCK_SIZE if self.paged else BLOCK  # the entries a session's cache takes at a time
        self.budget = KVBudget.for_model(self.model, self.limits.kv_budget_bytes, kv_block)
        self.metrics = CloudMetrics()
        self.stats = self.metrics.stats
        self.sessions = self.make_sessions()
        self.scheduler = self.make_scheduler(batch)
        self.codec = CodecPool()
        self.identity = resolve_identity(settings.identity, "cloud")
        self.allowed = (
            allowed_clients
            if isinstance(allowed_clients, AllowedClients) or allowed_clients is None
            else AllowedClients(allowed_clients)
        )
        self.rekey = settings.rekey
        self.ssl_context = tls_context(settings.tls_cert, settings.tls_key)
        self.requests = self.make_requests()
        handshake = HandshakeConfig(self.identity, self.server_info(batch or BatchConfig()), self.allowed, self.rekey)
        self.servicer = Servicer(
            self.limits, handshake, self.request_table(), self.metrics, self.codec, self.connection_closed
        )
        self.listener = None  # the websockets server, while serving
        self._stop: asyncio.Event | None = None

    # -- the parts (a Ray replica's stage 0 and the Ray front door override some) ----------------------
    def load_model(self, shard_dir: str | Path) -> CloudModel:
        """The layers this server runs."""
        return load_cloud(shard_dir, self.device, self.dtype)

    paged = True  # the sessions' caches are paged in one pool (`splitlm.model.paged_kv`), else contiguous

    def make_sessions(self) -> SessionTable:
        pool = BlockPool.for_stack(self.model.middle) if self.paged else None
        return SessionTable(self.limits, self.budget, self.metrics, pool)

    def make_scheduler(self, batch: BatchConfig | None) -> Scheduler:
        return Scheduler(self.model, batch, self.metrics.on_pass)

    def make_requests(self) -> SessionRequests:
        return SessionRequests(
            self.model, self.device, self.sessions, self.scheduler, self.limits, self.metrics, self.codec
        )

    def request_table(self) -> RequestTable:
        """Who answers each request type (`servicer.request_table`)."""
        return self.requests.table()

    def server_info(self, batch: BatchConfig) -> ServerInfo:
        """HELLO_OK's server information: the limits an edge must respect."""
        lim = self.limits
        return ServerInfo(
            f"splitlm/{__version__}",
            self.manifest.fingerprint,
            Limits(
                lim.max_tokens_per_session,
                lim.max_tokens_per_forward,
                lim.max_frame_bytes,
                batch.prefill_chunk,
                lim.max_sessions_per_client,
                self.kv_budget_entries(),
            ),
        )

    def kv_budget_entries(self) -> int | None:
        """What HELLO_OK says one session's cache may hold at most (the whole KV budget, in entries)."""
        return self.budget.max_entries

    @property
    def public_key(self) -> bytes:
        return self.identity.public_bytes

    @property
    def fingerprint(self) -> str:
        """The server's identity fingerprint (what edges pin with --cloud-key)."""
        return self.identity.fingerprint

    async def handle(self, conn: Caller, frame: Frame) -> Frame:
        """The reply to one decrypted request (a Ray replica's stage 0 answers its front doors with this)."""
        return await answer(self.servicer.table, conn, frame)

    def connection_closed(self, conn_id: int) -> None:
        self.sessions.drop_connection(conn_id)  # a connection's sessions end with it

    # -- HTTP ------------------------------------------------------------------------------------
    def health(self) -> str:
        """`GET /healthz`."""
        return f"ok {self.manifest.fingerprint} device={self.device} dtype={dtype_name(self.dtype)}\n"

    def scrape(self) -> bytes:
        """`GET /metrics`."""
        self.metrics.sessions.set(len(self.sessions.sessions))
        self.metrics.set_load(*self.scheduler.load(), self.sessions.kv_reserved, self.budget.budget_bytes)
        return self.metrics.render()

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        return http_response(connection, request, self.health, self.scrape)

    # -- serving -----------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Graceful shutdown (SIGTERM): admit no new connection, let the requests being computed finish
        and answer, tell every edge GOING_AWAY (so it fails over at once), then stop the server."""
        if self.servicer.draining:
            return
        log.info("shutting down: draining %d connection(s)", len(self.servicer.connections))
        if self.listener is not None:
            self.listener.close(close_connections=False)  # stop admitting
        await self.servicer.drain(self.limits.drain_timeout_s)
        if self._stop is not None:
            self._stop.set()

    async def expire_loop(self) -> None:
        """Free the sessions idle for `ServerLimits.idle_timeout_s` (checked every quarter of it, at most
        every 30 s); they are preempted: their edges replay when they come back."""
        if not self.limits.idle_timeout_s:
            return
        while True:
            await asyncio.sleep(min(30.0, max(0.05, self.limits.idle_timeout_s / 4)))
            if n := self.sessions.expire():
                log.info("freed %d idle session(s)", n)

    async def trim_loop(self) -> None:
        """Every `ServerLimits.malloc_trim_s`: the allocator's free memory back to the system
        (`cloud.memory`), on the codec pool (it takes the allocator's locks for a few ms)."""
        if not self.limits.malloc_trim_s or not trim_available():
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.limits.malloc_trim_s)
            await loop.run_in_executor(self.codec.pool, malloc_trim)
            self.metrics.count_trim()

    async def serve(
        self, host: str, port: int, started: threading.Event | None = None, stop: asyncio.Event | None = None
    ) -> None:
        ping = self.limits.ping_interval_s
        self._stop = stop = stop if stop is not None else asyncio.Event()
        async with serve(
            self.servicer.serve,
            host,
            port,
            max_size=self.limits.max_frame_bytes,
            compression=None,
            process_request=self.process_request,
            ping_interval=ping,
            ping_timeout=ping,
            open_timeout=self.limits.upgrade_timeout_s,
            ssl=self.ssl_context,
        ) as server:
            if threading.current_thread() is threading.main_thread():  # `splitlm serve-cloud`: SIGTERM drains
                asyncio.get_running_loop().add_signal_handler(
                    signal.SIGTERM, lambda: asyncio.ensure_future(self.drain())
                )
            self.listener = server
            self.port = server.sockets[0].getsockname()[1]
            expiry = asyncio.create_task(self.expire_loop())
            trimming = asyncio.create_task(self.trim_loop())
            self.log_serving(host)
            if started is not None:
                started.set()
            try:
                await stop.wait()
            finally:
                expiry.cancel()
                trimming.cancel()
                self.scheduler.close()
                self.codec.shutdown()

    def log_serving(self, host: str) -> None:
        scheme = "wss" if self.ssl_context else "ws"
        log.info(
            "serving %s (layers [%d,%d), fingerprint %s) on %s on %s://%s:%d",
            self.manifest.role,
            *self.manifest.cloud_layers,
            self.manifest.fingerprint,
            describe(self.device, self.dtype),
            scheme,
            host,
            self.port,
        )
        log.info(
            "KV budget %.1f MiB (%d bytes per entry: %d entries in all)",
            self.budget.budget_bytes / 2**20,
            self.budget.bytes_per_entry,
            self.budget.entries,
        )
        log.info("cloud identity %s (%s)", self.fingerprint, self.identity.path or "in memory")
        if self.allowed is None:
            log.warning("no allow-list of clients (--clients): any client may connect (still encrypted)")
        else:
            log.info(
                "%d allowed client key(s)%s",
                len(self.allowed),
                f" from {self.allowed.path}" if self.allowed.path else "",
            )


class BackgroundServer:
    """Run a CloudServer on its own event loop in a daemon thread (tests, demo, benchmarks)."""

    def __init__(
        self,
        shard_dir: str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        limits: ServerLimits | None = None,
        server_cls: type[CloudServer] | None = None,
        ray=None,
        **settings,
    ):
        """`settings`: the fields of `ServerSettings` (identity, allowed_clients, tls_cert, tls_key, rekey,
        batch, device, dtype); `server_cls` defaults to CloudServer, e.g. `cloud.ray_cloud.RayFrontDoor`
        with its `ray` (a `RayConfig`)."""
        extra = {} if ray is None else {"ray": ray}
        self.server = (server_cls or CloudServer)(shard_dir, limits, ServerSettings(**settings), **extra)
        self.host, self._port = host, port
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="splitlm-cloud")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._stop = asyncio.Event()
        self.loop.run_until_complete(self.server.serve(self.host, self._port, self._started, self._stop))

    def __enter__(self) -> BackgroundServer:
        self._started = threading.Event()
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("cloud server did not start")
        return self

    @property
    def url(self) -> str:
        return f"{'wss' if self.server.ssl_context else 'ws'}://{self.host}:{self.server.port}"

    @property
    def fingerprint(self) -> str:
        return self.server.fingerprint

    def drain(self) -> None:
        """Shut down gracefully, as on SIGTERM (`CloudServer.drain`), and wait until it has stopped."""
        asyncio.run_coroutine_threadsafe(self.server.drain(), self.loop).result(60)
        self._thread.join(10)

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
