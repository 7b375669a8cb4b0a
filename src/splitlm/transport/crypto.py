"""AES-256-GCM framing, the key schedule and rekeying (only `cryptography` primitives).

After the handshake (see `splitlm.transport.handshake`) each direction of a connection has a
32-byte AES key and a 12-byte IV. A frame is sealed as

    header  = the 32-byte header with FLAG_ENCRYPTED (and the key phase) set,
              meta_len = plaintext metadata length, payload_len = plaintext payload length + 16
    nonce   = IV XOR (4 zero bytes || seq as 8 bytes big-endian)
    body    = AES-256-GCM(key).encrypt(nonce, metadata || payload, associated data = header)

so `32 + meta_len + payload_len` is still the message length and every header field is
authenticated. Sequence numbers are strictly increasing per direction, so a nonce never repeats
under one key. The sender moves to the next key, HKDF(current key), before `RekeyPolicy`'s frame or
byte limit and flips FLAG_KEY_PHASE; the receiver follows the phase bit.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    FLAG_ENCRYPTED,
    FLAG_KEY_PHASE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Frame,
    Header,
    decode_body,
    decode_header,
)

KEY_SIZE = 32
IV_SIZE = 12
TAG_SIZE = 16
TRANSCRIPT_LABEL = b"splitlm/2 transcript"
KEYS_INFO = b"splitlm/2 keys"
REKEY_INFO = b"splitlm/2 rekey"
U32 = struct.Struct("!I")


@dataclass(frozen=True)
class RekeyPolicy:
    """When a sender moves to its next key. Defaults stay far below AES-GCM's limits: 2^24 frames
    (the nonce counter allows 2^64, random-nonce GCM 2^32) and 2^34 bytes (16 GiB; TLS 1.3 allows
    about 2^38.5 bytes per key for a 2^-57 confidentiality margin)."""

    max_frames: int = 2**24
    max_bytes: int = 2**34

    def __post_init__(self) -> None:
        if self.max_frames < 1 or self.max_bytes < 1:
            raise ValueError("rekey limits must be positive")


@dataclass(frozen=True)
class DirectionKeys:
    key: bytes
    iv: bytes


def hkdf(ikm: bytes, length: int, salt: bytes | None, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=info).derive(ikm)


def transcript_hash(hello: bytes, hello_ok_head: bytes) -> bytes:
    """SHA-256 over the label, the whole HELLO frame (length-prefixed) and HELLO_OK's header and
    clear metadata (its own header gives their length)."""
    return hashlib.sha256(TRANSCRIPT_LABEL + U32.pack(len(hello)) + bytes(hello) + bytes(hello_ok_head)).digest()


def derive_keys(dh_ee: bytes, dh_es: bytes, dh_se: bytes, th: bytes) -> tuple[DirectionKeys, DirectionKeys]:
    """(edge->cloud, cloud->edge) keys from the three X25519 outputs, salted by the transcript hash."""
    okm = hkdf(dh_ee + dh_es + dh_se, 2 * (KEY_SIZE + IV_SIZE), th, KEYS_INFO)
    a, b = okm[: KEY_SIZE + IV_SIZE], okm[KEY_SIZE + IV_SIZE :]
    return DirectionKeys(a[:KEY_SIZE], a[KEY_SIZE:]), DirectionKeys(b[:KEY_SIZE], b[KEY_SIZE:])


def next_keys(keys: DirectionKeys) -> DirectionKeys:
    """The following key of a direction's key chain: HKDF-SHA256(current key), new key and IV."""
    okm = hkdf(keys.key, KEY_SIZE + IV_SIZE, None, REKEY_INFO)
    return DirectionKeys(okm[:KEY_SIZE], okm[KEY_SIZE:])


def nonce(iv: bytes, seq: int) -> bytes:
    return (int.from_bytes(iv, "big") ^ seq).to_bytes(IV_SIZE, "big")


class ReplayWindow:
    """Accepts only strictly increasing sequence numbers; tells a replay from a reordered frame for
    the last `SIZE` numbers (an older one is reported as a replay)."""

    SIZE = 64

    def __init__(self) -> None:
        self.last = 0
        self.bits = 0  # bit i set: sequence number last - i was accepted

    def check(self, seq: int) -> None:
        """Raise unless `seq` may be accepted now; does not record it (see `accept`)."""
        if seq == 0:
            raise ProtocolError(ErrorCode.BAD_FRAME, "sequence number 0 is never valid")
        if seq > self.last:
            return
        offset = self.last - seq
        if offset >= self.SIZE or (self.bits >> offset) & 1:
            raise ProtocolError(ErrorCode.REPLAY, f"sequence number {seq} was already used (last {self.last})")
        raise ProtocolError(ErrorCode.OUT_OF_ORDER, f"sequence number {seq} arrived after {self.last}")

    def accept(self, seq: int) -> None:
        self.check(seq)
        shift = seq - self.last
        self.bits = ((self.bits << shift) | 1) & ((1 << self.SIZE) - 1) if shift < self.SIZE else 1
        self.last = seq


class SendCipher:
    """Seals one direction's frames; rotates its key under `policy`."""

    def __init__(self, keys: DirectionKeys, policy: RekeyPolicy | None = None):
        self.keys, self.policy = keys, policy or RekeyPolicy()
        self.aead = AESGCM(keys.key)
        self.phase = 0
        self.frames = self.bytes = 0  # sealed under the current key
        self.rotations = 0
        self.last_seq = 0

    def rotate(self) -> None:
        self.keys = next_keys(self.keys)
        self.aead = AESGCM(self.keys.key)
        self.phase ^= 1
        self.frames = self.bytes = 0
        self.rotations += 1

    def encrypt(self, seq: int, plaintext: bytes, aad: bytes) -> bytes:
        """AES-GCM under the current key with nonce IV ^ seq; refuses a sequence number it has used."""
        if seq <= self.last_seq:  # would reuse a nonce: a bug in the caller, never let it through
            raise RuntimeError(f"sequence number {seq} is not above {self.last_seq}")
        self.last_seq = seq
        out = self.aead.encrypt(nonce(self.keys.iv, seq), plaintext, aad)
        self.frames += 1
        self.bytes += len(plaintext)
        return out

    def seal(self, frame: Frame) -> bytes:
        if self.frames >= self.policy.max_frames or self.bytes >= self.policy.max_bytes:
            self.rotate()
        meta = msgpack.packb(frame.meta, use_bin_type=True)
        flags = FLAG_ENCRYPTED | (FLAG_KEY_PHASE if self.phase else 0)
        header = HEADER.pack(
            MAGIC, VERSION, frame.type, flags, frame.session, frame.seq, len(meta), len(frame.payload) + TAG_SIZE
        )
        return header + self.encrypt(frame.seq, meta + frame.payload, header)


class RecvCipher:
    """Opens one direction's frames: authenticate, then check the sequence number, then decode."""

    def __init__(self, keys: DirectionKeys, window: ReplayWindow | None = None):
        self.keys = keys
        self.aead = AESGCM(keys.key)
        self.phase = 0
        self.window = window or ReplayWindow()
        self.rotations = 0

    def decrypt(self, seq: int, ciphertext: bytes, aad: bytes, phase: int = 0) -> bytes:
        keys, aead = self.keys, self.aead
        if phase != self.phase:  # the sender moved on: try its next key, keep it only if it works
            keys = next_keys(self.keys)
            aead = AESGCM(keys.key)
        try:
            plaintext = aead.decrypt(nonce(keys.iv, seq), bytes(ciphertext), bytes(aad))
        except InvalidTag:
            raise ProtocolError(
                ErrorCode.DECRYPT_FAILED, "frame failed authentication (tampered, truncated or sealed with another key)"
            ) from None
        if phase != self.phase:
            self.keys, self.aead, self.phase = keys, aead, phase
            self.rotations += 1
        return plaintext

    def open(self, data: bytes) -> Frame:
        header: Header = decode_header(data)
        if not header.flags & FLAG_ENCRYPTED:
            raise ProtocolError(ErrorCode.NOT_ENCRYPTED, f"plaintext {header.type.name} frame after the handshake")
        if header.payload_len < TAG_SIZE:
            raise ProtocolError(ErrorCode.BAD_FRAME, "encrypted frame shorter than its authentication tag")
        phase = 1 if header.flags & FLAG_KEY_PHASE else 0
        plaintext = self.decrypt(header.seq, memoryview(data)[HEADER_SIZE:], memoryview(data)[:HEADER_SIZE], phase)
        self.window.accept(header.seq)
        plain_header = Header(
            header.type, header.flags, header.session, header.seq, header.meta_len, header.payload_len - TAG_SIZE
        )
        return decode_body(plain_header, plaintext)


class Channel:
    """Both directions of one connection, from one side's point of view."""

    def __init__(self, send: SendCipher, recv: RecvCipher):
        self.send, self.recv = send, recv

    def seal(self, frame: Frame) -> bytes:
        return self.send.seal(frame)

    def open(self, data: bytes) -> Frame:
        return self.recv.open(data)
