"""Synchronous WebSocket client for the cloud protocol (used by the edge): handshake, then encrypted frames."""

from __future__ import annotations

import itertools
import logging
import ssl
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from websockets.exceptions import ConnectionClosed, InvalidURI, WebSocketException
from websockets.sync.client import ClientConnection, connect

from splitlm import SplitLMError
from splitlm.transport.crypto import Channel, RekeyPolicy, ReplayWindow
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    Frame,
    MsgType,
    decode_frame,
    decode_header,
)
from splitlm.transport.handshake import ClientHandshake
from splitlm.transport.hello import ServerInfo
from splitlm.transport.keys import (
    Identity,
    KnownHosts,
    fingerprint,
    host_id,
    parse_key_spec,
    resolve_identity,
)
from splitlm.transport.messages import (
    REPLY_TYPE,
    Close,
    Closed,
    ErrorReply,
    Forward,
    GoingAway,
    Open,
    Opened,
    PolicyChange,
    PolicyOk,
    Result,
    reply_ref,
)

log = logging.getLogger(__name__)


@dataclass
class PendingForward:
    """A FORWARD sent and not yet answered."""

    frame: Frame
    sent_at: float
    max_reply_elements: int


PING_INTERVAL_S = 20.0  # keepalive pings, both ways; a link silent to pings for as long again is dead
PING_TIMEOUT_S = 20.0


class CloudError(SplitLMError):
    """The cloud answered with an ERROR frame, or could not be reached.

    `retryable`: the connection (or the cloud) is gone, not the request at fault: closed, timed out,
    unreachable (also while opening: TCP, the WebSocket upgrade, HELLO), or the cloud said GOING_AWAY;
    or the cloud freed the session (`PREEMPTED`). An edge session fails over on these (`EdgeSession`)."""

    def __init__(self, message: str, code: ErrorCode | None = None, retryable: bool = False):
        super().__init__(message)
        self.code = code
        self.retryable = retryable

    @property
    def recoverable(self) -> bool:
        """Whether a session goes on after it by failing over (a new session, its context replayed):
        retryable, or the cloud had no room for it (`CAPACITY`: another cloud, or this one later)."""
        return self.retryable or self.code == ErrorCode.CAPACITY


def lost(message: str) -> CloudError:
    return CloudError(message, retryable=True)


def tls_context(url: str, ca_file: str | Path | None) -> ssl.SSLContext | None:
    """The TLS context for a wss:// URL: the system's trust store, or only the CAs in `ca_file`."""
    if not url.startswith("wss://"):
        if ca_file is not None:
            raise CloudError(f"a TLS CA file was given but {url} is not a wss:// URL")
        return None
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as e:
        raise CloudError(f"cannot load the TLS CA file {ca_file}: {e}") from None


def error_from_frame(reply: Frame, note: str = "") -> CloudError:
    """An ERROR frame as a `CloudError`; `PREEMPTED` is retryable (only the session is gone: the edge
    opens a new one and replays into it, docs/failover.md)."""
    error = ErrorReply.from_frame(reply)
    code = error.error_code
    name = code if error.name is None else error.name
    return CloudError(f"cloud error {name}: {error.message}{note}", code, retryable=code == ErrorCode.PREEMPTED)


@dataclass
class ClientOptions:
    """How a `CloudClient` connects and waits (everything but the URL and the shard's fingerprint).

    identity: this client's static key (an `Identity` or a .key path); None = the one kept in the
        config dir (created on first use).
    cloud_key: the cloud's expected public key: raw bytes, a ``SHA256:`` fingerprint, a .pub file or
        a public-key line. None = trust on first use, recorded in `known_hosts` (default
        ``$SPLITLM_CONFIG/known_hosts`` or ``~/.config/splitlm/known_hosts``); a changed key is refused.
    tls_ca: CA certificate file for a wss:// URL (default: the system's trust store).
    rekey: when this side's sending key rotates (tests force rotations with small limits).
    """

    timeout_s: float = 60.0
    max_frame_bytes: int = 64 * 2**20
    identity: Identity | str | Path | None = None
    cloud_key: str | bytes | None = None
    known_hosts: str | Path | None = None
    tls_ca: str | Path | None = None
    rekey: RekeyPolicy | None = None
    ping_interval_s: float | None = PING_INTERVAL_S
    ping_timeout_s: float | None = PING_TIMEOUT_S


class CloudClient:
    """One authenticated, encrypted connection to the cloud at `url` that serves the cloud shard matching
    the edge shard `fingerprint`, made as `options` say. Counts bytes in both directions (as sent)."""

    def __init__(self, url: str, fingerprint: str, options: ClientOptions | None = None):
        o = options or ClientOptions()
        timeout_s, max_frame_bytes = o.timeout_s, o.max_frame_bytes
        self.url, self.timeout_s, self.max_frame_bytes = url, timeout_s, max_frame_bytes
        self.bytes_up = self.bytes_down = 0
        self.serialize_s = 0.0  # time spent encoding, encrypting, decrypting and decoding frames and tensors
        self.seq = itertools.count(1)
        self.in_flight: deque[int] = deque()  # sequence numbers of requests sent and not yet answered
        self._arrived: deque[bytes] = deque()  # replies taken off the socket by `reply_waiting`, not yet read
        self.identity = resolve_identity(o.identity, "client")
        pinned = None if o.cloud_key is None else parse_key_spec(o.cloud_key)
        context = tls_context(url, o.tls_ca)
        try:
            self.ws: ClientConnection = connect(
                url,
                open_timeout=timeout_s,
                max_size=max_frame_bytes,
                compression=None,
                proxy=None,
                ping_interval=o.ping_interval_s,
                ping_timeout=o.ping_timeout_s,
                ssl=context,
            ).__enter__()
        except InvalidURI as e:
            raise CloudError(f"cannot reach the cloud at {url}: {e}") from None
        except ConnectionClosed:  # accepted, then closed before the upgrade went through (a dead cloud behind a proxy)
            raise lost(f"cannot reach the cloud at {url}: the connection closed during the WebSocket upgrade") from None
        except (OSError, WebSocketException, TimeoutError) as e:  # reset, refused, a bad upgrade answer: try another
            cause = f" ({e.__cause__})" if e.__cause__ is not None else ""  # the upgrade's: EOF, a bad status line
            raise lost(f"cannot reach the cloud at {url}: {e or type(e).__name__}{cause}") from None
        try:
            self.channel: Channel = self._handshake(fingerprint, pinned, o.known_hosts, o.rekey)
        except BaseException:
            self.ws.close()
            raise

    def _exchange(self, data: bytes) -> bytes:
        self._send(data)
        return self._recv()

    def _send(self, data: bytes) -> None:
        try:
            self.ws.send(data)
        except ConnectionClosed as e:
            raise lost(f"the cloud closed the connection ({e.rcvd.reason if e.rcvd else 'no reason'})") from None
        self.bytes_up += len(data)

    def _recv(self) -> bytes:
        try:
            reply_data = self._arrived.popleft() if self._arrived else self.ws.recv(timeout=self.timeout_s)
        except ConnectionClosed as e:
            raise lost(f"the cloud closed the connection ({e.rcvd.reason if e.rcvd else 'no reason'})") from None
        except TimeoutError:
            raise lost(f"no answer from the cloud within {self.timeout_s:.0f} s") from None
        self.bytes_down += len(reply_data)
        return reply_data

    def reply_waiting(self) -> bool:
        """Whether the oldest unanswered request's reply has arrived (`receive_forward` would not wait)."""
        if self._arrived:
            return True
        try:
            self._arrived.append(self.ws.recv(timeout=0))
        except TimeoutError:
            return False
        except ConnectionClosed:
            return True  # the next receive reports it
        return True

    def _handshake(
        self, shard_fingerprint: str, pinned: str | None, known_hosts: str | Path | None, rekey: RekeyPolicy | None
    ) -> Channel:
        hs = ClientHandshake(self.identity, shard_fingerprint, seq=next(self.seq))
        reply_data = self._exchange(hs.hello_bytes)
        try:
            reply = decode_frame(reply_data)
            if reply.type == MsgType.ERROR:
                raise error_from_frame(reply)
            if reply.type != REPLY_TYPE[MsgType.HELLO]:
                raise CloudError(f"the cloud answered HELLO with {reply.type.name}")
            cloud_fp = fingerprint(ClientHandshake.server_key(reply))
            host = host_id(self.url)
            record = None
            if pinned is not None:
                if cloud_fp != pinned:
                    raise CloudError(
                        f"the cloud at {host} presented key {cloud_fp}, but --cloud-key pins {pinned}; "
                        "refusing to connect (wrong cloud, or a man in the middle)",
                        ErrorCode.SERVER_KEY_MISMATCH,
                    )
            else:
                hosts = KnownHosts(known_hosts)
                known = hosts.lookup(host)
                if known is None:
                    record = hosts
                elif known[1] != cloud_fp:
                    raise CloudError(
                        f"the cloud at {host} presented key {cloud_fp}, but {hosts.path} line {known[0]} "
                        f"records {known[1]}; refusing to connect. If the cloud's key really changed, "
                        f"delete that line (or pass --cloud-key)",
                        ErrorCode.SERVER_KEY_MISMATCH,
                    )
            channel, info = hs.finish(reply_data, rekey, ReplayWindow())
        except ProtocolError as e:
            raise CloudError(f"handshake with the cloud failed: {e}", e.code) from None
        if record is not None:  # only once the cloud proved it holds the key
            seen = any(fp == cloud_fp for _, _, fp in record.entries())  # the same cloud on another port: no news
            record.add(host, cloud_fp)
            (log.debug if seen else log.warning)(
                "trusting the cloud key %s of %s on first use (recorded in %s)", cloud_fp, host, record.path
            )
        self.cloud_fingerprint = cloud_fp
        self.info = ServerInfo.from_meta(info)
        return channel

    def _open(self, data: bytes) -> Frame:
        header = decode_header(data)
        if not header.flags & FLAG_ENCRYPTED and header.type == MsgType.ERROR:
            # the cloud could not encrypt it (it failed to authenticate us): report it, marked as unauthenticated
            raise error_from_frame(decode_frame(data), " (unauthenticated error frame; the connection is closed)")
        return self.channel.open(data)

    def request(self, frame: Frame) -> Frame:
        """Send a request frame and wait for its reply frame, checked against `REPLY_TYPE` (the typed
        methods below build and read the messages; tests send malformed frames through this)."""
        return self._reply(self._submit(frame))

    def _submit(self, frame: Frame) -> Frame:
        """Seal and send a request without waiting for its reply (replies come back in request order)."""
        frame.seq = next(self.seq)
        t0 = time.perf_counter()
        data = self.channel.seal(frame)
        self.serialize_s += time.perf_counter() - t0
        self._send(data)
        self.in_flight.append(frame.seq)
        return frame

    def _reply(self, frame: Frame) -> Frame:
        """The reply to `frame`, which must be the oldest request still unanswered."""
        if not self.in_flight or self.in_flight[0] != frame.seq:
            raise CloudError("replies arrive in request order: receive the oldest request's reply first")
        self.in_flight.popleft()
        reply_data = self._recv()
        t0 = time.perf_counter()
        try:
            reply = self._open(reply_data)
        except ProtocolError as e:
            raise CloudError(f"rejected a frame from the cloud: {e}", e.code) from None
        finally:
            self.serialize_s += time.perf_counter() - t0
        if reply.type == MsgType.ERROR:
            raise error_from_frame(reply)
        if reply.type == MsgType.GOING_AWAY:
            self.ws.close()
            raise lost(f"the cloud is going away ({GoingAway.from_frame(reply).reason})")
        if reply_ref(reply) != frame.seq:
            raise CloudError("the cloud answered a different request")
        if reply.type != REPLY_TYPE[frame.type]:
            raise CloudError(f"the cloud answered {frame.type.name} with {reply.type.name}")
        return reply

    def open(self, request: Open) -> Opened:
        """A new session (OPEN -> OPENED)."""
        return Opened.from_frame(self.request(request.to_frame()))

    def policy(self, session: int, change: PolicyChange) -> PolicyOk:
        """Tighten the session's cache policy and/or wipe its cache now (POLICY -> POLICY_OK)."""
        return PolicyOk.from_frame(self.request(change.to_frame(session)))

    def send_forward(self, session: int, request: Forward, wire_dtype: str, max_reply_elements: int) -> PendingForward:
        """Send a FORWARD (its `hidden` in `wire_dtype`) and return at once; `receive_forward` gets its
        RESULT, whose tensors may hold at most `max_reply_elements` elements each. Several may be in
        flight on one connection: the cloud answers them in order."""
        t0 = time.perf_counter()
        try:
            frame = request.to_frame(session, wire_dtype)
        except OverflowError as e:
            raise CloudError(str(e)) from None
        self.serialize_s += time.perf_counter() - t0
        start = time.perf_counter()
        frame = self._submit(frame)
        return PendingForward(frame, start, max_reply_elements)

    def receive_forward(self, pending: PendingForward) -> Result:
        """The RESULT of a `send_forward` (the oldest one unanswered), with the client's own timing:
        `round_trip_s` (send to reply) and `wait_s` (how long this call waited for it)."""
        waited = time.perf_counter()
        reply = self._reply(pending.frame)
        now = time.perf_counter()
        t0 = time.perf_counter()
        try:
            result = Result.from_frame(reply, pending.max_reply_elements)
        except ProtocolError as e:
            raise CloudError(f"bad RESULT from the cloud: {e}", e.code) from None
        self.serialize_s += time.perf_counter() - t0
        result.round_trip_s, result.wait_s = now - pending.sent_at, now - waited
        return result

    def drop_replies(self) -> int:
        """Take and discard the replies of every request still unanswered (their session is gone, e.g.
        PREEMPTED, so they are errors too), so that the connection can carry new requests; how many."""
        n = 0
        while self.in_flight:
            self.in_flight.popleft()
            data = self._recv()
            try:
                reply = self._open(data)
            except ProtocolError as e:
                raise CloudError(f"rejected a frame from the cloud: {e}", e.code) from None
            if reply.type == MsgType.GOING_AWAY:
                self.ws.close()
                raise lost(f"the cloud is going away ({GoingAway.from_frame(reply).reason})")
            n += 1
        return n

    def close_session(self, session: int) -> Closed:
        """End a session (CLOSE -> CLOSED)."""
        return Closed.from_frame(self.request(Close().to_frame(session)))

    def close(self) -> None:
        self.ws.close()
