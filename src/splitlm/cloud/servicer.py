"""The WebSocket servicer: one connection's protocol. Frames in -> decrypt, authenticate, decode ->
the handler the request table names -> frames out; ERROR frames, bad-frame counting, the handshake
deadline, the idle timeout, and GOING_AWAY when the server drains.

Every connection starts with the HELLO / HELLO_OK handshake (`splitlm.transport.handshake`); after it
every frame in both directions is AES-256-GCM encrypted (`splitlm.transport.crypto`). What a request
does is not decided here: `request_table` maps each message type to its handler, the single-process
cloud's (`cloud.handlers`) or the Ray front door's (`cloud.ray_cloud`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from splitlm.cloud.metrics import CloudMetrics
from splitlm.cloud.sessions import ServerLimits
from splitlm.transport.crypto import Channel, RekeyPolicy, ReplayWindow
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    HEADER_SIZE,
    Frame,
    MsgType,
    decode_body,
    decode_header,
    encode_frame,
)
from splitlm.transport.handshake import server_handshake
from splitlm.transport.hello import Hello, ServerInfo
from splitlm.transport.keys import AllowedClients, Identity, fingerprint
from splitlm.transport.messages import ErrorReply, GoingAway, answering

log = logging.getLogger(__name__)

# frames (and tensor payloads) from this size on are decrypted, decoded, validated, encoded and sealed
# on the codec pool, not on the event loop (smaller ones cost less than the thread hop)
OFFLOAD_BYTES = 64 * 2**10
CODEC_THREADS = 2

# errors after which the connection is closed (the ERROR frame is sent first); VERSION_MISMATCH only
# before the handshake (afterwards an unauthenticated frame must not be able to end the connection)
CLOSING = {ErrorCode.VERSION_MISMATCH, ErrorCode.FINGERPRINT_MISMATCH, ErrorCode.AUTH_FAILED, ErrorCode.UNKNOWN_CLIENT}
# errors that count towards ServerLimits.max_bad_frames (frames that fail below the request level)
BAD_FRAME_CODES = {
    ErrorCode.BAD_FRAME,
    ErrorCode.VERSION_MISMATCH,
    ErrorCode.NOT_READY,
    ErrorCode.NOT_ENCRYPTED,
    ErrorCode.DECRYPT_FAILED,
    ErrorCode.REPLAY,
    ErrorCode.OUT_OF_ORDER,
}


class CodecPool:
    """The threads that decrypt, decode, validate, encode and seal large frames off the event loop."""

    def __init__(self, threads: int = CODEC_THREADS):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="splitlm-codec")

    async def run(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the pool when `size` (bytes) is large, else here on the event loop."""
        if size < OFFLOAD_BYTES:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False)


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

    async def send(self, frame: Frame, plaintext: bool = False, codec: CodecPool | None = None) -> None:
        """Number, seal and send a frame; with `codec`, a large one is sealed on that pool (the
        connection's frames are still sealed one at a time, in order)."""
        frame.seq = next(self.seq_out)
        if self.channel is not None and not plaintext:
            if codec is not None:
                data = await codec.run(len(frame.payload), self.channel.seal, frame)
            else:
                data = self.channel.seal(frame)
            await self.ws.send(data)
        else:
            await self.ws.send(encode_frame(frame))

    def decode(self, data: bytes | str) -> Frame:
        """Check, authenticate and decode one incoming message (raises ProtocolError)."""
        if self.channel is None:  # before the handshake: plaintext HELLO only
            header = decode_header(data)
            if header.flags & FLAG_ENCRYPTED:
                raise ProtocolError(ErrorCode.NOT_READY, "encrypted frame before the handshake")
            frame = decode_body(header, memoryview(data)[HEADER_SIZE:])
            self.window.accept(frame.seq)
            if frame.type != MsgType.HELLO:
                raise ProtocolError(ErrorCode.NOT_READY, "send HELLO first")
            return frame
        try:
            frame = self.channel.open(data)
        except ProtocolError as err:
            if err.code == ErrorCode.DECRYPT_FAILED and not self.authenticated:
                raise ProtocolError(
                    ErrorCode.AUTH_FAILED,
                    "the first encrypted frame did not decrypt: the client "
                    f"does not hold the private key of {self.client}",
                ) from None
            raise
        if not self.authenticated:
            self.authenticated = True
            log.info("conn %d: client %s authenticated", self.id, self.client)
        return frame


class Caller(Protocol):
    """Who sent a request: its connection (a Ray replica's: `front door:connection`) and client key."""

    @property
    def id(self) -> int | str: ...

    @property
    def client_key(self) -> bytes | None: ...


Handler = Callable[[Caller, Frame], Awaitable[Frame]]
RequestTable = dict[MsgType, Handler]


def request_table(on_open: Handler, on_forward: Handler, on_policy: Handler, on_close: Handler) -> RequestTable:
    """The requests an authenticated connection may send, and who answers each: one table for the
    single-process cloud and the Ray front door (any other message type is BAD_REQUEST)."""
    return {MsgType.OPEN: on_open, MsgType.FORWARD: on_forward, MsgType.POLICY: on_policy, MsgType.CLOSE: on_close}


async def answer(table: RequestTable, caller: Caller, frame: Frame) -> Frame:
    """The reply to one decrypted request, by the handler `table` names for its type."""
    handler = table.get(frame.type)
    if handler is None:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"unexpected message {frame.type.name}")
    return await handler(caller, frame)


def reply_address(data: bytes | str) -> tuple[int | None, int]:
    """(seq, session) of a frame's header, for the ERROR's ref and session ((None, 0) when the header
    is unreadable; unauthenticated, if the frame is then rejected)."""
    try:
        header = decode_header(data)
    except ProtocolError:
        return None, 0
    return header.seq, header.session


@dataclass
class HandshakeConfig:
    """What the servicer checks and answers in the handshake (docs/protocol.md §5)."""

    identity: Identity  # the cloud's static key
    info: ServerInfo  # HELLO_OK's encrypted payload; `info.fingerprint` is the cloud shard's
    allowed: AllowedClients | None = None  # the client keys that may connect; None: any
    rekey: RekeyPolicy | None = None  # when this side's sending keys rotate


class Servicer:
    """Serves WebSocket connections: the handshake, then requests answered through `table`.
    `on_closed(conn_id)` runs when a connection ends (its sessions end with it)."""

    def __init__(
        self,
        limits: ServerLimits,
        handshake: HandshakeConfig,
        table: RequestTable,
        metrics: CloudMetrics,
        codec: CodecPool,
        on_closed: Callable[[int], None],
    ):
        self.limits, self.handshake, self.table = limits, handshake, table
        self.metrics, self.codec, self.on_closed = metrics, codec, on_closed
        self.connections: dict[int, Connection] = {}
        self.conn_ids = itertools.count(1)
        self.draining = False  # no new connection; each open one is told GOING_AWAY after its reply

    async def serve(self, ws: ServerConnection) -> None:
        """One connection, from its opening to its end (the websockets server's handler)."""
        conn = Connection(next(self.conn_ids), ws)
        if self.draining:
            await ws.close(1001, "going away")
            return
        self.connections[conn.id] = conn
        self.metrics.count_connection()
        try:
            if await self.handshake_phase(conn):
                await self.request_phase(conn)
        except ConnectionClosed:
            pass
        finally:
            self.connections.pop(conn.id, None)
            self.on_closed(conn.id)

    async def handshake_phase(self, conn: Connection) -> bool:
        """Frames until a HELLO succeeds, which must happen in time, whatever arrives first (False: it
        did not; the connection is closed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.hello_timeout_s
        try:
            while not conn.ready:
                remaining = deadline - loop.time()
                await self.dispatch(conn, await asyncio.wait_for(conn.ws.recv(), max(remaining, 0.001)))
        except (TimeoutError, asyncio.TimeoutError):
            await self.send_error(conn, ProtocolError(ErrorCode.NOT_READY, "no HELLO within the handshake timeout"))
            await self.close(conn, "handshake timeout")
            return False
        return True

    async def request_phase(self, conn: Connection) -> None:
        """Requests until the connection ends; one silent for the connection idle timeout is closed (its
        sessions end with it), and a draining server tells it GOING_AWAY after the reply it is computing."""
        while True:
            try:
                data = await asyncio.wait_for(conn.ws.recv(), self.limits.connection_idle_timeout_s or None)
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

    async def dispatch(self, conn: Connection, data: bytes | str) -> None:
        """One incoming message: answered (HELLO_OK, the request's reply) or refused (ERROR)."""
        ref, session = None, 0
        try:
            ref, session = reply_address(data)
            frame = await self.codec.run(len(data), conn.decode, data)
            if frame.type == MsgType.HELLO:
                await self.hello(conn, frame, data)
            else:
                await self.request(conn, frame)
        except ProtocolError as err:
            await self.refuse(conn, err, session, ref)
        except ConnectionClosed:
            raise
        except Exception as e:  # a bug must not take the server down
            log.exception("conn %d: internal error", conn.id)
            await self.send_error(
                conn, ProtocolError(ErrorCode.INTERNAL, f"internal error: {type(e).__name__}"), session, ref
            )

    async def request(self, conn: Connection, frame: Frame) -> None:
        start = time.perf_counter()
        reply = answering(await answer(self.table, conn, frame), frame.seq)
        await conn.send(reply, codec=self.codec)
        self.metrics.count_request(frame.type, time.perf_counter() - start)

    async def hello(self, conn: Connection, frame: Frame, data: bytes) -> None:
        """The handshake (§5): HELLO checked in order, the allow-list, then HELLO_OK."""
        if conn.channel is not None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "the handshake is already done")
        hs = self.handshake
        hello = Hello.from_frame(frame, hs.info.fingerprint)
        conn.client = fingerprint(hello.static)
        if hs.allowed is not None and hello.static not in hs.allowed:
            raise ProtocolError(
                ErrorCode.UNKNOWN_CLIENT,
                f"client key {conn.client} is not on this cloud's list of "
                "allowed clients (ask its operator to add your .pub file)",
            )
        ok, channel, _ = server_handshake(hs.identity, hello, data, hs.info, next(conn.seq_out), hs.rekey, conn.window)
        conn.channel, conn.client_key = channel, hello.static
        log.info("conn %d: HELLO from client %s", conn.id, conn.client)
        await conn.ws.send(ok)

    async def refuse(self, conn: Connection, err: ProtocolError, session: int, ref: int | None) -> None:
        """ERROR for a rejected frame; then the connection is closed (`CLOSING`) or the frame counts
        towards `max_bad_frames` (`BAD_FRAME_CODES`)."""
        # AUTH_FAILED after HELLO goes out in the clear: the client's keys differ from ours
        plaintext = conn.channel is not None and not conn.authenticated and err.code == ErrorCode.AUTH_FAILED
        await self.send_error(conn, err, session, ref, plaintext)
        if err.code in CLOSING and not (err.code == ErrorCode.VERSION_MISMATCH and conn.ready):
            await self.close(conn, err.code.name)
        elif err.code in BAD_FRAME_CODES:
            conn.bad_frames += 1
            if conn.bad_frames >= self.limits.max_bad_frames:
                await self.close(conn, f"{conn.bad_frames} bad frames")

    async def send_error(
        self, conn: Connection, err: ProtocolError, session: int = 0, ref: int | None = None, plaintext: bool = False
    ) -> None:
        self.metrics.count_error(err.code)
        log.info("conn %d (client %s): %s", conn.id, conn.client, err)  # messages never hold tensor data
        try:
            await conn.send(ErrorReply.of(err, session, ref).to_frame(), plaintext)
        except ConnectionClosed:
            pass

    async def close(self, conn: Connection, reason: str) -> None:
        log.info("conn %d (client %s): closing: %s", conn.id, conn.client, reason)
        normal = reason in ("handshake timeout", "idle timeout")
        await conn.ws.close(1000 if normal else 1008, reason[:120])

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

    async def drain(self, timeout_s: float) -> None:
        """Admit no new connection, tell every idle one GOING_AWAY now (a busy one after its reply), and
        wait up to `timeout_s` for all of them to end."""
        self.draining = True
        for conn in list(self.connections.values()):
            if not conn.busy:
                await self.going_away(conn)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
