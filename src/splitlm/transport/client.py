"""Synchronous WebSocket client for the cloud protocol (used by the edge)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.sync.client import ClientConnection, connect

from splitlm import SplitLMError
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    VERSION,
    Frame,
    MsgType,
    decode_frame,
    encode_frame,
    pack_mask,
    pack_tensors,
    unpack_tensors,
)

REPLY_TYPE = {MsgType.HELLO: MsgType.HELLO_OK, MsgType.OPEN: MsgType.OPENED, MsgType.FORWARD: MsgType.RESULT,
              MsgType.CLOSE: MsgType.CLOSED}


class CloudError(SplitLMError):
    """The cloud answered with an ERROR frame, or could not be reached."""

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        self.code = code


class CloudClient:
    """One connection to a cloud server. Counts bytes in both directions (frames as sent)."""

    def __init__(self, url: str, fingerprint: str, timeout_s: float = 60.0, max_frame_bytes: int = 64 * 2**20):
        self.url, self.timeout_s = url, timeout_s
        self.bytes_up = self.bytes_down = 0
        self.serialize_s = 0.0  # time spent encoding and decoding frames and tensors
        self.seq = itertools.count(1)
        self.last_seq_in = 0
        try:
            self.ws: ClientConnection = connect(url, open_timeout=timeout_s, max_size=max_frame_bytes,
                                                compression=None, proxy=None, ping_interval=None).__enter__()
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as e:
            raise CloudError(f"cannot reach the cloud at {url}: {e}") from None
        hello = self.request(Frame(MsgType.HELLO, meta={"version": VERSION, "fingerprint": fingerprint}))
        self.server_info: dict[str, Any] = hello.meta

    def request(self, frame: Frame) -> Frame:
        frame.seq = next(self.seq)
        t0 = time.perf_counter()
        data = encode_frame(frame)
        self.serialize_s += time.perf_counter() - t0
        try:
            self.ws.send(data)
            self.bytes_up += len(data)
            reply_data = self.ws.recv(timeout=self.timeout_s)
        except ConnectionClosed as e:
            raise CloudError(f"the cloud closed the connection ({e.rcvd.reason if e.rcvd else 'no reason'})") from None
        except TimeoutError:
            raise CloudError(f"no answer from the cloud within {self.timeout_s:.0f} s") from None
        self.bytes_down += len(reply_data)
        t0 = time.perf_counter()
        try:
            reply = decode_frame(reply_data)
        except ProtocolError as e:
            raise CloudError(f"malformed frame from the cloud: {e.message}") from None
        finally:
            self.serialize_s += time.perf_counter() - t0
        if reply.seq <= self.last_seq_in:
            raise CloudError("the cloud repeated or reordered a frame")
        self.last_seq_in = reply.seq
        if reply.meta.get("ref") not in (None, frame.seq):
            raise CloudError("the cloud answered a different request")
        if reply.type == MsgType.ERROR:
            code = reply.meta.get("code")
            raise CloudError(f"cloud error {reply.meta.get('name', code)}: {reply.meta.get('message', '')}",
                             ErrorCode(code) if code in ErrorCode._value2member_map_ else None)
        if reply.type != REPLY_TYPE[frame.type]:
            raise CloudError(f"the cloud answered {frame.type.name} with {reply.type.name}")
        return reply

    def open_session(self, wire_dtype: str) -> int:
        return self.request(Frame(MsgType.OPEN, meta={"wire_dtype": wire_dtype})).session

    def forward(self, session: int, hidden: torch.Tensor, positions: list[int], wire_dtype: str,
                mask: torch.Tensor | None = None, keep: list[int] | None = None,
                crop: int | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """Send hidden [T, D] through the cloud's layers; returns hidden [T, D] and the reply metadata."""
        t0 = time.perf_counter()
        specs, payload = pack_tensors({"hidden": hidden}, wire_dtype)
        self.serialize_s += time.perf_counter() - t0
        meta: dict[str, Any] = {"tensors": specs, "positions": positions}
        if mask is not None:
            meta["mask"] = pack_mask(mask)
        if keep is not None:
            meta["keep"] = keep
        if crop is not None:
            meta["crop"] = crop
        start = time.perf_counter()
        reply = self.request(Frame(MsgType.FORWARD, session, meta=meta, payload=payload))
        reply.meta["round_trip_s"] = time.perf_counter() - start
        t0 = time.perf_counter()
        out = unpack_tensors(reply, hidden.numel())["hidden"]
        self.serialize_s += time.perf_counter() - t0
        return out, reply.meta

    def close_session(self, session: int) -> None:
        self.request(Frame(MsgType.CLOSE, session))

    def close(self) -> None:
        self.ws.close()
