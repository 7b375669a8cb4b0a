"""The cloud side of an edge session (`CloudLink`): its connection, session id and cache key, the
blocks sent and not yet answered (`Flight`), what the cloud holds as the edge counts it
(`CloudView`), and the head outputs of every committed token (`history`), from which whatever the
cloud lacks is re-sent (context rows, a replay after a failover: `splitlm.edge.replay`).

`splitlm.edge.session.EdgeSession` drives it; the replay and the streamed prefill use it through
its public methods."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from splitlm import SplitLMError
from splitlm.edge.backends import EdgeBackend
from splitlm.edge.connections import CloudConnections
from splitlm.edge.results import GenerationStats
from splitlm.model.device import to_host
from splitlm.transport.client import CloudError, PendingForward
from splitlm.transport.messages import Control, Forward, Open, PolicyChange, Result
from splitlm.transport.policy import CachePolicy

log = logging.getLogger(__name__)


@dataclass
class Flight:
    """One forward's block of new tokens, from its send until its keep is applied everywhere."""

    ids: list[int]
    h: torch.Tensor  # [T, D] head outputs of the new tokens
    positions: list[int]
    mask: torch.Tensor | None
    rows: list[int] | None
    start: int  # committed entries before the block (edge)
    argmax: bool = False  # the reply's result is each row's greedy token, not its logits
    extras: int = 0  # > 0: also each row's `extras` likeliest ids and final hidden state (`StepResult`), for drafters
    allowed: torch.Tensor | None = None  # [R, V] bool: with argmax, each row's greedy token among these (a grammar's)
    sent: PendingForward | None = None
    edge_s: float = 0.0  # head (and later tail) compute
    serialize_s: float = 0.0
    overlapped: bool = False  # sent while an earlier forward was still in flight
    bytes_up: int = 0  # of its request
    keep: list[int] | None = None  # which of its entries stay (None: all); set when the block is settled
    settled: bool = False
    void: bool = False  # rolled back before its reply came: the reply is discarded
    first_sent: float = 0.0  # perf_counter() of its first send
    replayed: bool = False  # the first block a failover re-sent (its stall is counted)
    feature_rows: list[int] | None = (
        None  # the new tokens whose three hidden states the edge keeps (`StepResult.features`)
    )

    @property
    def n_rows(self) -> int:
        """R: the rows whose outputs the step asks for (every new token when no rows were named)."""
        return len(self.ids) if self.rows is None else len(self.rows)

    def settle(self, keep: list[int] | None) -> None:
        """Its entries `keep` stay (None: all)."""
        self.keep, self.settled = (None if keep is None else list(keep)), True

    def roll_back(self) -> None:
        """Rolled back before its reply came: the reply is to be dropped."""
        self.void = True

    def drop_reply(self) -> None:
        """Its reply will not come (a new cloud session was not sent it): taking it gives none."""
        self.sent = None

    def replayed_first(self) -> None:
        """A failover re-sent it first: its stall is counted when its reply comes."""
        self.replayed = True

    def stall_s(self, now: float) -> float:
        """Seconds from its first send to `now` (perf_counter()), once, if a failover re-sent it first; else 0."""
        stall = now - self.first_sent if self.replayed else 0.0
        self.replayed = False
        return stall


@dataclass
class CloudView:
    """The cloud's cache of one session as the edge counts it, and the keep and crop it still owes
    the cloud (piggy-backed on the next FORWARD)."""

    committed: int = 0  # committed entries the cloud holds (a prefix; a suffix under window:N)
    pending: int = 0  # size of the cloud's pending block
    keep: list[int] | None = None  # to piggy-back on the next FORWARD
    crop: int | None = None

    def forget(self) -> None:
        """The cloud holds nothing of the session (revoked, a policy that keeps nothing, a new session)."""
        self.committed, self.pending, self.keep, self.crop = 0, 0, None, None

    def settle(self, keep: list[int] | None, kept: int) -> None:
        """The pending block is resolved with `keep` (None: all), `kept` of its entries staying."""
        if keep is not None and self.pending:
            self.keep = list(keep)
        self.committed += kept if self.pending else 0
        self.pending = 0

    def missing(self, length: int, window: int | None) -> int:
        """How many of the edge's `length` committed rows, counted from the end, the cloud lacks
        (under a window policy: its last `window`, when it holds none)."""
        if window is not None:
            return 0 if self.committed else min(length, window)
        return length - self.committed

    def sent(self, tokens: int, context: int, retained: bool) -> None:
        """A block of `tokens` went up after `context` context rows, with the keep and crop owed; a
        policy that keeps nothing (`retained` False) leaves the cloud holding nothing."""
        self.keep = self.crop = None
        self.pending = tokens if retained else 0
        self.committed = self.committed + context if retained else 0

    def rebuilt(self, n: int) -> None:
        """A new session was sent the first `n` committed rows as blocks of their own (a replay's rebuild)."""
        self.committed = n

    def counted(self, cache_len: int) -> None:
        """The cloud's own count of its cache after the pending block (a window trims it)."""
        self.committed = cache_len - self.pending

    def crop_to(self, n: int, length: int) -> None:
        """The edge crops its `length` committed tokens to the first `n`: the cloud loses those past
        `n` (the cloud applies a crop before a keep; when only kept entries go, the keep shortens)."""
        cloud_n = max(0, n - (length - self.committed))  # the oldest entries the cloud does not hold come first
        if cloud_n >= self.committed:
            return
        before = self.committed - len(self.keep or [])
        if self.keep is not None and cloud_n >= before:  # only kept entries go: shorten the keep
            self.keep = self.keep[: cloud_n - before]
        else:
            self.keep = None
            self.cut(cloud_n)
        self.committed = cloud_n

    def cut(self, n: int) -> None:
        """Owe the cloud a crop to its first `n` entries (the tightest of those owed)."""
        self.crop = n if self.crop is None else min(self.crop, n)

    def rewound(self, n: int) -> None:
        """A guessed keep was wrong: the cloud keeps its first `n` entries; the rest goes up again."""
        self.keep, self.pending = None, 0
        self.cut(n)
        self.committed = n


@dataclass
class Reply:
    """A step's RESULT as taken off the link, and what taking it cost."""

    result: Result | None  # None: a void block a failover did not re-send
    bytes_down: int = 0
    serialize_s: float = 0.0  # its decryption and decoding

    @property
    def compute_s(self) -> float:
        """The cloud's compute for it."""
        return self.result.compute_s if self.result is not None else 0.0

    @property
    def network_s(self) -> float:
        """The wait for it less the cloud's compute and the decoding: the network's share."""
        wait_s = self.result.wait_s if self.result is not None else 0.0
        return max(0.0, wait_s - self.compute_s - self.serialize_s)


class StepObserver(Protocol):
    """Sees every FORWARD an edge's sessions send and every RESULT they take, in order (`Edge.observer`;
    the load generator's trace recorder, `splitlm.bench.trace`). Called on the session's thread."""

    def sent(self, request: Forward) -> None: ...

    def received(self, result: Result | None) -> None: ...


class CloudLink:
    """One cloud session as an edge session drives it. A lost cloud surfaces as a recoverable
    `CloudError` from `send`, `take`, `revoke` or `tighten`; the session then fails over
    (`splitlm.edge.replay.failover`) and goes on.

    It keeps the head layers' outputs of every committed token (`history`, [L, D]), so that whatever
    the cloud does not hold under the cache policy (`none`, after `revoke`, a new session after a
    failover) is re-sent as context rows instead of being recomputed."""

    def __init__(
        self,
        connections: CloudConnections,
        backend: EdgeBackend,
        policy: CachePolicy,
        wire_dtype: str,
        split: int,
        observer: StepObserver | None = None,
    ):
        self.connections, self.backend, self.policy, self.wire_dtype = connections, backend, policy, wire_dtype
        self.split, self.observer = split, observer
        self.key = AESGCM.generate_key(bit_length=256) if policy.sealed else None  # never leaves this session
        self.client, self.id = connections.open_session(self.open_request())
        self.history = torch.zeros(
            0, backend.cfg.hidden_size, device=backend.device
        )  # [L, D] fp32 (the residual stream)
        self.history_pos: list[int] = []
        self.flights: deque[Flight] = deque()  # sent, reply not yet taken (oldest first)
        self.cloud = CloudView()
        self.stats = GenerationStats()

    def open_request(self) -> Open:
        """The OPEN of this session's cloud side (also after a failover)."""
        return Open(self.wire_dtype, self.policy, self.backend.authorised())

    def control(self) -> Control:
        """The control tuple of this session's next request."""
        return Control(
            cache=self.policy.retention > 0,
            window=self.policy.window,
            dtype=self.wire_dtype,
            split=self.split,
            key=self.key,
        )

    def context_rows(self, length: int) -> int:
        """How many of the session's `length` committed rows, counted from the end, the cloud lacks."""
        return self.cloud.missing(length, self.policy.window)

    def step_limit(self, n_ids: int, n_rows: int, length: int) -> int | None:
        """The most tokens one forward of `n_ids` tokens (`n_rows` rows asked, after `length` committed) may
        carry, where a limit is exceeded: the cache window, the rows of logits a reply may hold, the
        cloud's tokens per forward (re-sent context rows count); None when the step fits."""
        per_forward = self.client.info.limits.max_tokens_per_forward
        room = max(1, per_forward - self.context_rows(length)) if per_forward else None
        exceeded = [
            cap
            for cap, n in ((self.policy.window, n_ids), (self.backend.max_logit_rows, n_rows), (room, n_ids))
            if cap is not None and n > cap
        ]
        return min(exceeded) if exceeded else None

    def too_long(self, n_ids: int, n_rows: int) -> SplitLMError:
        """The error for a step of `n_ids` tokens (`n_rows` rows asked) over `step_limit` that cannot go in chunks."""
        return SplitLMError(
            f"a step of {n_ids} tokens ({n_rows} rows of logits) exceeds the cache window "
            f"({self.policy.window}) or the rows of logits one reply may hold "
            f"({self.backend.max_logit_rows})"
        )

    def commit(self, h: torch.Tensor, positions: list[int], keep: list[int] | None) -> None:
        """The pending block is settled: its kept entries' head outputs `h` [K, D] join the history."""
        self.history = torch.cat([self.history, h])
        self.history_pos += positions
        self.cloud.settle(keep, len(positions))

    def crop(self, n: int, length: int) -> None:
        """Keep the first n of the session's `length` committed tokens (the cloud is told with the next request)."""
        self.cloud.crop_to(n, length)
        self.history, self.history_pos = self.history[:n], self.history_pos[:n]

    def rewind(self, n: int, h: torch.Tensor | None, positions: list[int]) -> None:
        """Back to the first n committed tokens and every block in flight void; then `h` [R, D] (at
        `positions`) committed on the edge, to go up as context rows with the next request."""
        for later in self.flights:
            later.roll_back()
        self.history, self.history_pos = self.history[:n], self.history_pos[:n]
        if h is not None:
            self.history = torch.cat([self.history, h])
            self.history_pos += positions
        self.cloud.rewound(n)

    def send(self, f: Flight, c: int) -> None:
        """Send block `f` after `c` context rows. If the cloud is gone (a recoverable `CloudError`) `f`
        stays in flight: the failover re-sends it."""
        self.flights.append(f)
        try:
            self.transmit(f, c)
        except CloudError as e:
            if not e.recoverable:
                self.flights.pop()
            raise

    def void_flights(self) -> None:
        """Every block in flight is rolled back: its reply is to be dropped."""
        for f in self.flights:
            f.roll_back()

    def owed(self) -> list[Flight]:
        """The blocks in flight that a new cloud session is to be sent again (oldest first); the first
        is marked as replayed (its stall is counted)."""
        for f in self.flights:
            if f.void:
                f.drop_reply()  # not re-sent: its reply is dropped unread
        owed = [f for f in self.flights if not f.void]
        if owed:
            owed[0].replayed_first()
        return owed

    def transmit(self, f: Flight, c: int) -> None:
        """Send block `f` to the cloud after the last `c` committed rows before it (context rows), with
        the keep and crop the cloud still owes; then count what the cloud holds."""
        client = self.client
        start = time.perf_counter()
        sent = torch.cat([self.history[f.start - c : f.start], f.h]) if c else f.h  # [C + T, D]
        sent = to_host(sent)  # the wire codec reads host memory (one copy per step)
        sent_pos = self.history_pos[f.start - c : f.start] + f.positions if c else f.positions
        up, ser = client.bytes_up, client.serialize_s
        f.edge_s += time.perf_counter() - start
        f.first_sent = f.first_sent or start
        request = Forward(
            sent,
            torch.as_tensor(sent_pos, dtype=torch.long),
            f.mask,
            self.cloud.keep,
            self.cloud.crop,
            c,
            self.control(),
            self.backend.reply_rows(f.rows),
        )
        f.sent = client.send_forward(
            self.id, request, self.wire_dtype, self.backend.reply_elements(f.n_rows, sent.numel())
        )
        if self.observer is not None:
            self.observer.sent(request)
        f.serialize_s += client.serialize_s - ser
        f.bytes_up = client.bytes_up - up
        self.stats.bytes_up += f.bytes_up
        self.cloud.sent(len(f.ids), c, self.policy.retention > 0)

    def take(self, f: Flight) -> Reply:
        """Step `f`'s reply (the oldest in flight), its round trip counted in the stats (all but the edge's
        compute). If the cloud is gone (a recoverable `CloudError`) `f` stays in flight: take it again
        after the failover."""
        if not self.flights or self.flights[0] is not f:
            raise SplitLMError("replies are taken in the order the steps were sent")
        reply = Reply(*self._receive(f))
        self.flights.popleft()
        if self.observer is not None:
            self.observer.received(reply.result)
        s = self.stats
        s.round_trips += 1
        s.bytes_down += reply.bytes_down
        s.cloud_compute_s += reply.compute_s
        s.serialize_s += f.serialize_s + reply.serialize_s
        s.network_s += reply.network_s
        return reply

    def _receive(self, f: Flight) -> tuple[Result | None, int, float]:
        """Step `f`'s RESULT (None: a void block a failover did not re-send), with the bytes down and the
        seconds of decryption and decoding that taking it cost on the connection it came from."""
        client = self.client
        down, ser = client.bytes_down, client.serialize_s
        if f.sent is None:
            return None, 0, 0.0
        result = client.receive_forward(f.sent)
        return result, client.bytes_down - down, client.serialize_s - ser

    def revoke(self) -> None:
        """Wipe the cloud's cache of this session now (a recoverable `CloudError`: fail over, then again)."""
        self.request_policy(PolicyChange(revoke=True))
        self.cloud.forget()

    def tighten(self, cache_policy: str | CachePolicy) -> None:
        """Switch to a tighter cache policy (see `EdgeSession.tighten`; a recoverable `CloudError`: fail
        over, then again)."""
        try:
            new = CachePolicy.parse(cache_policy)
        except ValueError as e:
            raise SplitLMError(str(e)) from None
        if not self.policy.allows(new):
            raise SplitLMError(f"cache policy {self.policy} cannot be loosened to {new}")
        if new.mode == "window":
            self.policy = new
            return
        if new.sealed and self.key is None:
            self.key = AESGCM.generate_key(bit_length=256)
        self.request_policy(PolicyChange(new, key=self.key if new.sealed else None))
        self.policy = new
        if new.retention == 0:
            self.cloud.forget()

    def request_policy(self, change: PolicyChange) -> None:
        """A POLICY request (the session is idle)."""
        self.client.policy(self.id, change)

    def reopen(self, deadline: float) -> None:
        """Drop the failed connection and open a new, empty cloud session (the next cloud first, until
        `deadline`, time.monotonic()); a sealed session gets a new cache key."""
        dead = self.client
        self.connections.drop(dead)
        self.client, self.id = self.connections.reconnect(self.open_request(), dead.url, deadline)
        if self.key is not None:
            self.key = AESGCM.generate_key(bit_length=256)

    def resume(self, deadline: float) -> None:
        """The cloud freed this session (PREEMPTED): a new, empty session on the same connection (the replies
        still owed on it are taken and dropped first); when that cloud is full or gone, `reopen`."""
        try:
            self.client.drop_replies()
            self.id = self.client.open(self.open_request()).session
        except CloudError as e:
            if not e.recoverable:
                raise
            log.info("cannot reopen on %s (%s): trying the clouds in turn", self.client.url, e)
            self.reopen(deadline)
            return
        if self.key is not None:
            self.key = AESGCM.generate_key(bit_length=256)

    def close(self) -> None:
        """End the cloud session; its connection goes back to the pool (or is dropped if it failed)."""
        try:
            self.client.close_session(self.id)
        except CloudError as e:
            log.warning("dropping a cloud connection: %s", e)
            self.connections.drop(self.client)
        else:
            self.connections.give(self.client)
