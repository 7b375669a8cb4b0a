"""The cloud server: asyncio + websockets, many sessions, compute off the event loop.

Plain HTTP `GET /healthz` on the same port answers `ok` with the shard fingerprint.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from pathlib import Path

import torch
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitlm import __version__
from splitlm.cloud.sessions import ForwardRequest, ServerLimits, SessionTable, run_forward, validate
from splitlm.model.shards import load_cloud
from splitlm.transport.codecs import WIRE_DTYPES
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    VERSION,
    Frame,
    MsgType,
    decode_frame,
    encode_frame,
    error_frame,
    pack_tensors,
    unpack_mask,
    unpack_tensors,
)

log = logging.getLogger("splitlm.cloud")


def int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a list of integers")
    return value


class Connection:
    """Per-connection protocol state: handshake done, sequence numbers in both directions."""

    def __init__(self, conn_id: int, ws: ServerConnection):
        self.id, self.ws = conn_id, ws
        self.ready = False
        self.last_seq_in = 0
        self.seq_out = itertools.count(1)

    async def send(self, frame: Frame) -> None:
        frame.seq = next(self.seq_out)
        await self.ws.send(encode_frame(frame))


class CloudServer:
    def __init__(self, shard_dir: str | Path, limits: ServerLimits | None = None):
        self.model = load_cloud(shard_dir)
        self.manifest = self.model.manifest
        self.limits = limits or ServerLimits()
        self.sessions = SessionTable(self.limits)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splitlm-compute")
        self.conn_ids = itertools.count(1)
        self.stats = {"connections": 0, "forwards": 0, "tokens": 0, "errors": 0}

    # -- HTTP ------------------------------------------------------------------------------------
    def process_request(self, connection: ServerConnection, request):
        if request.path == "/healthz":
            return connection.respond(HTTPStatus.OK, f"ok {self.manifest.fingerprint}\n")
        return None

    # -- WebSocket ---------------------------------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        conn = Connection(next(self.conn_ids), ws)
        self.stats["connections"] += 1
        try:
            deadline = asyncio.get_running_loop().time() + self.limits.hello_timeout_s
            while not conn.ready:  # the handshake must complete in time, whatever arrives first
                remaining = deadline - asyncio.get_running_loop().time()
                await self.dispatch(conn, await asyncio.wait_for(ws.recv(), max(remaining, 0.001)))
            async for data in ws:
                await self.dispatch(conn, data)
        except (TimeoutError, asyncio.TimeoutError):
            await self.send_error(conn, ProtocolError(ErrorCode.NOT_READY, "no HELLO within the handshake timeout"))
            await ws.close()
        except ConnectionClosed:
            pass
        finally:
            self.sessions.drop_owner(conn.id)

    async def send_error(self, conn: Connection, err: ProtocolError, session: int = 0, ref: int | None = None) -> None:
        self.stats["errors"] += 1
        log.info("conn %d: %s", conn.id, err)
        try:
            await conn.send(error_frame(err, session, ref=ref))
        except ConnectionClosed:
            pass

    async def dispatch(self, conn: Connection, data: bytes | str) -> None:
        ref, session = None, 0
        try:
            frame = decode_frame(data)
            ref, session = frame.seq, frame.session
            if frame.seq <= conn.last_seq_in:
                raise ProtocolError(ErrorCode.BAD_FRAME, f"sequence number {frame.seq} is not increasing")
            conn.last_seq_in = frame.seq
            reply = await self.handle(conn, frame)
            reply.meta["ref"] = frame.seq
            await conn.send(reply)
        except ProtocolError as err:
            await self.send_error(conn, err, session, ref)
            if err.code in (ErrorCode.VERSION_MISMATCH, ErrorCode.FINGERPRINT_MISMATCH):
                await conn.ws.close()
        except ConnectionClosed:
            raise
        except Exception as e:  # a bug must not take the server down
            log.exception("conn %d: internal error", conn.id)
            await self.send_error(conn, ProtocolError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}"),
                                  session, ref)

    async def handle(self, conn: Connection, frame: Frame) -> Frame:
        if frame.type == MsgType.HELLO:
            return self.hello(conn, frame)
        if not conn.ready:
            raise ProtocolError(ErrorCode.NOT_READY, "send HELLO first")
        if frame.type == MsgType.OPEN:
            wire = frame.meta.get("wire_dtype", "fp16")
            if not isinstance(wire, str) or wire not in WIRE_DTYPES:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown wire dtype {wire!r}")
            s = self.sessions.open(conn.id, wire, len(self.model.middle.layers))
            return Frame(MsgType.OPENED, s.id, meta={"wire_dtype": wire})
        if frame.type == MsgType.FORWARD:
            return await self.forward(conn, frame)
        if frame.type == MsgType.CLOSE:
            self.sessions.close(frame.session, conn.id)
            return Frame(MsgType.CLOSED, frame.session)
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected message {frame.type.name}")

    def hello(self, conn: Connection, frame: Frame) -> Frame:
        if frame.meta.get("version") != VERSION:
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"edge speaks version {frame.meta.get('version')}, cloud {VERSION}")
        if frame.meta.get("fingerprint") != self.manifest.fingerprint:
            raise ProtocolError(ErrorCode.FINGERPRINT_MISMATCH,
                                "the edge shard and the cloud shard come from different splits "
                                f"(cloud fingerprint {self.manifest.fingerprint})")
        conn.ready = True
        lim = self.limits
        return Frame(MsgType.HELLO_OK, meta={
            "server": f"splitlm/{__version__}", "fingerprint": self.manifest.fingerprint,
            "limits": {"max_tokens_per_session": lim.max_tokens_per_session,
                       "max_tokens_per_forward": lim.max_tokens_per_forward, "max_frame_bytes": lim.max_frame_bytes}})

    async def forward(self, conn: Connection, frame: Frame) -> Frame:
        session = self.sessions.get(frame.session, conn.id)
        meta = frame.meta
        max_elems = self.limits.max_tokens_per_forward * self.model.cfg.hidden_size
        tensors = unpack_tensors(frame, max_elems)
        if "hidden" not in tensors:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "FORWARD carries no 'hidden' tensor")
        hidden = tensors["hidden"]
        t = hidden.shape[0] if hidden.dim() else 0
        positions = torch.tensor(int_list(meta.get("positions"), "positions"), dtype=torch.long)
        keep = None if meta.get("keep") is None else int_list(meta["keep"], "keep")
        crop = meta.get("crop")
        if crop is not None and type(crop) is not int:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "crop must be an integer")
        mask = None if meta.get("mask") is None else unpack_mask(meta["mask"], t)
        req = ForwardRequest(hidden, positions, mask, keep, crop)
        validate(req, session, self.model, self.limits)
        start = time.perf_counter()
        out = await asyncio.get_running_loop().run_in_executor(self.executor, run_forward, self.model, session, req)
        compute_s = time.perf_counter() - start
        self.stats["forwards"] += 1
        self.stats["tokens"] += t
        specs, payload = pack_tensors({"hidden": out}, session.wire_dtype)
        return Frame(MsgType.RESULT, session.id, meta={"tensors": specs, "compute_s": compute_s,
                                                       "cache_len": session.cache.length}, payload=payload)

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, max(0.5, self.limits.idle_timeout_s / 4)))
            if n := self.sessions.expire():
                log.info("expired %d idle session(s)", n)

    async def serve(self, host: str, port: int, started: threading.Event | None = None,
                    stop: asyncio.Event | None = None) -> None:
        async with serve(self.handler, host, port, max_size=self.limits.max_frame_bytes, compression=None,
                         process_request=self.process_request, ping_interval=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            expiry = asyncio.create_task(self.expire_loop())
            log.info("serving %s (layers [%d,%d), fingerprint %s) on ws://%s:%d", self.manifest.role,
                     *self.manifest.cloud_layers, self.manifest.fingerprint, host, self.port)
            if started is not None:
                started.set()
            try:
                await (stop.wait() if stop is not None else asyncio.Future())
            finally:
                expiry.cancel()


class BackgroundServer:
    """Run a CloudServer on its own event loop in a daemon thread (tests, demo, benchmarks)."""

    def __init__(self, shard_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits | None = None):
        self.server = CloudServer(shard_dir, limits)
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
        return f"ws://{self.host}:{self.server.port}"

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
