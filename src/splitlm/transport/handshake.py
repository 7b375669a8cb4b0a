"""The version-2 handshake: one round trip inside HELLO / HELLO_OK.

    edge  -> cloud  HELLO     meta {version, fingerprint (shard), e: e_c.pub, s: s_c.pub}         (plaintext)
    cloud -> edge   HELLO_OK  meta {e: e_s.pub, s: S_s.pub, ref}                                   (clear)
                              payload = AES-GCM(k_s2c, IV_s2c ^ seq, server info, aad = its header)

    th   = SHA-256("splitlm/2 transcript" || u32 len(HELLO) || HELLO || HELLO_OK header || HELLO_OK meta)
    keys = HKDF-SHA256(ikm = DH(e_c, e_s) || DH(e_c, S_s) || DH(s_c, e_s), salt = th, info = "splitlm/2 keys")
           -> k_c2s (32) || IV_c2s (12) || k_s2c (32) || IV_s2c (12)

The edge authenticates the cloud by decrypting HELLO_OK's payload (only a holder of S_s can
compute DH(e_c, S_s)) after checking S_s against its pin or known_hosts. The cloud authenticates the
client implicitly: the client's first encrypted frame decrypts only if it holds s_c
(DH(s_c, e_s)); otherwise the cloud answers AUTH_FAILED and closes the connection.
"""

from __future__ import annotations

from typing import Any

import msgpack
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from splitlm.transport.crypto import (
    TAG_SIZE,
    Channel,
    RecvCipher,
    RekeyPolicy,
    ReplayWindow,
    SendCipher,
    derive_keys,
    transcript_hash,
)
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Frame,
    MsgType,
    decode_body,
    decode_header,
    encode_frame,
)
from splitlm.transport.hello import Hello, HelloOk, ServerInfo
from splitlm.transport.keys import Identity, fingerprint


def _raw(key: X25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _exchange(private: X25519PrivateKey, public: bytes) -> bytes:
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(public))
    except ValueError:  # a low-order point gives an all-zero secret; cryptography refuses it
        raise ProtocolError(ErrorCode.AUTH_FAILED, "degenerate (low-order) public key") from None


def server_handshake(
    identity: Identity,
    hello: Hello,
    hello_bytes: bytes,
    info: ServerInfo,
    seq: int,
    policy: RekeyPolicy | None = None,
    window: ReplayWindow | None = None,
) -> tuple[bytes, Channel, bytes]:
    """The cloud's side: (HELLO_OK bytes to send, channel, client static public key).

    `hello` is `hello_bytes` read (`Hello.from_frame`: version, shard fingerprint and keys checked); the
    caller has also checked the allow-list. `info` goes encrypted in HELLO_OK's payload."""
    e_c, s_c = hello.ephemeral, hello.static
    e_s = X25519PrivateKey.generate()
    dh_ee, dh_es, dh_se = _exchange(e_s, e_c), _exchange(identity.private_key, e_c), _exchange(e_s, s_c)
    meta = msgpack.packb(HelloOk(_raw(e_s), identity.public_bytes, hello.seq).to_meta(), use_bin_type=True)
    info_bytes = msgpack.packb(info.to_meta(), use_bin_type=True)
    header = HEADER.pack(MAGIC, VERSION, MsgType.HELLO_OK, 0, 0, seq, len(meta), len(info_bytes) + TAG_SIZE)
    c2s, s2c = derive_keys(dh_ee, dh_es, dh_se, transcript_hash(hello_bytes, header + meta))
    send = SendCipher(s2c, policy)
    confirmation = send.encrypt(seq, info_bytes, header)
    return header + meta + confirmation, Channel(send, RecvCipher(c2s, window)), s_c


class ClientHandshake:
    """The edge's side: build HELLO, then check HELLO_OK and derive the channel."""

    def __init__(self, identity: Identity, shard_fingerprint: str, seq: int = 1):
        self.identity = identity
        self.ephemeral = X25519PrivateKey.generate()
        self.seq = seq
        self.hello_bytes = encode_frame(
            Hello(shard_fingerprint, _raw(self.ephemeral), identity.public_bytes, seq).to_frame()
        )

    @staticmethod
    def server_key(ok: Frame) -> bytes:
        """The cloud's static public key announced in HELLO_OK (not yet proven)."""
        return HelloOk.static_key(ok)

    def finish(
        self, ok_data: bytes, policy: RekeyPolicy | None = None, window: ReplayWindow | None = None
    ) -> tuple[Channel, dict[str, Any]]:
        """Derive the keys and check the cloud's key confirmation; returns (channel, server info)."""
        header = decode_header(ok_data)
        if header.type != MsgType.HELLO_OK or header.payload_len < TAG_SIZE:
            raise ProtocolError(ErrorCode.AUTH_FAILED, "HELLO_OK carries no key confirmation")
        head_len = HEADER_SIZE + header.meta_len
        ok = HelloOk.from_frame(decode_body(header, memoryview(ok_data)[HEADER_SIZE:]))
        e_s, s_s = ok.ephemeral, ok.static
        if ok.ref != self.seq:
            raise ProtocolError(ErrorCode.AUTH_FAILED, "HELLO_OK answers another HELLO")
        dh_ee, dh_es = _exchange(self.ephemeral, e_s), _exchange(self.ephemeral, s_s)
        dh_se = _exchange(self.identity.private_key, e_s)
        c2s, s2c = derive_keys(dh_ee, dh_es, dh_se, transcript_hash(self.hello_bytes, ok_data[:head_len]))
        recv = RecvCipher(s2c, window)
        try:
            info_bytes = recv.decrypt(header.seq, memoryview(ok_data)[head_len:], memoryview(ok_data)[:HEADER_SIZE])
        except ProtocolError:
            raise ProtocolError(
                ErrorCode.AUTH_FAILED,
                f"the cloud failed to prove it holds the private key of "
                f"{fingerprint(s_s)} (key confirmation did not decrypt)",
            ) from None
        recv.window.accept(header.seq)
        try:
            info = msgpack.unpackb(info_bytes, raw=False)
        except Exception:  # noqa: BLE001
            info = None
        if not isinstance(info, dict):
            raise ProtocolError(ErrorCode.BAD_FRAME, "HELLO_OK's server information is not a map")
        send = SendCipher(c2s, policy)
        send.last_seq = self.seq  # HELLO used this number (in the clear)
        return Channel(send, recv), info
