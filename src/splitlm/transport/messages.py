"""The typed edge-cloud messages: one dataclass per request and reply, and the one place that turns
each into a `Frame` (`to_frame`) and back (`from_frame`), with the checks docs/protocol.md §4 and §7
give for its fields.

Both sides use these: the edge's `CloudClient` builds requests and reads replies, the cloud's server
reads requests and builds replies. A field that is malformed on the wire raises `ProtocolError`
with the code of §7 (`BAD_FRAME` for tensor descriptions, `BAD_REQUEST` for content); checks that
need the model or the session (shapes, positions, budgets) stay with the cloud. No other module reads
or writes a frame's metadata: every field of it is a typed field of its message here, a reply's `ref`
(§3) included (`answering` sets it, `reply_ref` reads it).

    request           reply
    Hello        ->   HelloOk + ServerInfo (`transport.hello`; the handshake itself is `handshake.py`)
    Open         ->   Opened
    Forward      ->   Result
    PolicyChange ->   PolicyOk
    Close        ->   Closed
    (any)        ->   ErrorReply (ERROR)
    (none)      <-    GoingAway (the cloud shuts down: unsolicited, in place of the next reply)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from splitlm.transport.codecs import WIRE_DTYPES
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.frames import (
    Frame,
    MsgType,
    pack_mask,
    pack_tensors,
    unpack_mask,
    unpack_tensors,
)
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


def expect_type(frame: Frame, msg_type: MsgType) -> None:
    if frame.type != msg_type:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected {msg_type.name}, got {frame.type.name}")


def answering(reply: Frame, ref: int | None) -> Frame:
    """`reply` carrying `ref`, the sequence number of the request it answers (§3; None: no `ref`)."""
    if ref is not None:
        reply.meta["ref"] = ref
    return reply


def reply_ref(reply: Frame) -> int | None:
    """The `ref` of a reply: the sequence number of the request it answers (None: it carries none)."""
    ref = reply.meta.get("ref")
    return ref if type(ref) is int else None


@dataclass
class ErrorReply:
    """ERROR (§7): why a request (or a frame) was refused. `code` is the number on the wire (an
    `ErrorCode`, or an unknown number from a newer peer: `error_code` is then None)."""

    code: int | None
    message: str = ""
    name: str | None = None  # the code's name as the cloud wrote it
    session: int = 0
    ref: int | None = None  # seq of the offending frame, when its header could be read

    @classmethod
    def of(cls, err: ProtocolError, session: int = 0, ref: int | None = None) -> ErrorReply:
        return cls(int(err.code), err.message, err.code.name, session, ref)

    @property
    def error_code(self) -> ErrorCode | None:
        return ErrorCode(self.code) if self.code in ErrorCode._value2member_map_ else None

    def to_frame(self, seq: int = 0) -> Frame:
        meta: dict[str, Any] = {"code": self.code, "name": self.name, "message": self.message}
        return answering(Frame(MsgType.ERROR, self.session, seq, meta), self.ref)

    @classmethod
    def from_frame(cls, frame: Frame) -> ErrorReply:
        expect_type(frame, MsgType.ERROR)
        m = frame.meta
        code, name = m.get("code"), m.get("name")
        return cls(
            code if type(code) is int else None,
            str(m.get("message", "")),
            name if isinstance(name, str) else None,
            frame.session,
            reply_ref(frame),
        )


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
        expect_type(frame, MsgType.OPEN)
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
    ref: int | None = None  # the OPEN's sequence number

    def to_frame(self) -> Frame:
        meta: dict[str, Any] = {
            "wire_dtype": self.wire_dtype,
            "cache_policy": str(self.cache_policy),
            "topology": self.topology,
        }
        if self.vocab_size is not None:
            meta["vocab_size"] = self.vocab_size
        return answering(Frame(MsgType.OPENED, self.session, meta=meta), self.ref)

    @classmethod
    def from_frame(cls, frame: Frame) -> Opened:
        expect_type(frame, MsgType.OPENED)
        m = frame.meta
        return cls(
            frame.session,
            m.get("wire_dtype", "fp16"),
            parse_policy(m.get("cache_policy", "session")),
            m.get("topology", "tail-local"),
            m.get("vocab_size"),
            reply_ref(frame),
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
        expect_type(frame, MsgType.FORWARD)
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
    """The new tokens' outputs (§4 RESULT): tail-local `hidden` [T, D]; split-head `hidden` (h[:d])
    [R, d] and `logits` [R, S]. On the wire they are the tensors named "hidden" and "logits".

    `round_trip_s` and `wait_s` are not on the wire: the receiving client measures them
    (`CloudClient.receive_forward`); a decoded frame has them at 0."""

    session: int
    hidden: torch.Tensor
    cache_len: int  # cache entries after the step (after crop, keep, append and the policy)
    logits: torch.Tensor | None = None  # split-head only
    compute_s: float = 0.0  # seconds from the request's arrival at the scheduler to its output (queue included)
    queue_s: float = 0.0  # of which waiting for a pass of the scheduler
    round_trip_s: float = 0.0  # the edge's: from the request's send to its reply (client-measured)
    wait_s: float = 0.0  # the edge's: how long taking the reply blocked (client-measured)
    ref: int | None = None  # the FORWARD's sequence number (the cloud's servicer sets it: `answering`)

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + (0 if self.logits is None else self.logits.nbytes)

    def to_frame(self, wire_dtype: str) -> Frame:
        tensors = {"hidden": self.hidden} if self.logits is None else {"hidden": self.hidden, "logits": self.logits}
        specs, payload = pack_tensors(tensors, wire_dtype)
        meta = {"tensors": specs, "compute_s": self.compute_s, "queue_s": self.queue_s, "cache_len": self.cache_len}
        return answering(Frame(MsgType.RESULT, self.session, payload=payload, meta=meta), self.ref)

    @classmethod
    def from_frame(cls, frame: Frame, max_elements: int) -> Result:
        expect_type(frame, MsgType.RESULT)
        tensors = unpack_tensors(frame, max_elements)
        if "hidden" not in tensors:
            raise ProtocolError(ErrorCode.BAD_FRAME, "the RESULT carries no hidden tensor")
        m = frame.meta
        return cls(
            frame.session,
            tensors["hidden"],
            m.get("cache_len", 0),
            tensors.get("logits"),
            m.get("compute_s", 0.0),
            m.get("queue_s", 0.0),
            ref=reply_ref(frame),
        )


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
        expect_type(frame, MsgType.POLICY)
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
    ref: int | None = None  # the POLICY's sequence number

    def to_frame(self) -> Frame:
        meta = {"cache_policy": str(self.cache_policy), "cache_len": self.cache_len}
        return answering(Frame(MsgType.POLICY_OK, self.session, meta=meta), self.ref)

    @classmethod
    def from_frame(cls, frame: Frame) -> PolicyOk:
        expect_type(frame, MsgType.POLICY_OK)
        m = frame.meta
        return cls(
            frame.session, parse_policy(m.get("cache_policy", "session")), m.get("cache_len", 0), reply_ref(frame)
        )


@dataclass
class Close:
    def to_frame(self, session: int) -> Frame:
        return Frame(MsgType.CLOSE, session)


@dataclass
class Closed:
    session: int
    ref: int | None = None  # the CLOSE's sequence number

    def to_frame(self) -> Frame:
        return answering(Frame(MsgType.CLOSED, self.session), self.ref)

    @classmethod
    def from_frame(cls, frame: Frame) -> Closed:
        expect_type(frame, MsgType.CLOSED)
        return cls(frame.session, reply_ref(frame))


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
        expect_type(frame, MsgType.GOING_AWAY)
        return cls(str(frame.meta.get("reason", "shutting down"))[:200])
