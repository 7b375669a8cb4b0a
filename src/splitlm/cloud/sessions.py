"""Cloud sessions: one KV cache per session, the limits that protect the server, one forward step."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

import torch

from splitlm.model.kv_cache import KVCache
from splitlm.model.shards import CloudModel
from splitlm.transport.errors import ErrorCode, ProtocolError


@dataclass
class ServerLimits:
    max_sessions: int = 64
    max_sessions_per_client: int = 8
    max_tokens_per_session: int = 8192  # cache entries; also capped by the model's max positions
    max_tokens_per_forward: int = 2048
    max_frame_bytes: int = 64 * 2**20
    idle_timeout_s: float = 600.0
    hello_timeout_s: float = 10.0
    max_bad_frames: int = 64  # undecodable / unauthenticated / replayed frames before the connection is closed


@dataclass
class Session:
    id: int
    owner: bytes  # the authenticated client key that opened it; no other client may use it
    wire_dtype: str
    cache: KVCache
    conn: int = 0  # the connection that opened it (the session ends with it)
    tokens_processed: int = 0
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class ForwardRequest:
    hidden: torch.Tensor  # [T, D]
    positions: torch.Tensor  # [T]
    mask: torch.Tensor | None  # [T, T] bool, None = causal
    keep: list[int] | None  # entries of the previous step to keep (applied first)
    crop: int | None  # truncate the cache to this length (applied before keep)


class SessionTable:
    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.sessions: dict[int, Session] = {}

    def open(self, owner: bytes, wire_dtype: str, num_layers: int, conn: int = 0) -> Session:
        """A new session for client key `owner` on connection `conn` (limits count per client key)."""
        if len(self.sessions) >= self.limits.max_sessions:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED, f"server is at its limit of {self.limits.max_sessions} sessions")
        if sum(s.owner == owner for s in self.sessions.values()) >= self.limits.max_sessions_per_client:
            raise ProtocolError(ErrorCode.LIMIT_EXCEEDED,
                                f"at most {self.limits.max_sessions_per_client} sessions per client")
        sid = secrets.randbits(63) or 1
        while sid in self.sessions:
            sid = secrets.randbits(63) or 1
        session = Session(sid, owner, wire_dtype, KVCache(num_layers), conn)
        self.sessions[sid] = session
        return session

    def get(self, sid: int, owner: bytes, conn: int | None = None) -> Session:
        """The session, if `owner` (and, when given, connection `conn`) opened it."""
        session = self.sessions.get(sid)
        if session is None or session.owner != owner or (conn is not None and session.conn != conn):
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"unknown session {sid:#x}")  # same answer: no oracle
        session.last_used = time.monotonic()
        return session

    def close(self, sid: int, owner: bytes, conn: int | None = None) -> None:
        self.get(sid, owner, conn)
        del self.sessions[sid]

    def drop_connection(self, conn: int) -> None:
        for sid in [s.id for s in self.sessions.values() if s.conn == conn]:
            del self.sessions[sid]

    def expire(self) -> int:
        cutoff = time.monotonic() - self.limits.idle_timeout_s
        stale = [s.id for s in self.sessions.values() if s.last_used < cutoff]
        for sid in stale:
            del self.sessions[sid]
        return len(stale)


def validate(req: ForwardRequest, session: Session, model: CloudModel, limits: ServerLimits) -> None:
    """Check a forward request against the model and the session before touching any state."""
    cfg = model.cfg
    if req.hidden.dim() != 2 or req.hidden.shape[1] != cfg.hidden_size:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden must be [T, {cfg.hidden_size}], got {list(req.hidden.shape)}")
    t = req.hidden.shape[0]
    if t == 0 or t > limits.max_tokens_per_forward:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a forward carries 1..{limits.max_tokens_per_forward} tokens, got {t}")
    if req.positions.shape != (t,):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{t} tokens need {t} positions, got {req.positions.numel()}")
    max_pos = min(cfg.max_position_embeddings, limits.max_tokens_per_session)
    if int(req.positions.min()) < 0 or int(req.positions.max()) >= max_pos:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"positions must lie in [0, {max_pos})")
    if not bool(torch.isfinite(req.hidden).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "hidden states contain NaN or infinity")
    cache = session.cache
    length = cache.length
    if req.crop is not None:
        if not 0 <= req.crop <= length:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"crop to {req.crop} outside the cache (length {length})")
        length = req.crop
    if req.keep is not None:
        pending = length - min(cache.pending_start, length)
        if any(not 0 <= i < pending for i in req.keep) or len(set(req.keep)) != len(req.keep):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"keep indices must be distinct and in [0, {pending})")
        length = length - pending + len(req.keep)
    if length + t > limits.max_tokens_per_session:
        raise ProtocolError(ErrorCode.LIMIT_EXCEEDED,
                            f"session would hold {length + t} tokens; the limit is {limits.max_tokens_per_session}")


@torch.inference_mode()
def run_forward(model: CloudModel, session: Session, req: ForwardRequest) -> torch.Tensor:
    if req.crop is not None:
        session.cache.crop(req.crop)
    if req.keep is not None:
        session.cache.keep(req.keep)
    dtype = next(model.parameters()).dtype
    out = model(req.hidden[None].to(dtype), req.positions, req.mask, session.cache)[0]  # [T, D]
    session.tokens_processed += req.hidden.shape[0]
    return out
