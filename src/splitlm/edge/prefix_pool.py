"""Prefix reuse across API requests: a bounded pool of live conversation states (docs/prefix-reuse.md).

A pooled state is an `EdgeSession` (the edge's head and tail caches, the head outputs of every
committed token, and the cloud session holding the middle layers' cache) together with the token
ids its caches hold. A request whose prompt extends a pooled prefix takes that state (exclusively),
crops both sides to the longest common run of token ids and prefills only the rest; when it
finishes, the state (now holding prompt + answer) goes back to the pool under those ids.

    pool = PrefixPool(edge, PoolLimits(sessions=4, megabytes=256, ttl_s=300))
    for piece in pool.stream(GenerationRequest(prompt_ids, 128, spec="auto")):
        ...

The endpoint decides (`reuse_allowed`): under `none` nothing is pooled; under `window:N` only
requests whose whole context fits in N (where the output does not depend on where earlier
requests were cut); `session` and `sealed` states are pooled (a sealed one's cloud cache stays
encrypted between requests under the key the pooled session keeps on the edge). The pool is
bounded by a count, by bytes on each side (the edge's caches and history as allocated; the cloud's
middle-layer K/V entries, estimated at 4 bytes a value) and by an idle time after which a pooled
state is closed (the cloud drops its cache), least recently used first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from splitlm import SplitLMError
from splitlm.edge.conversation import common_prefix
from splitlm.edge.request import GenerationRequest
from splitlm.edge.results import GenerationResult, Stream
from splitlm.edge.session import EdgeSession
from splitlm.edge.stream_prefill import Interrupted
from splitlm.transport.client import CloudError
from splitlm.transport.errors import ErrorCode
from splitlm.transport.policy import CachePolicy

log = logging.getLogger(__name__)

DEFAULT_SESSIONS = 4  # with --max-concurrent 4, 8 cloud sessions in all: the cloud's default per client
DEFAULT_MEGABYTES = 256.0  # per side
DEFAULT_TTL_S = 300.0  # under the cloud's idle timeout (600 s by default)
CLOUD_VALUE_BYTES = 4  # the cloud's K/V entries counted as fp32 (an upper bound: a bf16 cloud holds half)
FULL = (ErrorCode.LIMIT_EXCEEDED, ErrorCode.CAPACITY)  # a new session refused: a pooled one may make room


@dataclass(frozen=True)
class PoolLimits:
    """How much the pool may hold (`serve-edge --prefix-pool`, `--prefix-pool-mb`, `--prefix-pool-ttl`)."""

    sessions: int = DEFAULT_SESSIONS  # pooled states at most; 0 disables reuse
    megabytes: float = DEFAULT_MEGABYTES  # on each side: the edge's memory and the cloud's KV; 0 disables reuse
    ttl_s: float = DEFAULT_TTL_S  # a state idle this long is closed; 0: no limit

    @property
    def enabled(self) -> bool:
        return self.sessions > 0 and self.megabytes > 0

    @property
    def cap_bytes(self) -> int:
        return int(self.megabytes * 2**20)


@dataclass
class PoolCounters:
    """Totals since the pool was made (what `/metrics` reports)."""

    queried_tokens: int = 0  # prompt tokens of the requests that looked for a pooled prefix
    hit_tokens: int = 0  # of those, the tokens reused (not prefilled again)
    evictions: int = 0  # pooled states closed for the limits or the idle time
    fallbacks: int = 0  # reused states whose cloud session had gone: the prompt was prefilled afresh


@dataclass
class PoolUsage:
    """What the pooled states hold now."""

    sessions: int = 0
    edge_bytes: int = 0
    cloud_bytes: int = 0


@dataclass
class Pooled:
    """A pooled state: its session, the token ids its caches hold, in order, and its cost."""

    session: EdgeSession
    ids: list[int]
    edge_bytes: int
    cloud_bytes: int
    since: float = field(default_factory=time.monotonic)  # returned to the pool at


@dataclass
class Lease:
    """A request's session (pooled or fresh), held by that request alone."""

    session: EdgeSession
    cached: int  # prompt tokens already in its caches
    poolable: bool  # may go back to the pool after the request


def reuse_allowed(policy: CachePolicy, context: int) -> bool:
    """Whether a request under `policy` whose context may reach `context` tokens (prompt + max
    tokens) may take or leave pooled state: never under `none`; under `window:N` only when the
    context fits in N (beyond it the middle layers' view depends on where requests were cut)."""
    if policy.retention == 0:
        return False
    return policy.window is None or context <= policy.window


def edge_bytes(session: EdgeSession) -> int:
    """The edge memory a session holds: both caches as allocated, and the history of head outputs."""
    history = session.link.history
    return (
        session.layers.head_cache.nbytes()
        + session.layers.tail_cache.nbytes()
        + history.numel() * history.element_size()
    )


def close_quietly(session: EdgeSession) -> None:
    try:
        session.close()
    except Exception as e:  # the session is gone either way
        log.warning("closing a cloud session: %s", e)


class PrefixPool:
    """Pooled conversation states of one `splitlm.edge.Edge`, shared by the API's request threads."""

    def __init__(self, edge, limits: PoolLimits | None = None):
        self.edge, self.limits = edge, limits or PoolLimits()
        self.lock = threading.Lock()
        self.entries: list[Pooled] = []  # least recently used first
        self.counters = PoolCounters()
        first, end = edge.model.manifest.cloud_layers
        cfg = edge.cfg
        self.cloud_token_bytes = (end - first) * 2 * cfg.num_kv_heads * cfg.head_dim * CLOUD_VALUE_BYTES
        self.closed = threading.Event()
        self.sweeper: threading.Thread | None = None
        if self.limits.enabled and self.limits.ttl_s > 0:
            self.sweeper = threading.Thread(target=self._sweep, name="splitlm-prefix-pool", daemon=True)
            self.sweeper.start()

    # -- the entry point -----------------------------------------------------------------------------
    def stream(
        self,
        request: GenerationRequest,
        cache_policy: str | CachePolicy | None = None,
        interrupt: Callable[[], bool] | None = None,
    ) -> Stream:
        """`Edge.stream` of `request` from the longest pooled prefix the request's cache policy (default:
        the edge's) allows; the state goes back to the pool after the request, or, if it was cancelled,
        cropped back to what was committed. `interrupt`: asked between a long prefill's chunks; True
        ends the request there, without a result."""
        prompt_ids = self.edge.text.prompt_ids(request.prompt, request.chat)
        try:
            policy = CachePolicy.parse(cache_policy) if cache_policy else self.edge.cache_policy
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        request = replace(request, prompt=prompt_ids, chat=False)
        return Stream(self._run(request, prompt_ids, policy, interrupt))

    def _run(
        self,
        request: GenerationRequest,
        prompt_ids: list[int],
        policy: CachePolicy,
        interrupt: Callable[[], bool] | None = None,
    ) -> Iterator[tuple[str, GenerationResult | None]]:
        lease = self.checkout(prompt_ids, policy, len(prompt_ids) + request.max_new_tokens)
        lease.session.interrupt = interrupt
        try:
            result = yield from self._generate(lease, request)
        except Interrupted:  # its caller asked it to stop: nothing to report
            self.release(lease, prompt_ids[: lease.cached])
            return
        except GeneratorExit:  # cancelled: what was committed stays, the half-finished step goes
            self.release(lease, prompt_ids[: len(prompt_ids) if lease.session.stats.new_tokens else lease.cached])
            raise
        except CloudError:
            close_quietly(lease.session)
            raise
        except BaseException:
            self.release(lease, prompt_ids[: lease.cached])
            raise
        self.release(lease, (prompt_ids + result.token_ids)[: lease.session.length])

    def _generate(self, lease: Lease, request: GenerationRequest):
        """The request on the lease's session; a pooled one whose cloud session has gone (expired,
        closed by the cloud) before the first token: again on a fresh session, from the start."""
        try:
            return (yield from self._pieces(lease, request))
        except CloudError as e:
            if not lease.cached or e.retryable or lease.session.stats.new_tokens:
                raise
            log.warning("a pooled cloud session failed (%s): prefilling the prompt afresh", e)
            with self.lock:
                self.counters.fallbacks += 1
                self.counters.hit_tokens -= lease.cached
            session = self.fresh(lease.session.policy)  # if it fails, the caller closes the lost one (once)
            close_quietly(lease.session)
            session.interrupt, lease.session, lease.cached = lease.session.interrupt, session, 0
            return (yield from self._pieces(lease, request))

    def _pieces(self, lease: Lease, request: GenerationRequest):
        stream = Stream(self.edge.run_ids(request, lease.session, lease.cached))
        try:
            for piece in stream:
                yield piece, None
        finally:
            stream.close()  # a cancelled decoding loop undoes its own half-step first
        yield "", stream.result
        return stream.result

    # -- checking out and in ---------------------------------------------------------------------------
    def checkout(self, prompt_ids: list[int], policy: CachePolicy, context: int) -> Lease:
        """The session a request runs on: the pooled state with the longest usable match, cropped to
        it, or a fresh session (never pooled afterwards where the policy forbids reuse)."""
        if not (self.limits.enabled and reuse_allowed(policy, context)):
            return Lease(self.fresh(policy), 0, False)
        with self.lock:
            self.counters.queried_tokens += len(prompt_ids)
            entry, match = self._best(prompt_ids, policy)
            if entry is not None:
                self.entries.remove(entry)
                self.counters.hit_tokens += match
        if entry is None:
            return Lease(self.fresh(policy), 0, True)
        try:
            entry.session.crop(match)  # the cloud hears it with the prefill
        except (SplitLMError, CloudError) as e:
            log.warning("dropping a pooled session that cannot be cropped: %s", e)
            close_quietly(entry.session)
            with self.lock:
                self.counters.hit_tokens -= match
            return Lease(self.fresh(policy), 0, True)
        return Lease(entry.session, match, True)

    def _best(self, prompt_ids: list[int], policy: CachePolicy) -> tuple[Pooled | None, int]:
        """The pooled state to continue from (under the lock) and how many of its tokens to keep: the
        longest match, at least one prompt token left to feed; a state is only taken when the
        request keeps at least as many of its tokens as it discards (a shared prefix does not wipe
        another conversation's longer state); of equal matches, the one that discards least."""
        best, best_key = None, (0, 0)
        for entry in self.entries:
            if entry.session.policy != policy:
                continue
            match = min(common_prefix(entry.ids, prompt_ids), len(prompt_ids) - 1)
            key = (match, -len(entry.ids))
            if match > 0 and 2 * match >= len(entry.ids) and (best is None or key > best_key):
                best, best_key = entry, key
        return best, best_key[0]

    def fresh(self, policy: CachePolicy) -> EdgeSession:
        """A new session; when the cloud refuses one (its session or memory limit), pooled states
        are closed, oldest first, to make room."""
        while True:
            try:
                return self.edge.open_session(policy)
            except CloudError as e:
                if e.code not in FULL:
                    raise
                with self.lock:
                    victim = self.entries.pop(0) if self.entries else None
                    self.counters.evictions += victim is not None
                if victim is None:
                    raise
                log.info("the cloud refused a new session (%s): closing a pooled one", e.code.name)
                close_quietly(victim.session)

    def release(self, lease: Lease, ids: list[int]) -> None:
        """After a request: its session, cropped to `ids` (a prefix of what its caches hold), goes
        back to the pool; a session that cannot be made consistent, or may not be pooled, is closed."""
        session = lease.session
        session.interrupt = None
        if not lease.poolable or self.closed.is_set():
            close_quietly(session)
            return
        try:
            session.abandon(min(len(ids), session.length))  # replies in flight taken, then edge and cloud cropped
        except (SplitLMError, CloudError) as e:
            log.warning("closing a session that cannot be pooled: %s", e)
            close_quietly(session)
            return
        entry = Pooled(
            session,
            ids[: session.length],
            edge_bytes(session),
            self.cloud_token_bytes * min(session.length, session.policy.retention),
        )
        if max(entry.edge_bytes, entry.cloud_bytes) > self.limits.cap_bytes:  # alone over the cap: the others stay
            with self.lock:
                self.counters.evictions += 1
            close_quietly(session)
            return
        with self.lock:
            self.entries.append(entry)
            victims = self._over_limits()
        for victim in victims:
            close_quietly(victim.session)

    def _over_limits(self) -> list[Pooled]:
        """Take the least recently used states out until the rest fits the limits (under the lock)."""
        victims = []
        cap = self.limits.cap_bytes
        while self.entries:
            usage = self._usage()
            if usage.sessions <= self.limits.sessions and usage.edge_bytes <= cap and usage.cloud_bytes <= cap:
                break
            victims.append(self.entries.pop(0))
        self.counters.evictions += len(victims)
        return victims

    def _usage(self) -> PoolUsage:
        return PoolUsage(
            len(self.entries), sum(e.edge_bytes for e in self.entries), sum(e.cloud_bytes for e in self.entries)
        )

    def usage(self) -> PoolUsage:
        with self.lock:
            return self._usage()

    # -- idle time and shutdown ------------------------------------------------------------------------
    def expire(self, now: float | None = None) -> int:
        """Close the states idle for the pool's ttl (none if it has none); returns how many."""
        if self.limits.ttl_s <= 0:
            return 0
        now = time.monotonic() if now is None else now
        with self.lock:
            old = [e for e in self.entries if now - e.since >= self.limits.ttl_s]
            self.entries = [e for e in self.entries if e not in old]
            self.counters.evictions += len(old)
        for entry in old:
            close_quietly(entry.session)
        return len(old)

    def _sweep(self) -> None:
        interval = max(0.05, min(5.0, self.limits.ttl_s / 4))
        while not self.closed.wait(interval):
            self.expire()

    def close(self) -> None:
        """Close every pooled state (requests still running close theirs when they finish)."""
        self.closed.set()
        with self.lock:
            entries, self.entries = self.entries, []
        for entry in entries:
            close_quietly(entry.session)
