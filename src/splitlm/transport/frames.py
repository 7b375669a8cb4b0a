"""Binary frames: a fixed 32-byte header, msgpack metadata, raw tensor bytes.

    offset size field
    0      4    magic  b"SPLM"
    4      1    version
    5      1    type   (MsgType)
    6      2    flags  (FLAG_ENCRYPTED, FLAG_KEY_PHASE; other bits must be 0)
    8      8    session id (0 = none)
    16     8    sequence number (strictly increasing per direction)
    24     4    metadata length in bytes
    28     4    payload length in bytes
    32     ...  metadata (msgpack map), then payload (tensor bytes, described in metadata["tensors"])

All integers are big-endian. After the handshake every frame is encrypted (FLAG_ENCRYPTED): metadata
and payload are one AES-256-GCM ciphertext, `meta_len` is the plaintext metadata length and
`payload_len` the plaintext payload length + 16 (the tag); see `splitlm.transport.crypto`.
See docs/protocol.md for the messages.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import msgpack
import numpy as np
import torch

from splitlm.transport.codecs import decode_tensor, encode_tensor
from splitlm.transport.errors import ErrorCode, ProtocolError

MAGIC = b"SPLM"
VERSION = 2
HEADER = struct.Struct("!4sBBHQQII")
HEADER_SIZE = HEADER.size  # 32
FLAG_ENCRYPTED = 0x0001  # metadata + payload are one AES-256-GCM ciphertext, the header its associated data
FLAG_KEY_PHASE = 0x0002  # which key of the sender's key chain sealed the frame; flips at every rekey
KNOWN_FLAGS = FLAG_ENCRYPTED | FLAG_KEY_PHASE


class MsgType(IntEnum):
    HELLO = 1
    HELLO_OK = 2
    OPEN = 3
    OPENED = 4
    FORWARD = 5
    RESULT = 6
    CLOSE = 7
    CLOSED = 8
    ERROR = 9
    POLICY = 10
    POLICY_OK = 11
    GOING_AWAY = 12  # cloud -> edge: shutting down, no more replies on this connection; fail over now


@dataclass
class Frame:
    type: MsgType
    session: int = 0
    seq: int = 0
    meta: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""
    flags: int = 0

    def header(self, meta_len: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.type, self.flags, self.session, self.seq, meta_len, len(self.payload))


def encode_frame(frame: Frame) -> bytes:
    meta = msgpack.packb(frame.meta, use_bin_type=True)
    return frame.header(len(meta)) + meta + frame.payload


@dataclass(frozen=True)
class Header:
    type: MsgType
    flags: int
    session: int
    seq: int
    meta_len: int
    payload_len: int


def decode_header(data: bytes) -> Header:
    """Parse and check the 32-byte header (checks 1-7 of docs/protocol.md, section "Header")."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ProtocolError(ErrorCode.BAD_FRAME, "expected a binary frame, got text")
    if len(data) < HEADER_SIZE:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame of {len(data)} bytes is shorter than the header")
    magic, version, type_, flags, session, seq, meta_len, payload_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_FRAME, "bad magic: not a splitlm frame")
    if version != VERSION:
        raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"protocol version {version} (this side speaks {VERSION})")
    if HEADER_SIZE + meta_len + payload_len != len(data):
        raise ProtocolError(ErrorCode.BAD_FRAME, "frame length does not match the header's lengths")
    try:
        msg_type = MsgType(type_)
    except ValueError:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown message type {type_}") from None
    if flags & ~KNOWN_FLAGS:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"unknown flag bits {flags & ~KNOWN_FLAGS:#06x}")
    return Header(msg_type, flags, session, seq, meta_len, payload_len)


def decode_body(header: Header, body: bytes) -> Frame:
    """Metadata and payload of a frame from its (plaintext) body: `meta_len` bytes of msgpack, then the payload."""
    try:
        meta = msgpack.unpackb(bytes(body[: header.meta_len]), raw=False) if header.meta_len else {}
    except Exception as e:  # noqa: BLE001 - msgpack raises several types
        raise ProtocolError(ErrorCode.BAD_FRAME, f"undecodable metadata ({type(e).__name__})") from None
    if not isinstance(meta, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "metadata is not a map")
    return Frame(header.type, header.session, header.seq, meta, bytes(body[header.meta_len :]), header.flags)


def decode_frame(data: bytes) -> Frame:
    """Decode a plaintext frame (HELLO, HELLO_OK, errors before the handshake); see crypto for the rest."""
    header = decode_header(data)
    if header.flags & FLAG_ENCRYPTED:
        raise ProtocolError(ErrorCode.BAD_FRAME, "an encrypted frame where a plaintext one was expected")
    return decode_body(header, memoryview(data)[HEADER_SIZE:])


def pack_tensors(tensors: dict[str, torch.Tensor], wire_dtype: str) -> tuple[list[dict], bytes]:
    """Describe and concatenate tensors: (metadata list, payload bytes)."""
    specs, chunks, offset = [], [], 0
    for name, t in tensors.items():
        raw = encode_tensor(t, wire_dtype)
        specs.append({"name": name, "dtype": wire_dtype, "shape": list(t.shape), "offset": offset, "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    return specs, b"".join(chunks)


def unpack_tensors(frame: Frame, max_elements: int) -> dict[str, torch.Tensor]:
    specs = frame.meta.get("tensors", [])
    if not isinstance(specs, list):
        raise ProtocolError(ErrorCode.BAD_FRAME, "metadata 'tensors' is not a list")
    out = {}
    for s in specs:
        try:
            name, dtype, shape, off, n = s["name"], s["dtype"], s["shape"], int(s["offset"]), int(s["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(ErrorCode.BAD_FRAME, "malformed tensor description") from None
        if not isinstance(name, str):
            raise ProtocolError(ErrorCode.BAD_FRAME, "tensor name must be a string")
        if off < 0 or n < 0 or off + n > len(frame.payload):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"tensor {name!r} lies outside the payload")
        out[name] = decode_tensor(memoryview(frame.payload)[off : off + n], dtype, shape, max_elements)
    return out


def pack_mask(mask: torch.Tensor) -> bytes:
    """[T, T] bool visibility -> row-major packed bits (ceil(T*T/8) bytes)."""
    return np.packbits(mask.bool().numpy().reshape(-1)).tobytes()


def unpack_mask(data: bytes, t: int) -> torch.Tensor:
    if not isinstance(data, bytes) or len(data) != (t * t + 7) // 8:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"mask must be {(t * t + 7) // 8} bytes of packed bits for {t} tokens"
        )
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[: t * t]
    return torch.from_numpy(bits.reshape(t, t).astype(bool))


def pack_vocab(allowed: torch.Tensor) -> bytes:
    """[V] bool allow-list -> packed bits (ceil(V/8) bytes; bit i = token id i)."""
    return np.packbits(allowed.bool().numpy()).tobytes()


def unpack_vocab(data: bytes, vocab_size: int) -> torch.Tensor:
    """Packed allow-list bits -> the allowed ids [S], ascending (at least one)."""
    if not isinstance(data, bytes) or len(data) != (vocab_size + 7) // 8:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"vocab must be {(vocab_size + 7) // 8} bytes of packed bits for {vocab_size} token ids",
        )
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if bits[vocab_size:].any():
        raise ProtocolError(ErrorCode.BAD_REQUEST, "vocab has bits set beyond the vocabulary")
    ids = torch.from_numpy(np.flatnonzero(bits[:vocab_size]))
    if ids.numel() == 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "vocab allows no token")
    return ids
