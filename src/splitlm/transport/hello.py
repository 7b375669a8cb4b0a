"""The handshake's messages (docs/protocol.md §4, §5): the edge's HELLO, the clear metadata of the
cloud's HELLO_OK, and the server information HELLO_OK carries encrypted. `handshake.py` derives the
keys from them; like `messages.py`, this is the one place that reads and writes their frames' fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import VERSION, Frame, MsgType
from splitlm.transport.keys import PUBLIC_KEY_SIZE
from splitlm.transport.messages import expect_type, reply_ref


@dataclass
class Limits:
    """The cloud's limits an edge must respect (docs/protocol.md §8), sent in HELLO_OK."""

    max_tokens_per_session: int | None = None  # None: not announced
    max_tokens_per_forward: int | None = None
    max_frame_bytes: int | None = None
    pass_rows: int | None = None  # rows of one causal request per pass of the cloud's layers (longer: several passes)
    max_sessions_per_client: int | None = None  # open sessions one client key may hold at once
    kv_budget_entries: int | None = None  # the largest cache the cloud's whole KV budget holds (one session alone)


@dataclass
class ServerInfo:
    """HELLO_OK's encrypted server information (§4)."""

    server: str = ""
    fingerprint: str = ""
    limits: Limits = field(default_factory=Limits)

    def to_meta(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "fingerprint": self.fingerprint,
            "limits": {k: v for k, v in vars(self.limits).items() if v is not None},
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> ServerInfo:
        limits = meta.get("limits") if isinstance(meta.get("limits"), dict) else {}
        known = {k: v for k, v in limits.items() if k in vars(Limits()) and type(v) is int}
        return cls(str(meta.get("server", "")), str(meta.get("fingerprint", "")), Limits(**known))


def public_key(meta: dict[str, Any], name: str, what: str, code: ErrorCode) -> bytes:
    """The raw X25519 public key `meta[name]` of a HELLO or HELLO_OK (`code` when it is missing or malformed)."""
    value = meta.get(name)
    if value is None:
        raise ProtocolError(code, f"{what} carries no {name!r} key")
    if not isinstance(value, bytes) or len(value) != PUBLIC_KEY_SIZE:
        raise ProtocolError(code, f"{what} {name!r} must be {PUBLIC_KEY_SIZE} bytes (msgpack bin)")
    return value


@dataclass
class Hello:
    """The edge's HELLO (§4, §5), in the clear: the protocol version, the edge shard's fingerprint and
    the client's two X25519 public keys. HELLO_OK's payload is `ServerInfo`; `handshake.py` derives
    the keys from both."""

    fingerprint: str  # the edge shard's (must equal the cloud shard's)
    ephemeral: bytes  # e_c.pub, fresh for this connection
    static: bytes  # s_c.pub: the client's identity (announced here, proven by its first encrypted frame)
    seq: int = 1  # the frame's sequence number (HELLO_OK's `ref` answers it)
    version: int = VERSION

    def to_frame(self) -> Frame:
        return Frame(
            MsgType.HELLO,
            seq=self.seq,
            meta={"version": self.version, "fingerprint": self.fingerprint, "e": self.ephemeral, "s": self.static},
        )

    @classmethod
    def from_frame(cls, frame: Frame, shard_fingerprint: str | None = None) -> Hello:
        """The HELLO, checked in the order of §5 step 2: `version` (VERSION_MISMATCH), the fingerprint
        against the cloud shard's `shard_fingerprint` (FINGERPRINT_MISMATCH; None: not checked), `s`
        (missing or not 32 bytes: AUTH_FAILED), `e` (BAD_REQUEST)."""
        expect_type(frame, MsgType.HELLO)
        meta = frame.meta
        if meta.get("version") != VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH, f"edge speaks version {meta.get('version')}, cloud {VERSION}"
            )
        fp = meta.get("fingerprint")
        if shard_fingerprint is not None and fp != shard_fingerprint:
            raise ProtocolError(
                ErrorCode.FINGERPRINT_MISMATCH,
                "the edge shard and the cloud shard come from different "
                f"splits (cloud fingerprint {shard_fingerprint})",
            )
        static = public_key(meta, "s", "HELLO", ErrorCode.AUTH_FAILED)  # a missing credential
        ephemeral = public_key(meta, "e", "HELLO", ErrorCode.BAD_REQUEST)
        return cls(fp if isinstance(fp, str) else "", ephemeral, static, frame.seq)


@dataclass
class HelloOk:
    """HELLO_OK's clear metadata (§4, §5): the cloud's two X25519 public keys and the HELLO it answers
    (its encrypted payload is `ServerInfo`; `handshake.py` builds and checks the rest)."""

    ephemeral: bytes  # e_s.pub, fresh for this connection
    static: bytes  # S_s.pub: the cloud's identity (proven by the key confirmation)
    ref: int | None  # seq of the HELLO

    def to_meta(self) -> dict[str, Any]:
        return {"e": self.ephemeral, "s": self.static, "ref": self.ref}

    @staticmethod
    def static_key(frame: Frame) -> bytes:
        """The cloud's static public key announced in a HELLO_OK (AUTH_FAILED when missing or malformed)."""
        return public_key(frame.meta, "s", "HELLO_OK", ErrorCode.AUTH_FAILED)

    @classmethod
    def from_frame(cls, frame: Frame) -> HelloOk:
        """The keys checked in the order of §5 step 3 (`e`, then `s`: AUTH_FAILED)."""
        ephemeral = public_key(frame.meta, "e", "HELLO_OK", ErrorCode.AUTH_FAILED)
        return cls(ephemeral, cls.static_key(frame), reply_ref(frame))
