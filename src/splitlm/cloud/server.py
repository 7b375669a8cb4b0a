"""The cloud server: asyncio + websockets, many sessions, compute off the event loop.

Every connection starts with the HELLO / HELLO_OK handshake (`splitlm.transport.handshake`);
after it every frame in both directions is AES-256-GCM encrypted (`splitlm.transport.crypto`).
Plain HTTP `GET /healthz` on the same port answers `ok` with the shard fingerprint, the device and the
dtype, `GET /metrics`
the server's metrics in the Prometheus text format.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitlm import SplitLMError, __version__
from splitlm.cloud.budget import KVBudget
from splitlm.cloud.scheduler import BatchConfig, Scheduler
from splitlm.cloud.sessions import ServerLimits, SessionTable, validate
from splitlm.model.device import describe, dtype_name, resolve_device, resolve_dtype, to_device
from splitlm.model.shards import load_cloud
from splitlm.transport.crypto import Channel, RekeyPolicy, ReplayWindow
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    HEADER_SIZE,
    VERSION,
    Frame,
    MsgType,
    decode_body,
    decode_header,
    encode_frame,
    error_frame,
    unpack_vocab,
)
from splitlm.transport.handshake import hello_keys, server_handshake
from splitlm.transport.keys import AllowedClients, Identity, fingerprint, resolve_identity
from splitlm.transport.messages import (
    Closed,
    Forward,
    GoingAway,
    Limits,
    Open,
    Opened,
    PolicyChange,
    PolicyOk,
    Result,
    ServerInfo,
)

log = logging.getLogger(__name__)

disable_created_metrics()  # no *_created series: the counters' start times are noise on a dashboard
SECOND_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# frames (and tensor payloads) from this size on are decrypted, decoded, validated, encoded and sealed
# on the codec pool, not on the event loop (smaller ones cost less than the thread hop)
OFFLOAD_BYTES = 64 * 2**10
CODEC_THREADS = 2

# errors after which the connection is closed (the ERROR frame is sent first); VERSION_MISMATCH only
# before the handshake (afterwards an unauthenticated frame must not be able to end the connection)
CLOSING = {ErrorCode.VERSION_MISMATCH, ErrorCode.FINGERPRINT_MISMATCH, ErrorCode.AUTH_FAILED,
           ErrorCode.UNKNOWN_CLIENT}
# errors that count towards ServerLimits.max_bad_frames (frames that fail below the request level)
BAD_FRAME_CODES = {ErrorCode.BAD_FRAME, ErrorCode.VERSION_MISMATCH, ErrorCode.NOT_READY, ErrorCode.NOT_ENCRYPTED,
                   ErrorCode.DECRYPT_FAILED, ErrorCode.REPLAY, ErrorCode.OUT_OF_ORDER}


class Connection:
    """Per-connection protocol state: handshake, keys, the authenticated client, sequence numbers."""

    def __init__(self, conn_id: int, ws: ServerConnection):
        self.id, self.ws = conn_id, ws
        self.window = ReplayWindow()  # incoming sequence numbers (HELLO's, then the channel's)
        self.seq_out = itertools.count(1)
        self.channel: Channel | None = None  # set by a successful HELLO
        self.client_key: bytes | None = None  # the client's static public key (announced in HELLO)
        self.client = "?"  # its fingerprint, for the log
        self.authenticated = False  # the client proved it holds the key (a frame decrypted)
        self.bad_frames = 0
        self.busy = False  # a request is being handled (a draining server lets it finish)
        self.gone = False  # told GOING_AWAY (or closing): no more requests are handled

    @property
    def ready(self) -> bool:
        return self.channel is not None

    async def send(self, frame: Frame, plaintext: bool = False, codec: ThreadPoolExecutor | None = None) -> None:
        """Number, seal and send a frame; with `codec`, a large one is sealed on that pool (the
        connection's frames are still sealed one at a time, in order)."""
        frame.seq = next(self.seq_out)
        if self.channel is not None and not plaintext:
            if codec is not None and len(frame.payload) >= OFFLOAD_BYTES:
                data = await asyncio.get_running_loop().run_in_executor(codec, self.channel.seal, frame)
            else:
                data = self.channel.seal(frame)
            await self.ws.send(data)
        else:
            await self.ws.send(encode_frame(frame))


class CloudMetrics:
    """What `GET /metrics` reports (no label carries a key, a session id or any tensor data); a
    `prometheus_client` registry of its own, so that servers in one process never share counts."""

    def __init__(self):
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

    def on_pass(self, sessions: int, rows: int, seconds: float) -> None:
        self.batch_size.observe(sessions)
        self.batch_rows.observe(rows)
        self.pass_seconds.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CloudServer:
    """The cloud.

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

    def __init__(self, shard_dir: str | Path, limits: ServerLimits | None = None, *,
                 device: str = "auto", dtype: str = "auto",
                 identity: Identity | str | Path | None = None,
                 allowed_clients: str | Path | list | AllowedClients | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
                 rekey: RekeyPolicy | None = None, batch: BatchConfig | None = None):
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = self.load_model(shard_dir)
        self.manifest = self.model.manifest
        self.limits = limits or ServerLimits()
        self.budget = KVBudget.for_model(self.model, self.limits.kv_budget_bytes)
        self.sessions = SessionTable(self.limits, self.budget)
        self.conn_ids = itertools.count(1)
        self.stats = {"connections": 0, "forwards": 0, "tokens": 0, "errors": 0}
        self.metrics = CloudMetrics()
        self.scheduler = Scheduler(self.model, batch, self.metrics.on_pass)
        self.codec = ThreadPoolExecutor(CODEC_THREADS, thread_name_prefix="splitlm-codec")
        self.identity = resolve_identity(identity, "cloud")
        self.allowed = (allowed_clients if isinstance(allowed_clients, AllowedClients) or allowed_clients is None
                        else AllowedClients(allowed_clients))
        self.rekey = rekey
        self.ssl_context = self._tls(tls_cert, tls_key)
        self.connections: dict[int, Connection] = {}
        self.draining = False
        self.listener = None  # the websockets server, while serving
        self._stop: asyncio.Event | None = None

    def load_model(self, shard_dir: str | Path):
        """The layers this server runs (a Ray replica's stage 0 and the Ray front door override it)."""
        return load_cloud(shard_dir, self.device, self.dtype)

    @staticmethod
    def _tls(cert: str | Path | None, key: str | Path | None) -> ssl.SSLContext | None:
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise SplitLMError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as e:
            raise SplitLMError(f"cannot load the TLS certificate {cert} / key {key}: {e}") from None
        return context

    @property
    def public_key(self) -> bytes:
        return self.identity.public_bytes

    @property
    def fingerprint(self) -> str:
        """The server's identity fingerprint (what edges pin with --cloud-key)."""
        return self.identity.fingerprint

    # -- HTTP ------------------------------------------------------------------------------------
    def process_request(self, connection: ServerConnection, request):
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, f"ok {self.manifest.fingerprint} device={self.device} "
                                                     f"dtype={dtype_name(self.dtype)}\n")
        if request.path == "/metrics":
            self.metrics.sessions.set(len(self.sessions.sessions))
            self.metrics.kv_reserved.set(self.sessions.kv_reserved)
            self.metrics.kv_budget.set(self.budget.budget_bytes)
            response = connection.respond(HTTPStatus.OK, self.metrics.render().decode())
            del response.headers["Content-Type"]  # Headers is a multi-dict: replace, not add
            response.headers["Content-Type"] = CONTENT_TYPE_LATEST
            return response
        return None

    # -- WebSocket ---------------------------------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        conn = Connection(next(self.conn_ids), ws)
        if self.draining:
            await ws.close(1001, "going away")
            return
        self.connections[conn.id] = conn
        self.stats["connections"] += 1
        self.metrics.connections.inc()
        try:
            deadline = asyncio.get_running_loop().time() + self.limits.hello_timeout_s
            while not conn.ready:  # the handshake must complete in time, whatever arrives first
                remaining = deadline - asyncio.get_running_loop().time()
                await self.dispatch(conn, await asyncio.wait_for(ws.recv(), max(remaining, 0.001)))
            while True:  # a connection silent for the idle timeout is closed (its sessions expire too)
                try:
                    data = await asyncio.wait_for(ws.recv(), self.limits.idle_timeout_s)
                except (TimeoutError, asyncio.TimeoutError):
                    await self.close(conn, "idle timeout")
                    return
                if conn.gone:
                    return
                conn.busy = True
                try:
                    await self.dispatch(conn, data)
                finally:
                    conn.busy = False
                if self.draining:
                    await self.going_away(conn)
                    return
        except (TimeoutError, asyncio.TimeoutError):
            await self.send_error(conn, ProtocolError(ErrorCode.NOT_READY, "no HELLO within the handshake timeout"))
            await self.close(conn, "handshake timeout")
        except ConnectionClosed:
            pass
        finally:
            self.connections.pop(conn.id, None)
            self.sessions.drop_connection(conn.id)

    async def going_away(self, conn: Connection) -> None:
        """Tell the edge this server is shutting down (GOING_AWAY, encrypted) and close the connection."""
        if conn.gone:
            return
        conn.gone = True
        try:
            if conn.ready:
                await conn.send(GoingAway().to_frame())
            await conn.ws.close(1001, "going away")
        except ConnectionClosed:
            pass

    async def drain(self) -> None:
        """Graceful shutdown (SIGTERM): admit no new connection, let the requests being computed finish
        and answer, tell every edge GOING_AWAY (so it fails over at once), then stop the server."""
        if self.draining:
            return
        self.draining = True
        log.info("shutting down: draining %d connection(s)", len(self.connections))
        if self.listener is not None:
            self.listener.close(close_connections=False)  # stop admitting
        for conn in list(self.connections.values()):
            if not conn.busy:  # a busy one is told after its reply (`handler`)
                await self.going_away(conn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.drain_timeout_s
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self._stop is not None:
            self._stop.set()

    async def close(self, conn: Connection, reason: str) -> None:
        log.info("conn %d (client %s): closing: %s", conn.id, conn.client, reason)
        normal = reason in ("handshake timeout", "idle timeout")
        await conn.ws.close(1000 if normal else 1008, reason[:120])

    async def send_error(self, conn: Connection, err: ProtocolError, session: int = 0, ref: int | None = None,
                         plaintext: bool = False) -> None:
        self.stats["errors"] += 1
        self.metrics.errors.labels(code=err.code.name).inc()
        log.info("conn %d (client %s): %s", conn.id, conn.client, err)  # messages never hold tensor data
        try:
            await conn.send(error_frame(err, session, ref=ref), plaintext)
        except ConnectionClosed:
            pass

    def _decode(self, conn: Connection, data: bytes | str) -> Frame:
        """Check, authenticate and decode one incoming message (raises ProtocolError)."""
        if conn.channel is None:  # before the handshake: plaintext HELLO only
            header = decode_header(data)
            if header.flags & FLAG_ENCRYPTED:
                raise ProtocolError(ErrorCode.NOT_READY, "encrypted frame before the handshake")
            frame = decode_body(header, memoryview(data)[HEADER_SIZE:])
            conn.window.accept(frame.seq)
            if frame.type != MsgType.HELLO:
                raise ProtocolError(ErrorCode.NOT_READY, "send HELLO first")
            return frame
        try:
            frame = conn.channel.open(data)
        except ProtocolError as err:
            if err.code == ErrorCode.DECRYPT_FAILED and not conn.authenticated:
                raise ProtocolError(ErrorCode.AUTH_FAILED, "the first encrypted frame did not decrypt: the client "
                                    f"does not hold the private key of {conn.client}") from None
            raise
        if not conn.authenticated:
            conn.authenticated = True
            log.info("conn %d: client %s authenticated", conn.id, conn.client)
        return frame

    async def dispatch(self, conn: Connection, data: bytes | str) -> None:
        ref, session = None, 0
        try:
            try:  # header fields for the ERROR's ref and session (unauthenticated if the frame was rejected)
                header = decode_header(data)
                ref, session = header.seq, header.session
            except ProtocolError:
                pass
            frame = await self.offload(len(data), self._decode, conn, data)
            if frame.type == MsgType.HELLO:
                if conn.channel is not None:
                    raise ProtocolError(ErrorCode.BAD_REQUEST, "the handshake is already done")
                await self.hello(conn, frame, data)
                return
            start = time.perf_counter()
            reply = await self.handle(conn, frame)
            reply.meta["ref"] = frame.seq
            await conn.send(reply, codec=self.codec)
            self.metrics.requests.labels(type=frame.type.name).inc()
            self.metrics.request_seconds.labels(type=frame.type.name).observe(time.perf_counter() - start)
        except ProtocolError as err:
            # AUTH_FAILED after HELLO goes out in the clear: the client's keys differ from ours
            plaintext = conn.channel is not None and not conn.authenticated and err.code == ErrorCode.AUTH_FAILED
            await self.send_error(conn, err, session, ref, plaintext)
            if err.code in CLOSING and not (err.code == ErrorCode.VERSION_MISMATCH and conn.ready):
                await self.close(conn, err.code.name)
            elif err.code in BAD_FRAME_CODES:
                conn.bad_frames += 1
                if conn.bad_frames >= self.limits.max_bad_frames:
                    await self.close(conn, f"{conn.bad_frames} bad frames")
        except ConnectionClosed:
            raise
        except Exception as e:  # a bug must not take the server down
            log.exception("conn %d: internal error", conn.id)
            await self.send_error(conn, ProtocolError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}"),
                                  session, ref)

    async def handle(self, conn: Connection, frame: Frame) -> Frame:
        owner = conn.client_key
        if frame.type == MsgType.OPEN:
            req = Open.from_frame(frame)
            vocab = self.parse_vocab(req.vocab)
            s = self.sessions.open(owner, req.wire_dtype, len(self.model.middle.layers), conn.id, req.cache_policy)
            s.vocab = None if vocab is None else to_device(vocab, self.device)
            vocab_size = None
            if self.model.split_head:
                vocab_size = self.model.cfg.vocab_size if vocab is None else vocab.numel()
            return Opened(s.id, req.wire_dtype, req.cache_policy, self.manifest.topology, vocab_size).to_frame()
        if frame.type == MsgType.FORWARD:
            return await self.forward(conn, frame)
        if frame.type == MsgType.POLICY:
            return self.policy(conn, frame)
        if frame.type == MsgType.CLOSE:
            self.sessions.close(frame.session, owner, conn.id)
            return Closed(frame.session).to_frame()
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected message {frame.type.name}")

    def parse_vocab(self, value) -> torch.Tensor | None:
        """OPEN's `vocab` (packed bits of the authorised ids): split-head clouds only; None = every id."""
        if value is None:
            return None
        if not self.model.split_head:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "vocab only applies to a split-head cloud (this one holds no "
                                                       "part of the LM head)")
        return unpack_vocab(value, self.model.cfg.vocab_size)

    def policy(self, conn: Connection, frame: Frame) -> Frame:
        """Tighten a session's cache policy and/or revoke (wipe) its cache now."""
        session = self.sessions.get(frame.session, conn.client_key, conn.id)
        req = PolicyChange.from_frame(frame)
        if req.cache_policy is not None:
            session.tighten(req.cache_policy, req.key)
        if req.revoke:
            session.wipe()
        return PolicyOk(session.id, session.policy, session.cache_shape[0]).to_frame()

    async def hello(self, conn: Connection, frame: Frame, data: bytes) -> None:
        if frame.meta.get("version") != VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"edge speaks version {frame.meta.get('version')}, cloud {VERSION}")
        if frame.meta.get("fingerprint") != self.manifest.fingerprint:
            raise ProtocolError(ErrorCode.FINGERPRINT_MISMATCH,
                                "the edge shard and the cloud shard come from different splits "
                                f"(cloud fingerprint {self.manifest.fingerprint})")
        _, client_key = hello_keys(frame)
        conn.client = fingerprint(client_key)
        if self.allowed is not None and client_key not in self.allowed:
            raise ProtocolError(ErrorCode.UNKNOWN_CLIENT, f"client key {conn.client} is not on this cloud's list of "
                                "allowed clients (ask its operator to add your .pub file)")
        lim = self.limits
        info = ServerInfo(f"splitlm/{__version__}", self.manifest.fingerprint,
                          Limits(lim.max_tokens_per_session, lim.max_tokens_per_forward, lim.max_frame_bytes,
                                 self.scheduler.config.prefill_chunk)).to_meta()
        ok, channel, _ = server_handshake(self.identity, frame, data, info, next(conn.seq_out), self.rekey, conn.window)
        conn.channel, conn.client_key = channel, client_key
        log.info("conn %d: HELLO from client %s", conn.id, conn.client)
        await conn.ws.send(ok)

    async def offload(self, size: int, fn, *args):
        """fn(*args) on the codec pool when `size` (bytes) is large, else here on the event loop."""
        if size < OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.codec, fn, *args)

    def parse_forward(self, session, frame: Frame) -> tuple[Forward, int]:
        """The request, checked (`validate`); with the entries its cache holds during the pass."""
        max_elems = self.limits.max_tokens_per_forward * self.model.cfg.hidden_size  # context rows included
        req = Forward.from_frame(frame, max_elems)
        return req, validate(req, session, self.model, self.limits)

    async def forward(self, conn: Connection, frame: Frame) -> Frame:
        session = self.sessions.get(frame.session, conn.client_key, conn.id)
        req, entries = await self.offload(len(frame.payload), self.parse_forward, session, frame)
        t = req.new_tokens
        if self.model.split_head:
            self.check_reply_size(session, t if req.rows is None else len(req.rows), req.control.dtype)
        self.sessions.reserve(session, entries)  # CAPACITY when the KV budget cannot hold the step
        try:
            done = await self.scheduler.run(session, req)
        finally:
            self.sessions.settle(session)
        self.stats["forwards"] += 1
        self.stats["tokens"] += t
        self.metrics.round_trips.inc()
        self.metrics.tokens.inc(t)
        self.metrics.tokens_per_round_trip.observe(t)
        self.metrics.compute_seconds.observe(done.compute_s)
        self.metrics.queue_seconds.observe(done.queue_s)
        result = Result(session.id, done.tensors, session.cache_shape[0], done.compute_s, done.queue_s)
        try:
            return await self.offload(sum(x.nbytes for x in done.tensors.values()), result.to_frame,
                                      req.control.dtype or session.wire_dtype)
        except OverflowError as e:  # the session's cache is intact; the edge may reopen with bf16
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None

    def check_reply_size(self, session, rows: int, dtype: str | None) -> None:
        """A split-head RESULT holds `rows` × (d + S) values: refuse one over max_frame_bytes before computing."""
        from splitlm.transport.codecs import wire_nbytes

        s = self.model.cfg.vocab_size if session.vocab is None else session.vocab.numel()
        dtype = dtype or session.wire_dtype
        size = wire_nbytes(dtype, [rows, s]) + wire_nbytes(dtype, [rows, self.manifest.d_end])
        if size + 4096 > self.limits.max_frame_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"logits for {rows} rows ({size} bytes) exceed the frame limit of "
                                                     f"{self.limits.max_frame_bytes} bytes; ask for fewer rows")

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, max(0.5, self.limits.idle_timeout_s / 4)))
            if n := self.sessions.expire():
                log.info("expired %d idle session(s)", n)

    async def serve(self, host: str, port: int, started: threading.Event | None = None,
                    stop: asyncio.Event | None = None) -> None:
        ping = self.limits.ping_interval_s
        self._stop = stop = stop if stop is not None else asyncio.Event()
        async with serve(self.handler, host, port, max_size=self.limits.max_frame_bytes, compression=None,
                         process_request=self.process_request, ping_interval=ping, ping_timeout=ping,
                         ssl=self.ssl_context) as server:
            if threading.current_thread() is threading.main_thread():  # `splitlm serve-cloud`: SIGTERM drains
                asyncio.get_running_loop().add_signal_handler(
                    signal.SIGTERM, lambda: asyncio.ensure_future(self.drain()))
            self.listener = server
            self.port = server.sockets[0].getsockname()[1]
            expiry = asyncio.create_task(self.expire_loop())
            scheme = "wss" if self.ssl_context else "ws"
            log.info("serving %s (layers [%d,%d), fingerprint %s) on %s on %s://%s:%d", self.manifest.role,
                     *self.manifest.cloud_layers, self.manifest.fingerprint, describe(self.device, self.dtype),
                     scheme, host, self.port)
            log.info("KV budget %.1f MiB (%d bytes per entry: %d entries in all)", self.budget.budget_bytes / 2**20,
                     self.budget.bytes_per_entry, self.budget.entries)
            log.info("cloud identity %s (%s)", self.fingerprint,
                     self.identity.path or "in memory")
            if self.allowed is None:
                log.warning("no allow-list of clients (--clients): any client may connect (still encrypted)")
            else:
                log.info("%d allowed client key(s)%s", len(self.allowed),
                         f" from {self.allowed.path}" if self.allowed.path else "")
            if started is not None:
                started.set()
            try:
                await stop.wait()
            finally:
                expiry.cancel()
                self.scheduler.close()
                self.codec.shutdown(wait=False)


class BackgroundServer:
    """Run a CloudServer on its own event loop in a daemon thread (tests, demo, benchmarks)."""

    def __init__(self, shard_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits | None = None, server_cls: type[CloudServer] | None = None, **security):
        """`security`: the server class's keyword arguments (identity, allowed_clients, tls_cert, tls_key, rekey,
        batch; `server_cls` defaults to CloudServer, e.g. `cloud.ray_cloud.RayFrontDoor` with its `ray`)."""
        self.server = (server_cls or CloudServer)(shard_dir, limits, **security)
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
