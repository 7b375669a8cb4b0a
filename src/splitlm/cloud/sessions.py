"""The cloud's session table: one KV cache per session under its cache policy, the limits that protect
the server, preemption when the KV budget is full (`cloud.preemption`), and the checks a FORWARD
passes before it touches any state (`validate`). Running the layers is `cloud.runner`'s."""

from __future__ import annotations

import contextlib
import math
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from splitlm.cloud.budget import KVBudget, size_text
from splitlm.cloud.metrics import CloudMetrics
from splitlm.cloud.preemption import OPEN_GRACE_S, Room, Tombstones, room
from splitlm.cloud.sealing import check_key, seal, unseal
from splitlm.model.kv_cache import KVCache
from splitlm.model.paged_kv import BlockPool, PagedKVCache
from splitlm.model.shards import CloudModel
from splitlm.transport.errors import ErrorCode, ProtocolError
from splitlm.transport.messages import Forward
from splitlm.transport.policy import CachePolicy


@dataclass
class ServerLimits:
    max_sessions: int = 64
    max_sessions_per_client: int = 8
    max_tokens_per_session: int = 8192  # cache entries; also capped by the model's max positions
    max_tokens_per_forward: int = 2048
    max_frame_bytes: int = 64 * 2**20
    idle_timeout_s: float = 300.0  # a session unused this long is freed (PREEMPTED: its edge replays); 0 = never
    connection_idle_timeout_s: float = 600.0  # a connection that sends nothing this long is closed; 0 = never
    hello_timeout_s: float = 10.0
    upgrade_timeout_s: float = 30.0  # TLS and the WebSocket upgrade of a new connection (a loaded host is slow)
    max_bad_frames: int = 64  # undecodable / unauthenticated / replayed frames before the connection is closed
    kv_budget_bytes: int = 0  # what all sessions' KV caches may take on the device (`cloud.budget`); 0 = automatic
    ping_interval_s: float | None = 20.0  # keepalive pings (a connection silent to them as long again is closed)
    drain_timeout_s: float = 30.0  # SIGTERM: the most time in-flight steps get to finish before the server stops
    malloc_trim_s: float = 30.0  # give freed host memory back to the system this often (`cloud.memory`); 0 = never


@dataclass
class Session:
    id: int
    owner: bytes  # the authenticated client key that opened it; no other client may use it
    wire_dtype: str
    cache: KVCache | PagedKVCache
    conn: int = 0  # the connection that opened it (the session ends with it)
    policy: CachePolicy = field(default_factory=CachePolicy)
    sealed: bytes | None = None  # the cache, encrypted (policy "sealed"); `cache` is then empty
    sealed_shape: tuple[int, int] = (0, 0)  # (length, pending_start) of the sealed cache
    seal_counter: int = 0
    vocab: torch.Tensor | None = None  # split-head: the authorised token ids [S], ascending, on the model's device
    tokens_processed: int = 0
    last_used: float = field(default_factory=time.monotonic)
    opened: float = field(default_factory=time.monotonic)  # its age: a younger session never frees an older running one
    kv_reserved: int = 0  # bytes of the KV budget this session holds (`cloud.budget`)
    closed: bool = False  # closed, dropped with its connection or preempted: queued requests are not computed
    active: int = 0  # its FORWARDs between arrival and reply (queued, computing, answered): never preempted then
    grace_until: float = 0.0  # time.monotonic() until which a session opened and not yet used is not preempted

    @property
    def cache_shape(self) -> tuple[int, int]:
        """(length, pending_start) of the cache, sealed or not."""
        return self.sealed_shape if self.sealed is not None else (self.cache.length, self.cache.pending_start)

    def wipe(self) -> None:
        self.cache.clear()
        self.sealed, self.sealed_shape = None, (0, 0)

    def tighten(self, new: CachePolicy, key: bytes | None = None) -> None:
        """Switch to a policy at least as tight as the current one and apply it to the cache now."""
        if not self.policy.allows(new):
            raise ProtocolError(ErrorCode.POLICY, f"cache policy {self.policy} cannot be loosened to {new}")
        if new.retention == 0:
            self.wipe()
        elif new.mode == "window":  # never cut into the pending block (the edge may still keep from it)
            self.cache.retain_last(max(new.window, self.cache.length - self.cache.pending_start))
        elif new.sealed and self.sealed is None and self.cache.length:
            self.seal(check_key(key))
        self.policy = new

    def restore(self, key: bytes | None, device: torch.device) -> None:
        """A sealed cache unsealed onto `device` (SEALED_KEY, nothing changed, when `key` does not open
        it); nothing to do when the cache is not sealed."""
        if self.sealed is None:
            return
        self.cache = unseal(self.sealed, key, self.id, self.seal_counter, self.cache, device)
        self.sealed, self.sealed_shape = None, (0, 0)

    def apply_policy(self, key: bytes | None) -> None:
        """After a step: the cache wiped (policy none), trimmed (window) or sealed with `key`."""
        if self.policy.retention == 0:
            self.cache.clear()
        elif self.policy.mode == "window":
            self.cache.retain_last(self.policy.window)
        elif self.policy.sealed:
            self.seal(key)

    def seal(self, key: bytes) -> None:
        self.seal_counter += 1
        self.sealed = seal(self.cache, key, self.id, self.seal_counter)
        self.sealed_shape = (self.cache.length, self.cache.pending_start)
        self.cache.clear()  # (a paged cache gives its blocks back)


class SessionTable:
    """The open sessions; with a `budget`, what their KV caches reserve of it. When it is full, sessions
    are preempted by the rule of `cloud.preemption` (idle ones first; never an older running one for a
    younger); CAPACITY only when none may make room. With a
    `pool`, the sessions' caches are paged in it (`splitlm.model.paged_kv`), else contiguous `KVCache`s."""

    def __init__(
        self,
        limits: ServerLimits,
        budget: KVBudget | None = None,
        metrics: CloudMetrics | None = None,
        pool: BlockPool | None = None,
    ):
        self.limits, self.budget, self.metrics, self.pool = limits, budget, metrics, pool
        self.sessions: dict[int, Session] = {}
        self.tombstones = Tombstones()

    @property
    def kv_reserved(self) -> int:
        return sum(s.kv_reserved for s in self.sessions.values())

    def make_room(self, more: int, what: str, requester: Session | None = None, wait: bool = False) -> bool:
        """Room for `more` bytes of reservations (`requester`: the session whose step needs them; None:
        an OPEN): idle sessions, or running ones younger than the requester, are preempted if needed
        (`cloud.preemption`). False when `wait` and enough is held by younger sessions mid-request
        (try again after their pass); else CAPACITY when nothing can make room now (nothing changes)."""
        if self.budget is None:
            return True
        over = self.kv_reserved + more - self.budget.budget_bytes
        if over <= 0:
            return True
        plan = room(self.sessions.values(), over, requester)
        if plan.victims is None:
            if wait and plan.wait:
                return False
            raise ProtocolError(ErrorCode.CAPACITY, self.capacity_text(over, what, plan))
        for victim in plan.victims:
            self.preempt(victim.id, idle=False)
        return True

    def capacity_text(self, over: int, what: str, plan: Room) -> str:
        """What a CAPACITY refusal says: how much is missing and what holds the budget."""
        held = ", ".join(f"{size_text(n)} {why}" for why, n in sorted(plan.held.items()) if n) or "nothing"
        return (
            f"the cloud's KV memory ({size_text(self.budget.budget_bytes)}) is full: {what}, "
            f"{size_text(over)} short; {len(self.sessions)} sessions hold it ({held}) and may not be "
            "freed for this request; retry later or use another cloud"
        )

    def check_fits_budget(self, entries: int) -> None:
        """A cache of `entries` entries larger than the whole budget never fits: EXCEEDS_BUDGET (permanent)."""
        if self.budget is not None and self.budget.need(entries) > self.budget.budget_bytes:
            raise ProtocolError(
                ErrorCode.EXCEEDS_BUDGET,
                f"this request needs {entries} cache entries ({size_text(self.budget.need(entries))}); "
                f"this cloud's whole KV budget holds {self.budget.max_entries} "
                f"({size_text(self.budget.budget_bytes)}): it can never fit here",
            )

    def preempt(self, sid: int, idle: bool) -> None:
        """Free session `sid`'s cache; its edge is told PREEMPTED on its next request (`idle`: it sat
        unused for the idle timeout, else it made room for another)."""
        session = self.sessions[sid]
        self.remove(sid)
        session.wipe()
        self.tombstones.add(sid, session.owner, session.conn)
        if self.metrics is not None:
            self.metrics.count_preemption(idle)

    def reserve(self, session: Session, entries: int, wait: bool = False) -> bool:
        """Reserve what `session`'s cache holds while a pass appends to it (`entries` during the pass),
        preempting sessions for it (`make_room`); EXCEEDS_BUDGET when the whole budget could not hold
        it. False (`wait`): the room is held by younger sessions mid-request, try again after their
        pass; else CAPACITY when there is no room now (nothing changes either way)."""
        if self.budget is None:
            return True
        self.check_fits_budget(entries)
        need = max(session.cache.nbytes(), self.budget.need(entries))
        if not self.make_room(need - session.kv_reserved, f"{entries} entries do not fit", session, wait):
            return False
        session.kv_reserved = need
        return True

    def settle(self, session: Session) -> None:
        """After a pass: the session keeps what its cache still allocates (at least one block)."""
        session.last_used = time.monotonic()
        if self.budget is not None:
            session.kv_reserved = max(session.cache.nbytes(), self.budget.need(session.cache_shape[0]))

    @contextlib.contextmanager
    def active(self, session: Session) -> Iterator[Session]:
        """`session` is mid-request while in this block (a FORWARD from arrival to reply): never preempted."""
        session.active += 1
        session.grace_until = 0.0
        try:
            yield session
        finally:
            session.active -= 1

    def open(
        self, owner: bytes, wire_dtype: str, num_layers: int, conn: int = 0, policy: CachePolicy | None = None
    ) -> Session:
        """A new session for client key `owner` on connection `conn` (limits count per client key)."""
        if len(self.sessions) >= self.limits.max_sessions:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED, f"server is at its limit of {self.limits.max_sessions} sessions"
            )
        if sum(s.owner == owner for s in self.sessions.values()) >= self.limits.max_sessions_per_client:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED, f"at most {self.limits.max_sessions_per_client} sessions per client"
            )
        first = self.budget.need(1) if self.budget is not None else 0
        self.check_fits_budget(1)
        self.make_room(first, "no room for a new session")
        sid = secrets.randbits(63) or 1
        while sid in self.sessions or sid in self.tombstones.stones:
            sid = secrets.randbits(63) or 1
        session = Session(
            sid,
            owner,
            wire_dtype,
            KVCache(num_layers) if self.pool is None else self.pool.new_cache(),
            conn,
            policy or CachePolicy(),
            kv_reserved=first,
            grace_until=time.monotonic() + OPEN_GRACE_S,
        )
        self.sessions[sid] = session
        if self.tombstones.reopened(owner) and self.metrics is not None:
            self.metrics.count_replay()
        return session

    def get(self, sid: int, owner: bytes, conn: int | None = None) -> Session:
        """The session, if `owner` (and, when given, connection `conn`) opened it; PREEMPTED if it was freed."""
        session = self.sessions.get(sid)
        if session is None or session.owner != owner or (conn is not None and session.conn != conn):
            stone = self.tombstones.find(sid, owner, conn)
            if stone is not None:
                self.tombstones.tell(stone)
                raise ProtocolError(
                    ErrorCode.PREEMPTED,
                    f"session {sid:#x} was freed to make room (or sat idle): open a new session and replay its context",
                )
            raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"unknown session {sid:#x}")  # same answer: no oracle
        session.last_used = time.monotonic()
        return session

    def remove(self, sid: int) -> None:
        """End session `sid`, whoever holds it: its queued requests are dropped, never computed."""
        self.sessions.pop(sid).closed = True

    def close(self, sid: int, owner: bytes, conn: int | None = None) -> None:
        """End a session; closing a preempted one only forgets its tombstone."""
        if sid not in self.sessions and self.tombstones.find(sid, owner, conn) is not None:
            self.tombstones.forget(sid)
            return
        self.get(sid, owner, conn)
        self.remove(sid)

    def drop_connection(self, conn: int) -> None:
        """A connection ended: its sessions end (their caches are freed now) and its tombstones go."""
        for sid in [s.id for s in self.sessions.values() if s.conn == conn]:
            self.remove(sid)
        self.tombstones.drop_connection(conn)

    def expire(self) -> int:
        """Free the sessions unused for the idle timeout (0: never), as preempted; how many."""
        if not self.limits.idle_timeout_s:
            return 0
        cutoff = time.monotonic() - self.limits.idle_timeout_s
        stale = [s.id for s in self.sessions.values() if s.last_used < cutoff and not s.active]
        for sid in stale:
            self.preempt(sid, idle=True)
        return len(stale)


def validate(req: Forward, session: Session, model: CloudModel, limits: ServerLimits) -> int:
    """Check a forward request against the model, the session and its policy before touching any state.
    Returns the entries its cache holds during the pass (after crop and keep, with the new rows)."""
    check_rows(req, model, limits)
    check_values(req, model, limits)
    check_control(req, session, model)
    return entries_during_pass(req, session, limits)


def check_rows(req: Forward, model: CloudModel, limits: ServerLimits) -> None:
    """The shapes of hidden [C + T, D], positions [C + T], rows and the mask [T, T]."""
    d = model.cfg.hidden_size
    if req.hidden.dim() != 2 or req.hidden.shape[1] != d:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hidden must be [T, {d}], got {list(req.hidden.shape)}")
    rows = req.hidden.shape[0]
    if rows == 0 or rows > limits.max_tokens_per_forward:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"a forward carries 1..{limits.max_tokens_per_forward} tokens, got {rows}"
        )
    if type(req.context) is not int or not 0 <= req.context < rows:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"context must be an integer in [0, {rows}) (rows of hidden)")
    t = rows - req.context
    if req.positions.shape != (rows,):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{rows} rows need {rows} positions, got {req.positions.numel()}")
    if req.rows is not None:
        check_logit_rows(req.rows, t, model)
    if req.mask is not None and req.mask.shape != (t, t):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"the mask covers the {t} new tokens, not {list(req.mask.shape)}")


def check_logit_rows(rows: list[int], t: int, model: CloudModel) -> None:
    """Split-head: the new tokens whose logits the edge asks for."""
    if not model.split_head:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            "rows only apply to a split-head cloud (this one returns hidden states for every new token)",
        )
    if any(not 0 <= r < t for r in rows) or len(set(rows)) != len(rows):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"rows must be distinct and in [0, {t}) (the new tokens)")


def check_values(req: Forward, model: CloudModel, limits: ServerLimits) -> None:
    """Positions within the model's and the session's reach; finite hidden states."""
    max_pos = min(model.cfg.max_position_embeddings, limits.max_tokens_per_session)
    if int(req.positions.min()) < 0 or int(req.positions.max()) >= max_pos:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"positions must lie in [0, {max_pos})")
    if not bool(torch.isfinite(req.hidden).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "hidden states contain NaN or infinity")


def check_control(req: Forward, session: Session, model: CloudModel) -> None:
    """The control tuple against the shard (the split layer) and the session's cache policy."""
    ctl, policy = req.control, session.policy
    if ctl.split is not None and ctl.split != model.manifest.cloud_layers[0]:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"this cloud runs layers from {model.manifest.cloud_layers[0]}, not from {ctl.split}"
        )
    if ctl.cache and policy.retention == 0:
        raise ProtocolError(ErrorCode.POLICY, "the session's cache policy is none: a request cannot use cached history")
    if ctl.window is not None and not policy.allows(CachePolicy("window", ctl.window)):
        raise ProtocolError(ErrorCode.POLICY, f"control.window {ctl.window} would loosen cache policy {policy}")
    window = min(x for x in (ctl.window, policy.window, math.inf) if x is not None)
    if req.new_tokens > window:
        raise ProtocolError(
            ErrorCode.POLICY, f"under a window of {window} a request carries at most {window} new tokens"
        )
    if policy.sealed:
        check_key(ctl.key)


def entries_during_pass(req: Forward, session: Session, limits: ServerLimits) -> int:
    """The cache's length after crop and keep, plus the request's rows (within the session's limit)."""
    length, pending_start = session.cache_shape if req.control.cache else (0, 0)
    if req.crop is not None:
        if not 0 <= req.crop <= length:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"crop to {req.crop} outside the cache (length {length})")
        length = req.crop
    if req.keep is not None:
        pending = length - min(pending_start, length)
        if any(not 0 <= i < pending for i in req.keep) or len(set(req.keep)) != len(req.keep):
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"keep indices must be distinct and in [0, {pending})")
        length = length - pending + len(req.keep)
    rows = req.hidden.shape[0]
    if length + rows > limits.max_tokens_per_session:
        raise ProtocolError(
            ErrorCode.LIMIT_EXCEEDED,
            f"session would hold {length + rows} tokens; the limit is {limits.max_tokens_per_session}",
        )
    return length + rows
