"""The typed edge-cloud messages: one dataclass per request and reply, and the one place that turns
each into a `Frame` (`to_frame`) and back (`from_frame`), with the checks docs/protocol.md §4 and §7
give for its fields.

Both sides use these: the edge's `CloudClient` builds requests and reads replies, the cloud's server
reads requests and builds replies. A field that is malformed on the wire raises `ProtocolError`
with the code of §7 (`BAD_FRAME` for tensor descriptions, `BAD_REQUEST` for content); checks that
need the model or the session (shapes, positions, budgets) stay with the cloud.

    request           reply
    Hello        ->   ServerInfo (HELLO_OK's encrypted payload; the handshake itself is `handshake.py`)
    Open         ->   Opened
    Forward      ->   Result
    PolicyChange ->   PolicyOk
    Close        ->   Closed
    (any)        ->   ERROR (`frames.error_frame`)
    (none)      <-    GoingAway (the cloud shuts down: unsolicited, in place of the next reply)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from splitlm.transport.codecs import WIRE_DTYPES
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    VERSION,
    Frame,
    MsgType,
    pack_mask,
    pack_tensors,
    unpack_mask,
    unpack_tensors,
)
from splitlm.transport.keys import PUBLIC_KEY_SIZE
from splitlm.transport.policy import CachePolicy

# The one table of which reply answers which request (the table above); `CloudClient` checks every
# reply against it. Any request may also be answered with ERROR, or GOING_AWAY in its place.
REPLY_TYPE: dict[MsgType, MsgType] = {
    MsgType.HELLO: MsgType.HELLO_OK,
    MsgType.OPEN: MsgType.OPENED,
    MsgType.FORWARD: MsgType.RESULT,
    MsgType.POLICY: MsgType.POLICY_OK,
    MsgType.CLOSE: MsgType.CLOSED,
}


def int_list(value, name: str) -> list[int]:
    if not isinstance(value, list) or not all(type(i) is int for i in value):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{name} must be a list of integers")
    return value


def parse_policy(value) -> CachePolicy:
    try:
        return CachePolicy.parse(value)
    except ValueError as e:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(e)) from None


def _expect(frame: Frame, msg_type: MsgType) -> None:
    if frame.type != msg_type:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected {msg_type.name}, got {frame.type.name}")


@dataclass
class Limits:
    """The cloud's limits an edge must respect (docs/protocol.md §8), sent in HELLO_OK."""

    max_tokens_per_session: int | None = None  # None: not announced
    max_tokens_per_forward: int | None = None
    max_frame_bytes: int | None = None
    pass_rows: int | None = None  # rows of one causal request per pass of the cloud's layers (longer: several passes)


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
        _expect(frame, MsgType.HELLO)
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
class Open:
    """Create a session with an empty KV cache (§4 OPEN)."""

    wire_dtype: str = "fp16"  # default codec of the session's RESULT tensors
    cache_policy: CachePolicy | str = field(default_factory=CachePolicy)  # a string travels as given
    vocab: bytes | None = None  # split-head: the authorised ids as packed bits; None = every id

    def to_frame(self) -> Frame:
        meta: dict[str, Any] = {"wire_dtype": self.wire_dtype, "cache_policy": str(self.cache_policy)}
        if self.vocab is not None:
            meta["vocab"] = self.vocab
        return Frame(MsgType.OPEN, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame) -> Open:
        _expect(frame, MsgType.OPEN)
        wire = frame.meta.get("wire_dtype", "fp16")
        if not isinstance(wire, str) or wire not in WIRE_DTYPES:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown wire dtype {wire!r}")
        policy = parse_policy(frame.meta.get("cache_policy", "session"))
        return cls(wire, policy, frame.meta.get("vocab"))  # vocab's bits are checked against the model's V


@dataclass
class Opened:
    session: int  # the new id (in the header)
    wire_dtype: str
    cache_policy: CachePolicy
    topology: str  # the cloud shard's: tail-local or split-head
    vocab_size: int | None = None  # split-head: the number of authorised ids S

    def to_frame(self) -> Frame:
        meta: dict[str, Any] = {
            "wire_dtype": self.wire_dtype,
            "cache_policy": str(self.cache_policy),
            "topology": self.topology,
        }
        if self.vocab_size is not None:
            meta["vocab_size"] = self.vocab_size
        return Frame(MsgType.OPENED, self.session, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame) -> Opened:
        _expect(frame, MsgType.OPENED)
        m = frame.meta
        return cls(
            frame.session,
            m.get("wire_dtype", "fp16"),
            parse_policy(m.get("cache_policy", "session")),
            m.get("topology", "tail-local"),
            m.get("vocab_size"),
        )


@dataclass
class Control:
    """The edge's control tuple for one request (the seed paper's (flagCache, LCache, dtype, l))."""

    cache: bool = True  # flagCache: may the cloud use the history it holds? False = wipe it first
    window: int | None = None  # LCache: at most this many past entries; tightens the session for good
    dtype: str | None = None  # the reply's wire dtype (None = the session's)
    split: int | None = None  # l: the layer the edge's hidden states come from (must be the shard's)
    key: bytes | None = None  # a sealed session's cache key, for this request only

    @classmethod
    def from_meta(cls, meta) -> Control:
        if meta is None:
            return cls()
        if not isinstance(meta, dict):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "control must be a map")
        c = cls(meta.get("cache", True), meta.get("window"), meta.get("dtype"), meta.get("split"), meta.get("key"))
        if type(c.cache) is not bool:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "control.cache must be true or false")
        if c.window is not None and (type(c.window) is not int or c.window < 1):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "control.window must be an integer >= 1")
        if c.dtype is not None and (not isinstance(c.dtype, str) or c.dtype not in WIRE_DTYPES):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown control.dtype {c.dtype!r}")
        if c.split is not None and type(c.split) is not int:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "control.split must be an integer")
        return c

    def to_meta(self) -> dict[str, Any]:
        """Only the keys that differ from the defaults."""
        meta: dict[str, Any] = {} if self.cache else {"cache": False}
        for name in ("window", "dtype", "split", "key"):
            if getattr(self, name) is not None:
                meta[name] = getattr(self, name)
        return meta


@dataclass
class Forward:
    """Run C context rows and T new tokens through the cloud's layers (§4 FORWARD, §6)."""

    hidden: torch.Tensor  # [C + T, D]: C context rows (re-sent history), then T new tokens
    positions: torch.Tensor  # [C + T] long
    mask: torch.Tensor | None = None  # [T, T] bool among the new tokens, None = causal
    keep: list[int] | None = None  # entries of the previous step's pending block to keep (after crop)
    crop: int | None = None  # truncate the cache to this length first
    context: int = 0  # C
    control: Control = field(default_factory=Control)
    rows: list[int] | None = None  # split-head: the new tokens whose logits the edge wants (None = all)

    @property
    def new_tokens(self) -> int:
        """T."""
        return self.hidden.shape[0] - self.context

    def to_frame(self, session: int, wire_dtype: str) -> Frame:
        """The request, `hidden` in `wire_dtype` (raises OverflowError when it does not fit that codec)."""
        specs, payload = pack_tensors({"hidden": self.hidden}, wire_dtype)
        positions = self.positions.tolist() if isinstance(self.positions, torch.Tensor) else list(self.positions)
        meta: dict[str, Any] = {"tensors": specs, "positions": positions}
        if self.mask is not None:
            meta["mask"] = pack_mask(self.mask)
        if self.keep is not None:
            meta["keep"] = list(self.keep)
        if self.crop is not None:
            meta["crop"] = self.crop
        if self.context:
            meta["context"] = self.context
        control = self.control.to_meta()
        if control:
            meta["control"] = control
        if self.rows is not None:
            meta["rows"] = list(self.rows)
        return Frame(MsgType.FORWARD, session, meta=meta, payload=payload)

    @classmethod
    def from_frame(cls, frame: Frame, max_elements: int) -> Forward:
        """The request, its fields checked in the order of §7 (tensor descriptions, then content)."""
        _expect(frame, MsgType.FORWARD)
        meta = frame.meta
        tensors = unpack_tensors(frame, max_elements)
        if "hidden" not in tensors:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "FORWARD carries no 'hidden' tensor")
        hidden = tensors["hidden"]
        t = hidden.shape[0] if hidden.dim() else 0
        positions = torch.tensor(int_list(meta.get("positions"), "positions"), dtype=torch.long)
        keep = None if meta.get("keep") is None else int_list(meta["keep"], "keep")
        crop = meta.get("crop")
        if crop is not None and type(crop) is not int:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "crop must be an integer")
        context = meta.get("context", 0)
        if type(context) is not int or not 0 <= context < max(t, 1):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "context must be an integer below the number of rows")
        control = Control.from_meta(meta.get("control"))
        mask = None if meta.get("mask") is None else unpack_mask(meta["mask"], t - context)
        rows = None if meta.get("rows") is None else int_list(meta["rows"], "rows")
        return cls(hidden, positions, mask, keep, crop, context, control, rows)


RESULT_RESERVE_BYTES = 4096  # of a RESULT frame, kept for its metadata and framing (split-head rows fit in the rest)


@dataclass
class Result:
    """The new tokens' outputs (§4 RESULT): tail-local `hidden` [T, D]; split-head `hidden` [R, d]
    and `logits` [R, S].

    `round_trip_s` and `wait_s` are not on the wire: the receiving client measures them
    (`CloudClient.receive_forward`); a decoded frame has them at 0."""

    session: int
    tensors: dict[str, torch.Tensor]
    cache_len: int  # cache entries after the step (after crop, keep, append and the policy)
    compute_s: float = 0.0  # seconds from the request's arrival at the scheduler to its output (queue included)
    queue_s: float = 0.0  # of which waiting for a pass of the scheduler
    round_trip_s: float = 0.0  # the edge's: from the request's send to its reply (client-measured)
    wait_s: float = 0.0  # the edge's: how long taking the reply blocked (client-measured)

    def to_frame(self, wire_dtype: str) -> Frame:
        specs, payload = pack_tensors(self.tensors, wire_dtype)
        return Frame(
            MsgType.RESULT,
            self.session,
            payload=payload,
            meta={"tensors": specs, "compute_s": self.compute_s, "queue_s": self.queue_s, "cache_len": self.cache_len},
        )

    @classmethod
    def from_frame(cls, frame: Frame, max_elements: int) -> Result:
        _expect(frame, MsgType.RESULT)
        tensors = unpack_tensors(frame, max_elements)
        if "hidden" not in tensors:
            raise ProtocolError(ErrorCode.BAD_FRAME, "the RESULT carries no hidden tensor")
        m = frame.meta
        return cls(frame.session, tensors, m.get("cache_len", 0), m.get("compute_s", 0.0), m.get("queue_s", 0.0))


@dataclass
class PolicyChange:
    """Tighten the session's cache policy and/or wipe its cache now (§4 POLICY)."""

    cache_policy: CachePolicy | str | None = None  # a string travels as given (the cloud parses it)
    revoke: bool = False
    key: bytes | None = None  # needed to tighten to sealed a session whose cache is not empty

    def to_frame(self, session: int) -> Frame:
        meta: dict[str, Any] = {"revoke": self.revoke}
        if self.cache_policy is not None:
            meta["cache_policy"] = str(self.cache_policy)
        if self.key is not None:
            meta["key"] = self.key
        return Frame(MsgType.POLICY, session, meta=meta)

    @classmethod
    def from_frame(cls, frame: Frame) -> PolicyChange:
        _expect(frame, MsgType.POLICY)
        revoke = frame.meta.get("revoke", False)
        if type(revoke) is not bool:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "revoke must be true or false")
        new = frame.meta.get("cache_policy")
        return cls(None if new is None else parse_policy(new), revoke, frame.meta.get("key"))


@dataclass
class PolicyOk:
    session: int
    cache_policy: CachePolicy
    cache_len: int

    def to_frame(self) -> Frame:
        return Frame(
            MsgType.POLICY_OK, self.session, meta={"cache_policy": str(self.cache_policy), "cache_len": self.cache_len}
        )

    @classmethod
    def from_frame(cls, frame: Frame) -> PolicyOk:
        _expect(frame, MsgType.POLICY_OK)
        return cls(
            frame.session, parse_policy(frame.meta.get("cache_policy", "session")), frame.meta.get("cache_len", 0)
        )


@dataclass
class Close:
    def to_frame(self, session: int) -> Frame:
        return Frame(MsgType.CLOSE, session)


@dataclass
class Closed:
    session: int

    def to_frame(self) -> Frame:
        return Frame(MsgType.CLOSED, self.session)

    @classmethod
    def from_frame(cls, frame: Frame) -> Closed:
        _expect(frame, MsgType.CLOSED)
        return cls(frame.session)


@dataclass
class GoingAway:
    """The cloud is shutting down (SIGTERM): it answered every request it had read and takes no
    more on this connection. Sent encrypted, unsolicited, after the last reply; the edge fails over
    at once (re-sending what went unanswered) instead of waiting for a timeout."""

    reason: str = "shutting down"

    def to_frame(self) -> Frame:
        return Frame(MsgType.GOING_AWAY, meta={"reason": self.reason})

    @classmethod
    def from_frame(cls, frame: Frame) -> GoingAway:
        _expect(frame, MsgType.GOING_AWAY)
        return cls(str(frame.meta.get("reason", "shutting down"))[:200])
